"""USMoE (arXiv 2503.22996) in the paper's settings, at CPU scale, over seeds.

Backbone like the paper's training-free models (OLMoE / Qwen1.5-MoE / DeepSeekMoE): softmax
token choice *without* top-k renormalisation, fine-grained experts (E=32, k=4), optionally a
shared expert, switch balancing 0.01 — trained on the real ``mix`` corpus until validation
loss flattens (the curve is printed). Then:

(a) training-free, as the paper evaluates it (MoEE/MTEB protocol, non-causal): embed held-out
    128-token windows and classify each window's source (KJV book, Shakespeare work, stdlib
    top-level module) with logistic regression on a stratified half of the windows. Two
    embeddings: the authors' MoEE (``Training_Free/moee.py``): the last token's final hidden
    state (HS), the raw router logits of *all* experts at the last token of every layer (RW),
    and their concatenation (MoEE), z-scored; and mean pooling (HS: mean hidden state; RW:
    per-layer mean of the *selected* routing weights). Routing
    rules, each ranked per window (``selection_scope="sequence"``) at 100 % and 86 % of S·k
    pairs: token choice (TC: at 86 % the weakest pairs are dropped), expert choice (EC: the LP
    with a per-expert cap), USMoE with the released sigmoid score and with the paper's EC-style
    score (``paper_expert_choice``).
(b) causal LM loss (bits per byte, validation split) with causal scopes only: TC, EC and USMoE
    ranked per time position across the evaluation batch (``position``, the authors' training
    code) and USMoE over the causal prefix, at 100 % and 86 %.
(c) training-based: USMoE as released (position scope, unified score, **no** balancing loss)
    trained from scratch with the same recipe, at equal pairs (100 %; ``--released-budgets``
    adds others), against the TC + balancing backbone at equal steps.

Claim (paper): up to 10 % better, or 14 % fewer pairs at competitive accuracy. Every number is
mean ± sd over ``--seeds`` seeds (seed = model init and data order); every seed is scored on
the same held-out documents and windows (split seed 0, ``TrainConfig.split_seed``), and each
rule is compared with the TC row of its seed as paired differences (mean ± sd, t and
bootstrap intervals, per-seed values; ``benchmarks/_paired.py``).

Usage::

    python benchmarks/usmoe.py                         # 3 seeds, 2400 steps, 2 workers
    python benchmarks/usmoe.py --seeds 1 --steps 200   # a quick look

The training runs go to ``--workers`` processes of ``--threads`` torch threads each.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from _paired import paired_block, paired_line
from _pool import run_jobs
from moelab.core.config import ExpertsConfig, LossConfig, MoEConfig, RouterConfig
from moelab.data import load_corpus, load_tokenizer
from moelab.models import ModelConfig, MoETransformer, load_model, with_router
from moelab.train.config import TrainConfig
from moelab.train.evaluate import evaluate
from moelab.train.loop import train, validation_streams

BUDGETS = (1.0, 0.86)
WINDOW = 128
SPLIT_SEED = 0  # one held-out set for every seed: differences are paired


def backbone(shared_expert: bool, router: RouterConfig | None = None, balance="switch"):
    """D=128, 4 layers, E=32 experts of width 128, top-4, unnormalised softmax top-k."""
    router = router or RouterConfig(num_experts=32, top_k=4, norm_topk_prob=False)
    return ModelConfig(
        vocab_size=256, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=WINDOW,
        moe=MoEConfig(
            router=router,
            experts=ExpertsConfig(
                hidden_size=128, ffn_hidden_size=128, shared_expert_size=128 if shared_expert else 0
            ),
            losses=LossConfig(load_balance=balance, aux_loss_coeff=1e-2, z_loss_coeff=1e-3),
        ),
    )  # fmt: skip


def train_cfg(seed: int, steps: int) -> TrainConfig:
    return TrainConfig(
        data="mix", max_bytes_per_domain=600_000, seq_len=WINDOW, batch_size=16, steps=steps,
        lr=3e-3, warmup_steps=30, eval_every=max(steps // 6, 1), eval_tokens=8192,
        checkpoint_every=0, log_every=max(steps // 6, 1), seed=seed, split_seed=SPLIT_SEED,
    )  # fmt: skip


def rules(scope: str) -> dict[str, Callable[[float], RouterConfig]]:
    """Routing rules at a budget fraction, all on the trained router weight."""

    def usmoe(f: float, **kw) -> RouterConfig:
        return RouterConfig(
            num_experts=32, top_k=4, kind="usmoe", budget_fraction=f, selection_scope=scope,
            usmoe_weight_norm="none", **kw,
        )  # fmt: skip

    out = {
        "TC": lambda f: usmoe(f, usmoe_rate=0.0, usmoe_constraint="per_token"),
        "EC": lambda f: usmoe(f, usmoe_rate=0.0, usmoe_constraint="per_expert"),
        "USMoE (code: sigmoid)": lambda f: usmoe(f),
        "USMoE (paper: EC-style)": lambda f: usmoe(f, usmoe_expert_score="paper_expert_choice"),
    }
    if scope == "position":
        out["USMoE causal prefix"] = lambda f: dataclasses.replace(
            usmoe(f), selection_scope="causal_prefix"
        )
    return out


def windows(seed: int, per_class: int = 16) -> tuple[list[list[int]], list[str], list[str]]:
    """Held-out windows of WINDOW+1 bytes with their source label and task name."""
    gen = torch.Generator().manual_seed(10_000 + SPLIT_SEED)  # the same windows every seed
    by_label: dict[tuple[str, str], list[str]] = {}
    for doc in load_corpus("mix", max_bytes_per_domain=600_000):
        task = {"kjv": "KJV book", "shakespeare": "Shakespeare work", "code": "stdlib module"}
        label = doc.name.split("/")[0] if doc.domain == "code" else doc.name
        by_label.setdefault((task[doc.domain], label), []).append(doc.text)
    ids, labels, tasks = [], [], []
    for (task, label), texts in sorted(by_label.items()):
        data = "\n".join(texts).encode("utf-8")
        if len(data) < (WINDOW + 1) * per_class * 2:
            continue  # too short for distinct windows: not a class
        starts = torch.randperm(len(data) // (WINDOW + 1), generator=gen)[:per_class]
        for s in starts.tolist():
            ids.append(list(data[s * (WINDOW + 1) : s * (WINDOW + 1) + WINDOW]))
            labels.append(label)
            tasks.append(task)
    return ids, labels, tasks


@torch.no_grad()
def embed(model: MoETransformer, ids: list[list[int]]) -> dict[str, torch.Tensor]:
    """Window embeddings ``[N, ·]`` by protocol and kind: ``"last HS"`` the last token's final
    hidden state ``[N, D]``, ``"last RW"`` the raw router logits of all experts at the last
    token, every layer ``[N, L·E]``, ``"last MoEE"`` both (the authors' ``moee.py``);
    ``"mean HS"`` the mean hidden state and ``"mean RW"`` the per-layer mean of the selected
    routing weights (zero for unselected experts)."""
    model.eval()
    routers = [b.ffn.router for b in model.blocks if b.is_moe]
    logits: list[torch.Tensor] = []
    hooks = [
        r.register_forward_pre_hook(lambda m, a: logits.append(a[0].float() @ m.weight.float().T))
        for r in routers
    ]  # the router's input [T, D] -> raw logits [T, E], before any selection rule
    out_rows: dict[str, list[torch.Tensor]] = {
        k: [] for k in ("last", "last RW", "mean", "mean RW")
    }
    try:
        for i in range(0, len(ids), 32):
            x = torch.tensor(ids[i : i + 32])
            logits.clear()
            out = model(x)
            B, S = x.shape
            out_rows["last"].append(out.hidden_states[:, -1])
            out_rows["mean"].append(out.hidden_states.mean(1))
            out_rows["last RW"].append(torch.cat([lg.view(B, S, -1)[:, -1] for lg in logits], 1))
            per_layer = []
            for plan in out.plans:
                dense = torch.zeros(B * S, plan.num_experts)
                dense[plan.token_idx, plan.expert_idx] = plan.weight.float()
                per_layer.append(dense.view(B, S, -1).mean(1))
            out_rows["mean RW"].append(torch.cat(per_layer, dim=1))
    finally:
        for h in hooks:
            h.remove()
    cat = {k: torch.cat(v) for k, v in out_rows.items()}
    return {
        "last HS": cat["last"],
        "last RW": cat["last RW"],
        "last MoEE": torch.cat([cat["last"], cat["last RW"]], 1),
        "mean HS": cat["mean"],
        "mean RW": cat["mean RW"],
    }


def accuracy(features: torch.Tensor, labels: list[str], seed: int) -> float:
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import train_test_split
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    x_tr, x_te, y_tr, y_te = train_test_split(
        features.numpy(), labels, test_size=0.5, stratify=labels, random_state=seed
    )
    clf = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000))
    return float(clf.fit(x_tr, y_tr).score(x_te, y_te))


def bits_per_byte(model: MoETransformer, val, tokens: int) -> float:
    return evaluate(
        model, val, seq_len=WINDOW, batch_size=16, max_tokens=tokens
    ).overall.bits_per_byte


def val_curve(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["bpb"] for r in rows if r.get("split") == "val"]


def fmt(values: list[float], scale: float = 1.0) -> str:
    m = statistics.fmean(values) * scale
    sd = statistics.stdev(values) * scale if len(values) > 1 else 0.0
    return f"{m:.4f} ± {sd:.4f}" if scale == 1.0 else f"{m:.1f} ± {sd:.1f}"


def backbone_job(root: Path, seed: int, args: argparse.Namespace) -> dict:
    """Train seed ``seed``'s TC backbone, then score it in (a), (b) and (c)."""
    t0 = time.time()
    res: dict = {"a": {}, "b": {}, "c": {}}
    run = root / f"tc{seed}"
    train(backbone(args.shared_expert), train_cfg(seed, args.steps), run, progress=False)
    res["curve"] = val_curve(run)
    model = load_model(run)
    val = validation_streams(train_cfg(seed, args.steps), load_tokenizer(run))
    print(f"seed {seed}: backbone trained in {time.time() - t0:.0f} s", flush=True)
    ids, labels, tasks = windows(seed, args.windows_per_class)
    for name, make in rules("sequence").items():
        for f in BUDGETS:
            feats_by_kind = embed(with_router(model, make(f)), ids)
            for task in sorted(set(tasks)):
                keep = [i for i, t in enumerate(tasks) if t == task]
                lab = [labels[i] for i in keep]
                for kind, feats in feats_by_kind.items():
                    key = f"{task} {kind} | {name} @{int(f * 100)}%"
                    res["a"][key] = accuracy(feats[keep], lab, SPLIT_SEED)
    for name, make in rules("position").items():
        for f in BUDGETS:
            res["b"][f"{name} @{int(f * 100)}%"] = bits_per_byte(
                with_router(model, make(f)), val, args.eval_tokens
            )
    res["c"]["TC + balancing (backbone)"] = bits_per_byte(model, val, args.eval_tokens)
    print(f"seed {seed}: backbone scored in {time.time() - t0:.0f} s", flush=True)
    return res


def released_job(root: Path, seed: int, f: float, args: argparse.Namespace) -> dict:
    """(c): train USMoE as released (position scope, no balancing loss) at budget ``f``."""
    t0 = time.time()
    router = RouterConfig(
        num_experts=32, top_k=4, kind="usmoe", budget_fraction=f,
        selection_scope="position", usmoe_weight_norm="none",
    )  # fmt: skip
    run = root / f"usmoe{seed}-{int(f * 100)}"
    cfg = backbone(args.shared_expert, router, balance="none")
    train(cfg, train_cfg(seed, args.steps), run, progress=False)
    val = validation_streams(train_cfg(seed, args.steps), load_tokenizer(run))
    bpb = bits_per_byte(load_model(run), val, args.eval_tokens)
    print(f"seed {seed}: USMoE @{int(f * 100)}% trained in {time.time() - t0:.0f} s", flush=True)
    return {"c": {f"USMoE as released @{int(f * 100)}% (no balancing)": bpb}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2400)
    ap.add_argument("--shared-expert", action="store_true", help="backbone with a shared expert")
    ap.add_argument("--eval-tokens", type=int, default=16384, help="validation tokens per domain")
    ap.add_argument("--windows-per-class", type=int, default=64, help="part (a) windows per source")
    ap.add_argument("--released-budgets", type=float, nargs="*", default=[1.0],
                    help="part (c): pair budgets of the trained USMoE runs (none: omit (c))")  # fmt: skip
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--workers", type=int, default=2, help="training runs in parallel processes")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    args = ap.parse_args()
    t0 = time.time()
    root = Path(tempfile.mkdtemp(prefix="usmoe-bench-"))
    jobs = [(backbone_job, (root, seed, args)) for seed in range(args.seeds)]
    jobs += [(released_job, (root, seed, f, args))
             for seed in range(args.seeds) for f in args.released_budgets]  # fmt: skip
    parts = run_jobs(jobs, args.workers, args.threads)
    res: dict[str, dict[str, list[float]]] = {"a": {}, "b": {}, "c": {}}
    for part in parts:  # seed order within each kind of job
        for section in res:
            for key, v in part.get(section, {}).items():
                res[section].setdefault(key, []).append(v)
    curves = [part["curve"] for part in parts if "curve" in part]

    n = args.seeds
    print(
        f"\nUSMoE benchmark: E=32 k=4 unnormalised softmax TC backbone"
        f"{' + shared expert' if args.shared_expert else ''}, {args.steps} steps, "
        f"{n} seed(s), mean ± sd"
    )
    for seed, c in enumerate(curves):
        print(f"  validation bits/byte curve, seed {seed}: " + " ".join(f"{v:.3f}" for v in c)
              + f"  (last interval: {c[-1] - c[-2]:+.3f})")  # fmt: skip
    print("\n(a) training-free, non-causal (per-window ranking): source classification accuracy %")
    for key, vals in res["a"].items():
        print(f"  {key:<62} {fmt(vals, 100.0)}")
    print("\n(a) paired: each rule − TC @100 % of the same seed, task and embedding (points %)")
    for key, vals in res["a"].items():
        head = key.split(" | ")[0]
        base = f"{head} | TC @100%"
        if key != base:
            print(f"  {key:<62} {paired_line(vals, res['a'][base], 100.0)}")
    print("\n(b) causal LM, validation bits/byte (causal scopes only)")
    for key, vals in res["b"].items():
        print(f"  {key:<62} {fmt(vals)}")
    print("\n".join(["(b) paired against TC @100 %", *paired_block(res["b"], "TC @100%")]))
    if res["c"]:
        print("\n(c) training-based, validation bits/byte at equal steps")
        for key, vals in res["c"].items():
            print(f"  {key:<62} {fmt(vals)}")
        base = "TC + balancing (backbone)"
        print("\n".join(["(c) paired against the backbone", *paired_block(res["c"], base)]))
    print(f"\ntotal time {time.time() - t0:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"curves": curves, **res}, indent=1))


if __name__ == "__main__":
    main()
