"""Decode-sized expert calls: the fused CPU kernel against MKL's GEMM and the weight-read floor.

At a decode step each expert multiplies the 1-8 rows routed to it, so the call is bound by
reading the expert's weights. This times, side by side in one process (interleaved, median of
repeats, ``benchmarks/_timing.py``), L layers of one MoE's experts (SmolLM2-MoE's shape by
default: E = 8, D = 576, F = 1536, SwiGLU, 30 layers, so the weights come from DRAM, not cache)
at the row counts a batch of B tokens with top-k routing gives:

- ``kernel``: ``cpu_kernel.fused_experts``, the path ``MoELayer`` takes on CPU (1-8 rows per
  expert use its own streaming projection, more rows MKL's GEMM);
- ``mkl``: the same chain with ``torch.mm`` per expert, on every thread (the loop backend);
- ``read floor``: one pass over the same experts' weights (``torch.sum``), all threads;
- ``int8`` and ``int4``: the same shapes as quantized experts (``QuantizedExpertBank``,
  symmetric, group 64: what ``moelab quantize --bits 8|4 --method rtn`` stores), whose
  decode-sized experts run the packed-code kernel (``csrc/quant_cpu.cpp``).

It prints the float32 weight bytes read per call, each float32 candidate's GB/s, ``kernel /
floor``, and the quantized banks' speed against the float32 kernel (``int8 / kernel`` > 1 means
the int8 experts decode faster).

    python benchmarks/decode_experts.py                  # batches 1, 4, 8, 16
    python benchmarks/decode_experts.py --batches 1 8 --threads 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _timing import interleaved_medians
from moelab.core.config import ExpertsConfig
from moelab.core.experts import cpu_kernel
from moelab.core.experts.quantized import QuantizedExpertBank, QuantSpec


def row_counts(batch: int, experts: int, top_k: int, g: torch.Generator) -> torch.Tensor:
    """Rows per expert when each of ``batch`` tokens picks ``top_k`` distinct experts
    uniformly (an upcycled MoE's router is close to uniform)."""
    picks = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(batch)])
    return torch.bincount(picks.flatten(), minlength=experts)


def mkl_chain(x, w_in, w_down, counts):
    out, start, Fh = [], 0, w_down.shape[1]
    for e, c in enumerate(counts.tolist()):
        if c:
            h = torch.mm(x[start : start + c], w_in[e])
            out.append(torch.mm(F.silu(h[:, :Fh]) * h[:, Fh:], w_down[e]))
        start += c
    return torch.cat(out)


def quantized_bank(w_in, w_down, bits: int, group: int = 64) -> QuantizedExpertBank:
    """Random codes at ``bits`` in a bank of the float32 bank's shapes (speed only: the values
    are not a quantization of ``w_in``/``w_down``)."""
    E, D, W = w_in.shape
    spec = QuantSpec(method="rtn", bits=bits, group_size=group, symmetric=True,
                     act_order=False, lowrank="none", rank=0)  # fmt: skip
    bank = QuantizedExpertBank.empty(ExpertsConfig(hidden_size=D, ffn_hidden_size=W // 2), E, spec)
    for proj in bank.projections.values():
        proj.codes.random_(0, 256)
        proj.scales.copy_(torch.full(proj.scales.shape, 1e-3).half().view(torch.int16))
    return bank


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=576)
    ap.add_argument("--ffn", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    if min(args.batches) < 1 or not 1 <= args.top_k <= args.experts:
        ap.error("--batches must be >= 1 and --top-k in [1, --experts]")
    if cpu_kernel.kernel() is None:
        sys.exit("error: the fused CPU expert kernel is not available here")
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    E, D, Fh = args.experts, args.d_model, args.ffn
    banks = [
        (torch.randn(E, D, 2 * Fh, generator=g) / D**0.5, torch.randn(E, Fh, D, generator=g) / Fh**0.5)
        for _ in range(args.layers)
    ]  # fmt: skip
    per_expert = (D * 2 * Fh + Fh * D) * 4
    print(f"E={E} k={args.top_k} D={D} F={Fh} layers={args.layers} "
          f"threads={torch.get_num_threads()} ({per_expert / 1e6:.1f} MB per expert)")  # fmt: skip
    quantized = {b: [quantized_bank(w_in, w_down, b) for w_in, w_down in banks] for b in (8, 4)}
    print("| batch | experts used | rows per used expert | MB read | kernel GB/s | mkl GB/s "
          "| read floor GB/s | kernel / mkl | kernel / floor | int8 / kernel | int4 / kernel |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for B in args.batches:
        counts = row_counts(B, E, args.top_k, g)
        used = torch.nonzero(counts).flatten()
        x = torch.randn(int(counts.sum()), D, generator=g)
        want = mkl_chain(x, *banks[0], counts)
        got = cpu_kernel.fused_experts(x, *banks[0], counts, "swiglu")
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

        def kernel(x=x, counts=counts):
            for w_in, w_down in banks:
                cpu_kernel.fused_experts(x, w_in, w_down, counts, "swiglu")

        def mkl(x=x, counts=counts):
            for w_in, w_down in banks:
                mkl_chain(x, w_in, w_down, counts)

        def int8(x=x, counts=counts):
            for bank in quantized[8]:
                bank(x, counts)

        def int4(x=x, counts=counts):
            for bank in quantized[4]:
                bank(x, counts)

        views = [w[e] for bank in banks for w in bank for e in used.tolist()]

        def floor(views=views):
            for w in views:
                w.sum()

        with torch.inference_mode():
            fns = {"kernel": kernel, "mkl": mkl, "floor": floor, "int8": int8, "int4": int4}
            t = interleaved_medians(fns, args.repeats)
        nbytes = len(used) * per_expert * args.layers
        gbs = {k: nbytes / v / 1e9 for k, v in t.items()}
        rows = counts[used].float().mean().item()
        print(f"| {B} | {len(used)} | {rows:.1f} | {nbytes / 1e6:,.0f} | {gbs['kernel']:.1f} | "
              f"{gbs['mkl']:.1f} | {gbs['floor']:.1f} | {t['mkl'] / t['kernel']:.2f}x | "
              f"{gbs['kernel'] / gbs['floor']:.2f} | {t['kernel'] / t['int8']:.2f}x | "
              f"{t['kernel'] / t['int4']:.2f}x |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
