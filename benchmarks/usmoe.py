"""USMoE training-free budget sweep (arXiv 2503.22996): validation loss vs routed pairs.

Trains one small top-2 token-choice MoE on the real ``mix`` corpus with moelab's training loop
(or takes ``--run DIR``), then, without any further training, swaps the router of every MoE
layer (keeping the learned router weight; :func:`moelab.models.with_router`) and scores the
validation split at 100%, 86%, 70% and 50% of T·k routed pairs (per sequence, exactly
``round(f·k·S)`` pairs) for:

- top-k (reduced k): every token keeps its first choice; the budget's remaining pairs go to the
  highest-weight second choices (the lowest-weight second choices are dropped); the kept
  weights are renormalised per token, as the model's ``norm_topk_prob`` does.
- random cut: random pairs of the top-2 plan are dropped down to the budget (uniformly over
  all pairs of the sequence), kept weights renormalised per token.
- expert choice: each expert of a sequence takes its best tokens by softmax score, at most
  ceil(B/E) per expert, the best B pairs overall (the LP with a per-expert cap); weights
  renormalised over each token's selected experts.
- USMoE: the unified score (r = 0.5, (2/E)·sigmoid) ranked over the sequence's S × E table;
  "w/sel" renormalises the combine weights over each token's selected experts (matches the
  trained model's convention), "paper w" uses w itself as the released code does.

Usage::

    python benchmarks/usmoe.py                      # trains ~4 min, then sweeps (~3 min)
    python benchmarks/usmoe.py --run runs/main      # sweep an existing run
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch

from moelab.core.config import RouterConfig
from moelab.core.plan import RoutingPlan
from moelab.core.routers import Router
from moelab.core.routers.usmoe import budget_pairs
from moelab.data import load_tokenizer
from moelab.models import load_model, with_router
from moelab.train.config import TrainConfig
from moelab.train.evaluate import evaluate
from moelab.train.loop import RUN_FILE, prepare_data, train
from moelab.train.presets import small_model_config

BUDGETS = (1.0, 0.86, 0.7, 0.5)


class _BudgetedTopK(Router):
    """Top-k token choice cut to ``round(f·k·S)`` pairs per sequence (benchmark baselines)."""

    uses_batch_shape = True

    def __init__(self, config: RouterConfig, hidden_size: int, fraction: float, mode: str, seed=0):
        super().__init__(config, hidden_size)
        self.fraction, self.mode = fraction, mode
        self.gen = torch.Generator().manual_seed(seed)

    def forward(self, x_TD, batch_shape=None, token_mask=None) -> RoutingPlan:
        logits = self.logits(x_TD)
        T, E = logits.shape
        k = self.config.top_k
        S = batch_shape[-1] if batch_shape is not None and len(batch_shape) >= 2 else T
        G = T // S
        probs = logits.softmax(-1)
        top_w, top_i = probs.topk(k, dim=-1)  # [T, k]
        n = budget_pairs(S, k, self.fraction)
        keep = torch.zeros(G, S * k, dtype=torch.bool)
        if self.mode == "reduced_k":
            # first choices always kept (n >= S at these budgets); fill with best 2nd choices
            w = top_w.view(G, S, k).clone()
            w[:, :, 0] = float("inf")
            order = w.reshape(G, S * k).argsort(dim=-1, descending=True, stable=True)
        else:  # random cut
            order = torch.stack([torch.randperm(S * k, generator=self.gen) for _ in range(G)])
        keep.scatter_(1, order[:, :n], True)
        keep = keep.view(T * k)
        token_idx = torch.arange(T).repeat_interleave(k)[keep]
        expert_idx = top_i.reshape(-1)[keep]
        weight = top_w.reshape(-1)[keep]
        denom = torch.zeros(T).index_add(0, token_idx, weight)
        weight = weight / denom.clamp_min(1e-20)[token_idx]
        return RoutingPlan(token_idx, expert_idx, weight, logits, probs, E)


def _usmoe(base: RouterConfig, f: float, **kw) -> RouterConfig:
    # Sequence scope (the training-free code's): it looks at future tokens, so these losses are
    # not causal LM scores (see the README); kept so the quoted table stays reproducible.
    return RouterConfig(
        num_experts=base.num_experts, top_k=base.top_k, kind="usmoe", budget_fraction=f,
        selection_scope="sequence", **kw,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, default=None, help="existing run folder (skip training)")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--time-budget", type=float, default=300.0, help="training seconds cap")
    ap.add_argument("--eval-tokens", type=int, default=16384, help="validation tokens/domain")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(args.seed)

    t0 = time.time()
    run = args.run
    if run is None:
        run = Path(tempfile.mkdtemp(prefix="usmoe-bench-")) / "run"
        tcfg = TrainConfig(
            data="mix", max_bytes_per_domain=600_000, seq_len=128, batch_size=16,
            steps=args.steps, lr=3e-3, warmup_steps=20, eval_every=10**6, eval_tokens=4096,
            checkpoint_every=0, log_every=50, time_budget_s=args.time_budget, seed=args.seed,
        )  # fmt: skip
        res = train(small_model_config(), tcfg, run, progress=False)
        print(f"trained {res.step} steps in {res.elapsed_s:.0f} s -> {run}")
    model = load_model(run)
    model.eval()
    tcfg = TrainConfig.from_dict(json.loads((run / RUN_FILE).read_text())["train"])
    _, _, val = prepare_data(tcfg, load_tokenizer(run))
    seq_len = tcfg.seq_len
    base = model.cfg.moe.router

    def score(m) -> float:
        r = evaluate(m, val, seq_len=seq_len, batch_size=16, max_tokens=args.eval_tokens)
        return r.overall.loss

    methods = {
        "top-k (reduced k)": lambda f: lambda c, D: _BudgetedTopK(c, D, f, "reduced_k"),
        "random cut": lambda f: lambda c, D: _BudgetedTopK(c, D, f, "random", args.seed),
        "expert choice": lambda f: _usmoe(
            base, f, usmoe_rate=0.0, usmoe_constraint="per_expert", usmoe_weight_norm="selected"
        ),
        "USMoE r=0.5 w/sel": lambda f: _usmoe(base, f, usmoe_weight_norm="selected"),
        "USMoE r=0.5 paper w": lambda f: _usmoe(base, f, usmoe_weight_norm="none"),
        "USMoE r=0 (softmax) w/sel": lambda f: _usmoe(
            base, f, usmoe_rate=0.0, usmoe_weight_norm="selected"
        ),
    }
    ref = score(model)
    table: dict[str, list[float]] = {}
    for name, make in methods.items():
        row = []
        for f in BUDGETS:
            if f == 1.0 and name in ("top-k (reduced k)", "random cut"):
                row.append(ref)
                continue
            row.append(score(with_router(model, make(f))))
        table[name] = row

    S, k = seq_len, base.top_k
    pairs = [budget_pairs(S, k, f) for f in BUDGETS]
    print(
        f"\nUSMoE training-free sweep: validation loss (nats/token) on mix; "
        f"top-{k} TC reference = {ref:.4f}; E={base.num_experts}, S={S}"
    )
    head = f"{'method':<28}" + "".join(
        f"{f'{int(f * 100)}% ({p})':>14}" for f, p in zip(BUDGETS, pairs, strict=True)
    )
    print(head + f"{'mean Δ<100%':>13}")
    print("-" * len(head + " " * 13))
    for name, row in table.items():
        delta = sum(v - ref for v in row[1:]) / (len(row) - 1)
        print(f"{name:<28}" + "".join(f"{v:>14.4f}" for v in row) + f"{delta:>+13.4f}")
    best = {f: min(table, key=lambda n, i=i: table[n][i]) for i, f in enumerate(BUDGETS) if f < 1.0}
    print("\nlowest loss at each reduced budget: " + ", ".join(
        f"{int(f * 100)}%: {n}" for f, n in best.items()
    ))  # fmt: skip
    print(f"total time {time.time() - t0:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"ref": ref, "budgets": BUDGETS, "table": table}))
    assert all(math.isfinite(v) for row in table.values() for v in row)


if __name__ == "__main__":
    main()
