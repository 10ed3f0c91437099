"""Whole-model speed: moelab against transformers on the same weights, side by side in one run.

For each run (default: the ``make run`` model and the upcycled SmolLM2-MoE) the model is
exported with ``moelab convert RUN DST --to hf`` and loaded by ``AutoModelForCausalLM``
(fp32). After checking that both give the same logits (max |Δ| printed, must be < 1e-3) it
times, interleaved round-robin with medians of the repeats (``benchmarks/_timing.py``):

- **training step**: forward, next-token cross-entropy plus each library's load-balancing
  loss (moelab: its configured aux losses; transformers: ``output_router_logits=True`` with
  the exported ``router_aux_loss_coef``), backward, optimizer step (``AdamW``; plain ``SGD``
  for models over 50M parameters, whose two AdamW states would not fit in 24 GB); tokens/s;
- **prefill**: one no-grad forward over a ``[1, S]`` prompt; tokens/s;
- **greedy decode at batch 1**: moelab's serving engine against ``generate(do_sample=False)``;
  decode tokens/s ``(N−1) / (T(N) − T(1))`` (prefill cancels out), and whether the greedy
  tokens are identical. With ``--compile`` also moelab's engine with its decode steps
  compiled (``Engine(compile=True)``; the compilation runs before the timing).

``--profile-decode`` instead profiles moelab's greedy decode (batch 1, after the prefill)
with ``torch.profiler``, once with the experts on the per-expert ``loop`` backend (the CPU
default before the fused kernel) and once on ``auto``, and prints where the time goes: the
MoE layers' share and the top operators.

Usage::

    python benchmarks/model_speed.py                                 # both models
    python benchmarks/model_speed.py --runs runs/main --repeats 3    # one model
    python benchmarks/model_speed.py --runs runs/smollm2-moe --profile-decode
    python benchmarks/model_speed.py --runs runs/main --compile      # + compiled decoding
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _hf import decode_rate, ensure_hf, greedy_fns, load_hf
from _timing import interleaved_medians
from moelab.models import load_model


@dataclass(frozen=True)
class Setting:
    train_batch: int
    train_seq: int
    prefill_seq: int
    decode_tokens: int
    optimizer: str  # "adamw", or "sgd" where two models' AdamW states do not fit in memory


SETTINGS = {
    "small": Setting(16, 256, 256, 65, "adamw"),
    # 692M parameters: two models with AdamW moments need ~28 GB; SGD keeps no state
    "large": Setting(2, 128, 256, 17, "sgd"),
}


def _ce(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def train_steps(model, hf, ids: torch.Tensor, optimizer: str):
    """One optimizer step each: ``(ours, theirs)`` closures (each with its own optimizer)."""
    make = torch.optim.AdamW if optimizer == "adamw" else torch.optim.SGD
    opt_ours = make(model.parameters(), lr=1e-6)
    opt_hf = make(hf.parameters(), lr=1e-6)
    coef = float(getattr(hf.config, "router_aux_loss_coef", 0.0) or 0.0)

    def ours() -> None:
        opt_ours.zero_grad(set_to_none=True)
        out = model(ids)
        (_ce(out.logits, ids) + out.aux_loss).backward()
        opt_ours.step()

    def theirs() -> None:
        opt_hf.zero_grad(set_to_none=True)
        out = hf(ids, output_router_logits=True)
        aux = getattr(out, "aux_loss", None)
        loss = _ce(out.logits, ids) + (coef * aux if aux is not None else 0.0)
        loss.backward()
        opt_hf.step()

    return ours, theirs


def bench_run(run: Path, args) -> dict:
    model = load_model(run)
    hf = load_hf(ensure_hf(run, args.work), model.embed.weight.dtype)
    params = sum(p.numel() for p in model.parameters())
    s = SETTINGS["small" if params < 50e6 else "large"]
    V = model.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        probe = torch.randint(0, V, (2, 64), generator=g)
        diff = float((model.eval()(probe).logits - hf(probe).logits).abs().max())
    if not diff < 1e-3:
        raise SystemExit(f"{run}: logits differ by {diff:.2e}; not the same model")
    print(f"{run.name}: {params / 1e6:.1f}M params, {s}, logits max |Δ| {diff:.1e}", flush=True)
    row = {"run": run.name, "params_M": params / 1e6, "logit_diff": diff, "setting": s}

    model.train(), hf.train()
    ids = torch.randint(0, V, (s.train_batch, s.train_seq), generator=g)
    ours, theirs = train_steps(model, hf, ids, s.optimizer)
    t = interleaved_medians({"ours": ours, "hf": theirs}, repeats=args.repeats, budget_s=60)
    tokens = s.train_batch * s.train_seq
    row["train"] = (tokens / t["ours"], tokens / t["hf"])
    model.eval(), hf.eval()

    prompt = torch.randint(0, V, (1, s.prefill_seq), generator=g)

    @torch.inference_mode()
    def prefill_ours():
        return model(prompt).logits

    @torch.inference_mode()
    def prefill_hf():
        return hf(prompt).logits

    t = interleaved_medians({"ours": prefill_ours, "hf": prefill_hf}, repeats=args.repeats)
    row["prefill"] = (s.prefill_seq / t["ours"], s.prefill_seq / t["hf"])

    prompts = [torch.randint(0, V, (16,), generator=g).tolist()]
    gen_ours, gen_hf = greedy_fns(model, hf, prompts)
    N = s.decode_tokens
    row["same_tokens"] = gen_ours(1, N) == gen_hf(1, N)
    fns = {
        "ours N": lambda: gen_ours(1, N),
        "ours 1": lambda: gen_ours(1, 1),
        "hf N": lambda: gen_hf(1, N),
        "hf 1": lambda: gen_hf(1, 1),
    }
    if args.compile:
        gen_compiled, _ = greedy_fns(model, hf, prompts, compile=True)
        start = time.perf_counter()
        row["same_tokens_compiled"] = gen_compiled(1, N) == gen_hf(1, N)  # compiles here
        print(f"  compiled the decode step in {time.perf_counter() - start:.0f} s", flush=True)
        fns["compiled N"] = lambda: gen_compiled(1, N)
        fns["compiled 1"] = lambda: gen_compiled(1, 1)
    t = interleaved_medians(fns, repeats=args.repeats, budget_s=120, min_repeats=args.repeats)
    hf_rate = decode_rate(1, N, t["hf N"], t["hf 1"])
    row["decode"] = (decode_rate(1, N, t["ours N"], t["ours 1"]), hf_rate)
    if args.compile:
        row["decode compiled"] = (decode_rate(1, N, t["compiled N"], t["compiled 1"]), hf_rate)
    for key in ("train", "prefill", "decode", "decode compiled"):
        if key not in row:
            continue
        a, b = row[key]
        print(f"  {key:8s} moelab {a:9.1f} tok/s  HF {b:9.1f} tok/s  {a / b:.2f}x", flush=True)
    return row


def profile_decode(run: Path, tokens: int = 16) -> None:
    """Profile ``tokens`` greedy decode steps of ``run`` on each expert backend."""
    from torch.profiler import profile

    from moelab.core.layer import MoELayer
    from moelab.serve import Engine, SamplingParams

    model = load_model(run).eval()
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    started: dict[int, float] = {}
    in_moe = [0.0]

    def enter(m, args):
        started[id(m)] = time.perf_counter()

    def leave(m, args, out):
        in_moe[0] += time.perf_counter() - started[id(m)]

    hooks = [h for m in layers for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.cfg.vocab_size, (16,), generator=gen).tolist()

    def decode(profiled: bool):
        engine = Engine(model, max_batch=1)
        engine.submit(prompt, SamplingParams(max_tokens=tokens + 1, temperature=0))
        engine.step()  # prefill + first token: not counted
        in_moe[0] = 0.0
        t = time.perf_counter()
        with profile() if profiled else contextlib.nullcontext() as prof:
            while engine.has_work():
                engine.step()
        return time.perf_counter() - t, prof

    for backend in ("loop", "auto"):
        for layer in layers:
            layer.experts.backend = backend
        decode(False)  # warm-up
        wall, _ = decode(False)
        moe = in_moe[0]
        _, prof = decode(True)
        print(f"\n{run.name}, experts backend {backend}: {tokens} decode steps, {tokens / wall:.1f} tok/s; "
              f"MoE layers {moe * 1e3:.0f} of {wall * 1e3:.0f} ms ({moe / wall:.0%})")  # fmt: skip
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    for h in hooks:
        h.remove()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="+", type=Path,
                    default=[Path("runs/main"), Path("runs/smollm2-moe")])  # fmt: skip
    ap.add_argument("--work", type=Path, default=Path("/tmp/moelab-model-speed"),
                    help="where the HF exports are written (reused when present)")  # fmt: skip
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--compile", action="store_true",
                    help="also time moelab's decode with compiled steps (Engine(compile=True))")  # fmt: skip
    ap.add_argument("--profile-decode", action="store_true",
                    help="profile moelab's decode on the loop and auto expert backends instead")  # fmt: skip
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.profile_decode:
        for run in args.runs:
            profile_decode(run)
        return
    args.work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = [bench_run(run, args) for run in args.runs]
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, fp32, "
          f"{args.repeats} interleaved repeats, total {time.perf_counter() - t0:.0f} s\n")  # fmt: skip
    print("| model | measure | shape | moelab tok/s | transformers tok/s | moelab / HF |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        s = r["setting"]
        shapes = {
            "train": f"{s.train_batch}×{s.train_seq}, {'AdamW' if s.optimizer == 'adamw' else 'SGD'}",
            "prefill": f"1×{s.prefill_seq}",
        }
        for key, same in (("decode", "same_tokens"), ("decode compiled", "same_tokens_compiled")):
            if key in r:
                shapes[key] = f"batch 1, {s.decode_tokens} tokens, identical: " + (
                    "yes" if r[same] else "NO"
                )
        for key, shape in shapes.items():
            a, b = r[key]
            print(f"| {r['run']} | {key} | {shape} | {a:.1f} | {b:.1f} | {a / b:.2f}× |")


if __name__ == "__main__":
    main()
