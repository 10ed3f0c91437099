"""Decode-sized dense projections: the streaming CPU kernel against MKL and the weight-read floor.

At a decode step each attention projection and the LM head multiply the batch's 1-8 rows by
their weight, so the call is bound by reading the weight. This times, side by side in one
process (interleaved, median of repeats, ``benchmarks/_timing.py``), the dense projections of
a whole decode step of SmolLM2-135M's shape by default (30 layers of q/k/v/o projections
576→576, 576→192, 576→192, 576→576, then the 576→49,152 LM head: 28.3 M + 26.5 M weights, so
they come from DRAM, not cache):

- ``kernel``: ``cpu_kernel.dense_rows``, the path ``moelab.models.linear.Linear`` takes at
  inference for 1-8 float32 CPU rows;
- ``mkl``: ``F.linear`` (what ``nn.Linear`` runs: MKL's GEMM), on every thread;
- ``read floor``: one pass over the same weights (``torch.sum``), all threads.

It prints the float32 weight bytes read per step, each candidate's GB/s, ``mkl / kernel``
(> 1: the kernel is faster) and ``kernel / floor``.

    python benchmarks/decode_linear.py                  # batches 1, 4, 8
    python benchmarks/decode_linear.py --batches 1 --threads 1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _timing import interleaved_medians
from moelab.core.experts import cpu_kernel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--d-model", type=int, default=576)
    ap.add_argument("--kv-width", type=int, default=192, help="k/v projection width (GQA)")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    if not 1 <= min(args.batches) <= max(args.batches) <= cpu_kernel.DENSE_MAX_ROWS:
        ap.error(f"--batches must be in [1, {cpu_kernel.DENSE_MAX_ROWS}]")
    if cpu_kernel.kernel() is None:
        sys.exit("error: the fused CPU kernel is not available here")
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    D, kv = args.d_model, args.kv_width
    shapes = [(D, D), (kv, D), (kv, D), (D, D)] * args.layers + [(args.vocab, D)]
    weights = [torch.randn(n, k, generator=g) / k**0.5 for n, k in shapes]
    nbytes = sum(w.numel() for w in weights) * 4
    print(f"D={D} kv={kv} vocab={args.vocab} layers={args.layers} "
          f"threads={torch.get_num_threads()} ({nbytes / 1e6:.0f} MB per step)")  # fmt: skip
    print("| batch | kernel GB/s | mkl GB/s | read floor GB/s | mkl / kernel | kernel / floor |")
    print("|---|---|---|---|---|---|")
    for B in args.batches:
        x = torch.randn(B, D, generator=g)
        for w in (weights[0], weights[-1]):
            want = F.linear(x.double(), w.double())
            torch.testing.assert_close(
                cpu_kernel.dense_rows(x, w).double(), want, rtol=1e-5, atol=1e-5
            )

        def kernel(x=x):
            for w in weights:
                cpu_kernel.dense_rows(x, w)

        def mkl(x=x):
            for w in weights:
                F.linear(x, w)

        def floor():
            for w in weights:
                w.sum()

        with torch.inference_mode():
            t = interleaved_medians({"kernel": kernel, "mkl": mkl, "floor": floor}, args.repeats)
        gbs = {k: nbytes / v / 1e9 for k, v in t.items()}
        print(f"| {B} | {gbs['kernel']:.1f} | {gbs['mkl']:.1f} | {gbs['floor']:.1f} | "
              f"{t['mkl'] / t['kernel']:.2f}x | {gbs['kernel'] / gbs['floor']:.2f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
