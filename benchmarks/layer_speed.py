"""Speed of moelab's MoELayer against transformers' MoE blocks and the dense-GEMM floor.

For every selected shape (E experts, top-k, width D, expert FFN width F, T tokens) it measures,
side by side in one process, forward and forward+backward tokens/s of:

- moelab ``MoELayer`` (token choice, softmax → top-k → renormalise, SwiGLU experts, dropless,
  switch balance loss + z-loss on as in training) with each expert backend: ``torch``
  (``torch.nn.functional.grouped_mm``) and ``loop`` (one ``torch.mm`` per expert);
- transformers' ``MixtralSparseMoeBlock`` and ``Qwen3MoeSparseMoeBlock`` (``norm_topk_prob``),
  built from tiny configs with the same E, k, D, F, with every experts implementation that
  runs on CPU (``eager``, ``batched_mm``, ``grouped_mm``; the block reads
  ``config._experts_implementation`` on every call, set here through the config's
  ``experts_implementation`` kwarg; a standalone block whose config leaves it None runs eager);
- the dense floor: the same active FLOPs as one dense SwiGLU chain
  ``x[T, D] @ W1[D, 2kF] → silu·mul → @ W2[kF, D]``, no routing.

All implementations share one input and the same weights (copied from the moelab layer), and
their outputs (and input gradients) are checked against moelab's once per shape before timing.
"forward" runs in training mode under ``torch.no_grad()``; "fwd+bwd" backpropagates
``out.sum()`` (plus the aux losses for moelab; the transformers blocks compute none) into the
weights and the input. fp32, default thread count, fixed seed. Timings: warm-up, calibrated
inner loops, implementations interleaved round-robin, median of the repeats.

Usage:
    PYTHONPATH=src python benchmarks/layer_speed.py                 # all rows (~3-5 min, 2 cores)
    PYTHONPATH=src python benchmarks/layer_speed.py --quick         # fewer repeats
    PYTHONPATH=src python benchmarks/layer_speed.py --rows e64-t64 e64-t1
    PYTHONPATH=src python benchmarks/layer_speed.py --profile --rows e64-t4096  # + where moelab spends time
    PYTHONPATH=src python benchmarks/layer_speed.py --json results.json
    PYTHONPATH=src python benchmarks/layer_speed.py --contended --rows e8-t1 e64-t1 e64-t64

``--contended`` runs a busy-loop process pinned to the last core for the whole run (a user's
machine where another program holds a core) and adds, per row, moelab ``auto`` against the
better of the ``torch`` and ``loop`` backends.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import interleaved_medians
from moelab.core.config import ExpertsConfig, LossConfig, MoEConfig, RouterConfig
from moelab.core.layer import MoELayer

HF_IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")
MOELAB_BACKENDS = ("auto", "torch", "loop")
CHECK_TOL = 1e-4


@dataclass(frozen=True)
class Shape:
    E: int
    k: int
    D: int
    F: int
    T: int

    def __str__(self) -> str:
        return f"E={self.E} k={self.k} D={self.D} F={self.F} T={self.T}"

    @property
    def active_flops(self) -> int:
        """Forward FLOPs of the expert matmuls: 2·T·k·(D·2F + F·D)."""
        return 2 * self.T * self.k * 3 * self.D * self.F


ROWS: dict[str, Shape] = {
    "e8-t4096": Shape(8, 2, 512, 1024, 4096),
    "e64-t4096": Shape(64, 8, 512, 256, 4096),
    "e64-t64": Shape(64, 8, 512, 256, 64),
    "e64-t1": Shape(64, 8, 512, 256, 1),
    "e8-t1": Shape(8, 2, 512, 1024, 1),
}


@dataclass
class Impl:
    """One candidate: ``forward(x) → [.., D]`` output, ``loss(x) → scalar`` to backpropagate."""

    name: str
    module: nn.Module
    forward: Callable[[Tensor], Tensor]
    loss: Callable[[Tensor], Tensor]
    checked: bool = True  # compared against moelab's output


@dataclass
class Result:
    shape: str
    impl: str
    fwd_tok_s: float | None = None
    fwdbwd_tok_s: float | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)


# ---------------------------------------------------------------- builders


def build_moelab(s: Shape, backend: str) -> tuple[MoELayer, Impl]:
    cfg = MoEConfig(
        router=RouterConfig(num_experts=s.E, top_k=s.k, norm_topk_prob=True),
        experts=ExpertsConfig(hidden_size=s.D, ffn_hidden_size=s.F, activation="swiglu"),
        losses=LossConfig(load_balance="switch", aux_loss_coeff=1e-2, z_loss_coeff=1e-3),
    )
    layer = MoELayer(cfg).train()
    layer.experts.backend = backend

    def loss(x: Tensor) -> Tensor:
        out = layer(x)
        return out.hidden_states.sum() + sum(out.aux_losses.values())

    return layer, Impl(f"moelab[{backend}]", layer, lambda x: layer(x).hidden_states, loss)


def _copy_into_hf(block: nn.Module, ref: MoELayer) -> None:
    """HF layout: gate ``weight [E, D]``, ``gate_up_proj [E, 2F, D]`` (gate rows first),
    ``down_proj [E, D, F]``; moelab stores ``w_gate_up [E, D, 2F]``, ``w_down [E, F, D]``."""
    with torch.no_grad():
        block.gate.weight.copy_(ref.router.weight)
        block.experts.gate_up_proj.copy_(ref.experts.w_gate_up.transpose(1, 2))
        block.experts.down_proj.copy_(ref.experts.w_down.transpose(1, 2))


def build_hf(s: Shape, family: str, impl: str, ref: MoELayer) -> Impl:
    if family == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        cfg = MixtralConfig(
            hidden_size=s.D,
            intermediate_size=s.F,
            num_local_experts=s.E,
            num_experts_per_tok=s.k,
            router_jitter_noise=0.0,
            experts_implementation=impl,
        )
        block = MixtralSparseMoeBlock(cfg)
    else:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        cfg = Qwen3MoeConfig(
            hidden_size=s.D,
            moe_intermediate_size=s.F,
            num_experts=s.E,
            num_experts_per_tok=s.k,
            norm_topk_prob=True,
            experts_implementation=impl,
        )
        block = Qwen3MoeSparseMoeBlock(cfg)
    if cfg._experts_implementation != impl:
        raise RuntimeError(f"config resolved to {cfg._experts_implementation!r}")
    block.train()
    _copy_into_hf(block, ref)
    return Impl(f"{family}[{impl}]", block, block, lambda x: block(x).sum())


class DenseSwiGLU(nn.Module):
    """The same active FLOPs with no routing: ``x @ W1[D, 2kF] → silu·mul → @ W2[kF, D]``."""

    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(s.D, 2 * s.k * s.F) * 0.02)
        self.w2 = nn.Parameter(torch.randn(s.k * s.F, s.D) * 0.02)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = (x @ self.w1).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.w2


def build_dense(s: Shape) -> Impl:
    m = DenseSwiGLU(s).train()
    return Impl("dense floor", m, m, lambda x: m(x).sum(), checked=False)


def batched_mm_gib(s: Shape) -> float:
    """GiB of per-pair expert weights that ``batched_mm`` gathers in forward (backward doubles it)."""
    return s.T * s.k * 3 * s.D * s.F * 4 / 2**30


# ---------------------------------------------------------------- checks


def _max_diff(a: Tensor, b: Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def check_against(impl: Impl, x: Tensor, ref_out: Tensor, ref_grad: Tensor) -> str:
    """Output and input-gradient (of ``out.sum()``) max abs differences vs moelab; raises on
    a mismatch above CHECK_TOL."""
    with torch.no_grad():
        out = impl.forward(x)
    d_out = _max_diff(out.reshape(ref_out.shape), ref_out)
    xg = x.detach().clone().requires_grad_(True)
    impl.forward(xg).sum().backward()
    d_grad = _max_diff(xg.grad, ref_grad)
    impl.module.zero_grad(set_to_none=True)
    if not (d_out <= CHECK_TOL and d_grad <= CHECK_TOL):
        raise AssertionError(
            f"{impl.name}: differs from moelab by {d_out:.2e} (output) / {d_grad:.2e} "
            f"(input grad), tolerance {CHECK_TOL:g}"
        )
    return f"max|Δout| {d_out:.1e}, max|Δgrad x| {d_grad:.1e}"


# ---------------------------------------------------------------- one shape


def run_shape(
    key: str, s: Shape, args: argparse.Namespace, log: Callable[[str], None]
) -> list[Result]:
    torch.manual_seed(args.seed)
    x = torch.randn(1, s.T, s.D)
    layers: dict[str, MoELayer] = {}
    impls: list[Impl] = []
    results: list[Result] = []
    for backend in MOELAB_BACKENDS:
        torch.manual_seed(args.seed + 1)  # identical weights for both backends
        layers[backend], impl = build_moelab(s, backend)
        impls.append(impl)
    ref = layers[MOELAB_BACKENDS[0]]
    for family in ("mixtral", "qwen3_moe"):
        for name in HF_IMPLEMENTATIONS:
            label = f"{family}[{name}]"
            if name == "batched_mm" and batched_mm_gib(s) > args.max_gather_gib:
                results.append(
                    Result(
                        key,
                        label,
                        note=f"skipped: gathers {batched_mm_gib(s):.1f} GiB of per-pair weights "
                        f"(> --max-gather-gib {args.max_gather_gib:g}), ~2x that in backward",
                    )
                )
                continue
            try:
                impls.append(build_hf(s, family, name, ref))
            except Exception as e:  # an implementation unavailable on CPU
                results.append(Result(key, label, note=f"skipped: {type(e).__name__}: {e}"))
    impls.append(build_dense(s))

    # correctness: everything against moelab[torch] (output and d(out.sum())/dx)
    with torch.no_grad():
        ref_out = ref(x).hidden_states
    xg = x.clone().requires_grad_(True)
    ref(xg).hidden_states.sum().backward()
    ref_grad = xg.grad
    ref.zero_grad(set_to_none=True)
    runnable: list[Impl] = []
    for impl in impls:
        if not impl.checked:
            runnable.append(impl)
            continue
        try:
            note = check_against(impl, x, ref_out, ref_grad)
        except AssertionError:
            raise
        except Exception as e:
            if impl.name.startswith("moelab"):
                raise
            results.append(Result(key, impl.name, note=f"skipped: {type(e).__name__}: {e}"))
            continue
        log(f"  check {impl.name:24s} {note}")
        runnable.append(impl)

    # timing
    xgrad = x.clone().requires_grad_(True)

    def fwd(impl: Impl) -> Callable[[], object]:
        def f() -> object:
            with torch.no_grad():
                return impl.forward(x)

        return f

    def fwdbwd(impl: Impl) -> Callable[[], object]:
        def f() -> None:
            impl.module.zero_grad(set_to_none=True)
            xgrad.grad = None
            impl.loss(xgrad).backward()

        return f

    kw = dict(
        repeats=args.repeats,
        warmup=args.warmup,
        min_sample_s=args.min_sample_s,
        budget_s=args.budget_s,
    )
    t0 = time.perf_counter()
    fwd_s = interleaved_medians({i.name: fwd(i) for i in runnable}, **kw)
    fb_s = interleaved_medians({i.name: fwdbwd(i) for i in runnable}, **kw)
    log(f"  timed in {time.perf_counter() - t0:.0f}s")
    for impl in runnable:
        results.append(Result(key, impl.name, s.T / fwd_s[impl.name], s.T / fb_s[impl.name]))
    order = [i.name for i in impls]
    results.sort(key=lambda r: order.index(r.impl) if r.impl in order else len(order))
    return results


# ---------------------------------------------------------------- profile


def profile_moelab(s: Shape, backend: str, args: argparse.Namespace) -> None:
    """Forward stage breakdown (no_grad, median ms) and torch.profiler's top ops of fwd+bwd."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(args.seed)
    x = torch.randn(1, s.T, s.D)
    torch.manual_seed(args.seed + 1)
    layer, impl = build_moelab(s, backend)
    x_TD = x.reshape(-1, s.D)
    state: dict[str, object] = {}

    def router() -> None:
        state["plan"] = layer.router(x_TD)

    def dispatch() -> None:
        state["d"] = layer.dispatcher.dispatch(x_TD, state["plan"])

    def experts() -> None:
        d = state["d"]
        state["y"] = layer.experts(d.x, d.counts)

    def combine() -> None:
        layer.dispatcher.combine(state["y"], state["d"], s.T)

    def losses() -> None:
        mask = torch.ones(s.T, dtype=torch.bool)
        layer.balance_loss(state["plan"], mask, (1, s.T))
        from moelab.core.losses import router_z_loss

        router_z_loss(state["plan"].logits, mask)

    def record() -> None:
        from moelab.core.telemetry import RoutingRecord

        RoutingRecord.from_plan(state["plan"], torch.ones(s.T, dtype=torch.bool), (1, s.T))

    def whole() -> None:
        layer(x)

    stages = {
        "router": router,
        "dispatch": dispatch,
        "experts": experts,
        "combine": combine,
        "losses": losses,
        "record": record,
        "whole": whole,
    }
    with torch.no_grad():
        for f in stages.values():  # populate state in order
            f()
        med = interleaved_medians(
            stages,
            repeats=args.repeats,
            warmup=1,
            min_sample_s=args.min_sample_s,
            budget_s=args.budget_s,
        )
    parts = sum(v for k, v in med.items() if k != "whole")
    print(f"\nmoelab[{backend}] {s}: forward stages (no_grad, median ms)")
    for k, v in med.items():
        print(f"  {k:9s} {v * 1e3:9.3f} ms  {100 * v / med['whole']:5.1f}% of whole")
    print(f"  {'sum':9s} {parts * 1e3:9.3f} ms")

    xg = x.clone().requires_grad_(True)

    def step() -> None:
        layer.zero_grad(set_to_none=True)
        xg.grad = None
        impl.loss(xg).backward()

    step()
    n = max(1, min(20, math.ceil(0.5 / max(_one_call(step), 1e-6))))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            step()
    print(f"moelab[{backend}] {s}: fwd+bwd, torch.profiler over {n} steps (self CPU time)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


def _one_call(f: Callable[[], object]) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


# ---------------------------------------------------------------- contention


_BUSY_LOOP = """
import os
if hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
while True:
    pass
"""


@contextlib.contextmanager
def busy_core():
    """A pure-Python busy loop in a child process, pinned to the last core, while the block
    runs (killed after it, whatever happens)."""
    proc = subprocess.Popen([sys.executable, "-c", _BUSY_LOOP])
    try:
        time.sleep(0.5)  # let it start spinning
        yield
    finally:
        proc.kill()
        proc.wait()


def auto_versus_others(results: list[Result], shapes: dict[str, Shape]) -> list[str]:
    """Per row: moelab ``auto`` / the better of moelab's other backends, forward and
    forward+backward (the fallback rule's target: >= 0.9x on every row)."""
    lines = []
    for key, s in shapes.items():
        rs = {r.impl: r for r in results if r.shape == key and not r.note}
        auto = rs.get("moelab[auto]")
        others = [rs[f"moelab[{b}]"] for b in MOELAB_BACKENDS[1:] if f"moelab[{b}]" in rs]
        if auto is None or not others:
            continue
        bf = max(others, key=lambda r: r.fwd_tok_s)
        bb = max(others, key=lambda r: r.fwdbwd_tok_s)
        lines.append(
            f"{s}  auto / best other: fwd {_fmt_ratio(auto.fwd_tok_s, bf.fwd_tok_s)} "
            f"({bf.impl}), fwd+bwd {_fmt_ratio(auto.fwdbwd_tok_s, bb.fwdbwd_tok_s)} ({bb.impl})"
        )
    return lines


# ---------------------------------------------------------------- report


def _fmt_rate(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v / 1e3:,.1f}k" if v >= 1e4 else f"{v:,.0f}"


def _fmt_ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def report(results: list[Result], shapes: dict[str, Shape]) -> None:
    try:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table
    except ImportError:  # pragma: no cover
        Console = None
    header = [
        "config",
        "implementation",
        "fwd tok/s",
        "fwd+bwd tok/s",
        "fwd / best HF",
        "f+b / best HF",
        "fwd / dense",
        "f+b / dense",
    ]
    rows: list[list[str]] = []
    notes: list[str] = []
    for key, s in shapes.items():
        rs = [r for r in results if r.shape == key]
        hf = [r for r in rs if not r.impl.startswith(("moelab", "dense")) and r.fwd_tok_s]
        best_f = max((r.fwd_tok_s for r in hf), default=None)
        best_b = max((r.fwdbwd_tok_s for r in hf), default=None)
        best_f_name = next((r.impl for r in hf if r.fwd_tok_s == best_f), "-")
        best_b_name = next((r.impl for r in hf if r.fwdbwd_tok_s == best_b), "-")
        dense = next((r for r in rs if r.impl == "dense floor"), None)
        for i, r in enumerate(rs):
            if r.note:
                notes.append(f"{s}  {r.impl}: {r.note}")
                continue
            rows.append(
                [
                    str(s) if i == 0 else "",
                    r.impl,
                    _fmt_rate(r.fwd_tok_s),
                    _fmt_rate(r.fwdbwd_tok_s),
                    _fmt_ratio(r.fwd_tok_s, best_f),
                    _fmt_ratio(r.fwdbwd_tok_s, best_b),
                    _fmt_ratio(r.fwd_tok_s, dense and dense.fwd_tok_s),
                    _fmt_ratio(r.fwdbwd_tok_s, dense and dense.fwdbwd_tok_s),
                ]
            )
        notes.append(f"{s}  best HF: fwd {best_f_name}, fwd+bwd {best_b_name}")
        rows.append([""] * len(header))
    rows.pop()
    title = "MoE layer tokens/s (fp32, median; ratios > 1 = faster than the reference)"
    if Console is not None:
        table = Table(title=title)
        for h in header:
            table.add_column(h, justify="left" if h in ("config", "implementation") else "right")
        for row in rows:
            table.add_row(*(escape(c) for c in row))
        Console(width=200).print(table)
    else:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        print(title)
        print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
        for row in rows:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    for n in notes:
        print(n)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--rows",
        nargs="+",
        choices=list(ROWS),
        default=list(ROWS),
        metavar="ROW",
        help=f"shapes to run (default all): {', '.join(ROWS)}",
    )
    p.add_argument("--quick", action="store_true", help="3 repeats, shorter samples")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 7; quick 3)")
    p.add_argument(
        "--warmup", type=int, default=1, help="untimed calls per implementation (+1 calibration)"
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="timed seconds per implementation and mode before its repeats are cut "
        "(never below 3; default 4; quick 1.5)",
    )
    p.add_argument(
        "--min-sample-s",
        type=float,
        default=None,
        help="minimum seconds per timed sample; fast calls are looped (default 0.1; quick 0.03)",
    )
    p.add_argument(
        "--max-gather-gib",
        type=float,
        default=2.0,
        help="skip transformers' batched_mm when it would gather more expert weights than this",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--profile",
        action="store_true",
        help="also profile moelab's layer on the selected rows (stage timers + torch.profiler)",
    )
    p.add_argument("--json", type=Path, default=None, help="write the results to this file")
    p.add_argument(
        "--contended",
        action="store_true",
        help="run beside a busy-loop process pinned to the last core",
    )
    args = p.parse_args(argv)
    if args.repeats is None:
        args.repeats = 3 if args.quick else 7
    if args.min_sample_s is None:
        args.min_sample_s = 0.03 if args.quick else 0.1
    if args.budget_s is None:
        args.budget_s = 1.5 if args.quick else 4.0

    import transformers

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}; "
        f"up to {args.repeats} repeats (budget {args.budget_s:g}s each), median"
        + (
            f"; contended: a busy loop on core {max(os.sched_getaffinity(0))}"
            if args.contended
            else ""
        )
    )
    shapes = {k: ROWS[k] for k in args.rows}
    results: list[Result] = []
    t0 = time.perf_counter()
    with busy_core() if args.contended else contextlib.nullcontext():
        for key, s in shapes.items():
            print(f"{key}: {s}  ({s.active_flops / 1e9:.2f} GFLOP active forward)", flush=True)
            results += run_shape(key, s, args, lambda m: print(m, flush=True))
    print(f"total {time.perf_counter() - t0:.0f}s\n")
    report(results, shapes)
    for line in auto_versus_others(results, shapes):
        print(line)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "torch": torch.__version__,
                    "transformers": transformers.__version__,
                    "threads": torch.get_num_threads(),
                    "repeats": args.repeats,
                    "contended": args.contended,
                    "rows": {k: vars(s) for k, s in shapes.items()},
                    "results": [vars(r) for r in results],
                },
                indent=2,
            )
        )
    if args.profile:
        for s in shapes.values():
            for backend in MOELAB_BACKENDS:
                profile_moelab(s, backend, args)


if __name__ == "__main__":
    main()
