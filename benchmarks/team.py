"""TEAM (arXiv 2602.08404) on a block-diffusion MoE initialised from the main AR run.

Stage ``train``: leave the AR run (``--init-from``, default ``runs/main``) untouched; write a corpus folder with the
mix corpus (capped) plus generated exact-answer task lines (copy, reverse of ``--digits``
digits, 3-digit addition, key→value lookup), then ``moelab.train.loop.train`` with
``objective="block-diffusion"`` and ``--block`` tokens per block, ``init_from`` the AR run.
Held-out problems are never in the training text.

Stage ``eval``: for vanilla / +caching / +caching+limited / full TEAM at the same τ (0.95, the
authors') and block size:

- **long generations** (the regime of the claim): ``--text-prompts`` held-out text prompts of
  16 tokens, each continued by ``--text-tokens`` tokens (≥ 4 blocks); APF / TPF / APT over the
  denoising forwards (the authors' count) and over all forwards (KV-storing passes included),
  NFE per token, decode tokens/s (prefill excluded), the memory-bound cost proxy
  ``Σ_forwards (dense bytes + distinct experts · expert bytes) / --bandwidth-gbs`` per token,
  the AR model's NLL of the continuation and its token agreement with vanilla's;
- **tasks**: exact match per task on held-out problems (answers decoded to the end of the
  line), and the paired per-problem difference from vanilla with a bootstrap 95 % interval on
  the tasks where vanilla is above ``--floor`` % (addition and lookup sit at floor on the
  small models), and the decode statistics (APF / TPF / APT, NFE per token, decode tokens/s)
  over the answers (``--digits 32``: 33-token answers, 5 blocks of 8; the model is confident
  there, as the paper's models are on their benchmarks);
- the diffusion ELBO (bits/byte) of held-out text next to the AR model's.

Decoders are interleaved per problem (timings on a shared box are noisy). Seeds re-draw the
held-out problems.

    python benchmarks/team.py train --out /tmp/team_run --steps 400
    python benchmarks/team.py eval --run /tmp/team_run --per-task 25 --seeds 0 1 2
    python benchmarks/team.py eval --run /tmp/team_s0 /tmp/team_s1 /tmp/team_s2   # 3 trainings
    python benchmarks/team.py eval --run /tmp/team_s1 --json s1.json   # one per process, then
    python benchmarks/team.py eval --combine s0.json s1.json s2.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import string
from pathlib import Path

TASKS = ("copy", "reverse", "add", "lookup")
AR_RUN = "runs/main"  # the main job's run (make run)


def make_problem(task: str, rng: random.Random, digits: int = 5) -> tuple[str, str]:
    """``(prompt, answer)``; the full line is ``prompt + answer + "\\n"``; copy and reverse
    use ``digits`` digits."""
    if task == "copy":
        s = "".join(rng.choice(string.digits) for _ in range(digits))
        return f"C {s}=", s
    if task == "reverse":
        s = "".join(rng.choice(string.digits) for _ in range(digits))
        return f"R {s}=", s[::-1]
    if task == "add":
        a, b = rng.randrange(100, 1000), rng.randrange(100, 1000)
        return f"A {a}+{b}=", str(a + b)
    if task == "lookup":
        keys = rng.sample(string.ascii_lowercase, 4)
        vals = [rng.choice(string.digits) for _ in keys]
        q = rng.randrange(4)
        pairs = " ".join(f"{k}:{v}" for k, v in zip(keys, vals, strict=True))
        return f"K {pairs} ?{keys[q]}=", vals[q]
    raise ValueError(f"task: must be one of {TASKS}, got {task!r}")


HELD_OUT_PER_TASK = 200
"""Problems per task and seed (seeds 0-4) that ``train`` keeps out of the training lines."""


def held_out(
    seed: int, per_task: int, seen: frozenset[str] = frozenset(), digits: int = 5
) -> list[tuple[str, str, str]]:
    """``(task, prompt, answer)`` test problems: per task, the first ``per_task`` problems of
    that task's own stream (so a smaller ``per_task`` gives a prefix of a larger one) whose
    prompt is not in ``seen`` (the prompts a model was trained on)."""
    out = []
    for t in TASKS:
        rng, n, draws = random.Random(f"team held-out {seed} {t}"), 0, 0
        while n < per_task:
            p, a = make_problem(t, rng, digits)
            draws += 1
            if draws > 100 * per_task:
                raise SystemExit(f"{t}: fewer than {per_task} problems not in the training text")
            if p not in seen:
                out.append((t, p, a))
                n += 1
    return out


def trained_prompts(run: Path) -> frozenset[str]:
    """The task prompts in a ``train`` run's data folder (its ``tasks_*.txt`` lines up to
    ``=``): no test problem may be one of them."""
    from moelab.train.loop import run_train_config

    data = Path(run_train_config(run).data)
    files = sorted(data.glob("tasks_*.txt"))
    if not files:
        raise SystemExit(f"{run}: its data folder {data} has no tasks_*.txt (moved or deleted?)")
    return frozenset(
        line[: line.index("=") + 1]
        for f in files
        for line in f.read_text().splitlines()
        if "=" in line
    )


def held_out_text(run: Path, ar_run: Path, tokenizer) -> dict:
    """Validation streams of text neither model trained on: the AR run's validation documents
    that are not in the diffusion run's training split (``train`` writes each mix document as
    its own file, ``{domain}_{name}.txt``)."""
    from moelab.train.loop import domain_streams, run_train_config, split_run_documents

    trained = {d.name for d in split_run_documents(run_train_config(run))[0]}
    val = [
        d for d in split_run_documents(run_train_config(ar_run))[1] if _file_name(d) not in trained
    ]
    return domain_streams(val, sorted({d.domain for d in val}), tokenizer)


def _file_name(doc) -> str:
    return doc.domain + "_" + "".join(c if c.isalnum() else "_" for c in doc.name) + ".txt"


def train_lines(n: int, exclude: set[str], digits: int = 5) -> list[str]:
    rng = random.Random(1)
    out = []
    while len(out) < n:
        t = TASKS[len(out) % len(TASKS)]
        p, a = make_problem(t, rng, digits)
        if p not in exclude:
            out.append(p + a)
    return out


def finished_steps(run: Path) -> tuple[int, int]:
    """(last step in ``run``'s metrics.jsonl, the steps its training planned; fitted to the time
    budget where ``--fit-to-budget`` fitted them)."""
    from moelab.train.loop import read_run_info
    from moelab.train.metrics import MetricsLog

    planned = int(read_run_info(run)["train"]["steps"])
    done = max((r["step"] for r in MetricsLog(run / "metrics.jsonl").read()), default=0)
    return done, planned


def stage_train(args) -> None:
    from moelab.data import load_corpus
    from moelab.train.config import TrainConfig
    from moelab.train.loop import train

    # A `make run` that hit its time budget before its warm-up ended leaves a model of a few
    # steps; diffusion training on it learns none of the tasks, and nothing else says why.
    done, planned = finished_steps(Path(args.init_from))
    if done < 0.9 * planned and not args.allow_short_init:
        raise SystemExit(
            f"train: --init-from {args.init_from} stopped at step {done} of its {planned}; "
            "train it to the end (make run on a quiet machine) or pass --allow-short-init"
        )
    data = Path(args.out + "_data")
    data.mkdir(parents=True, exist_ok=True)
    for d in load_corpus("mix", max_bytes_per_domain=args.mix_bytes):
        (data / _file_name(d)).write_text(d.text, encoding="utf-8")
    exclude = {
        p for s in range(5) for _, p, _ in held_out(s, HELD_OUT_PER_TASK, digits=args.digits)
    }
    lines = train_lines(args.task_lines, exclude, args.digits)
    for i in range(0, len(lines), 200):
        (data / f"tasks_{i // 200:04d}.txt").write_text("\n".join(lines[i : i + 200]) + "\n")
    cfg = TrainConfig(
        data=str(data), max_bytes_per_domain=None, steps=args.steps, seq_len=args.seq_len,
        batch_size=args.batch_size, lr=args.lr, warmup_steps=args.warmup, eval_every=args.steps,
        eval_tokens=4096, checkpoint_every=0, log_every=10, seed=args.seed,
        init_from=args.init_from, time_budget_s=args.time_budget, objective="block-diffusion", block_size=args.block,
    )  # fmt: skip
    res = train(None, cfg, args.out, progress=False)
    print(f"trained {res.step} steps in {res.elapsed_s:.0f} s; train loss {res.train_loss:.3f}")


def _ms(xs: list[float]) -> str:
    m = statistics.fmean(xs)
    return f"{m:.2f}±{statistics.stdev(xs):.2f}" if len(xs) > 1 else f"{m:.2f}"


TASK_COLS = ("task APF", "task TPF", "task APT", "task APT all", "task NFE/token", "task tok/s")
LONG_COLS = ("APF", "TPF", "APT", "APF all", "TPF all", "APT all", "NFE/token", "tok/s",
             "cost µs/token", "AR NLL", "agree %")  # fmt: skip


def byte_sizes(model) -> tuple[float, float]:
    """``(dense bytes, bytes of one expert)`` at the model's dtype: the parameters outside
    the MoE layers' expert banks, and a bank's parameters over its experts (the mean)."""
    banks = [blk.ffn.experts for blk in model.blocks if blk.is_moe]
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    experts = sum(p.numel() * p.element_size() for b in banks for p in b.parameters())
    n = sum(blk.ffn.config.router.num_experts for blk in model.blocks if blk.is_moe)
    return float(total - experts), experts / n


def eval_run(run: Path, args, ar) -> dict:
    """Every decoder on one trained model: ``{"info": ..., "rows": ..., "problems": ...}``;
    the rows hold, per decoder and column, one value per problem seed (exact match per task in
    %, and the long-generation metrics of :data:`LONG_COLS`); ``problems`` per decoder and
    task the 0/1 exact match of every problem in order (for paired differences); the info the
    held-out text's ELBO and AR bits/byte, the block size and, per problem seed, how many test
    problems were replaced because the model was trained on them."""
    import torch

    from moelab.data import load_tokenizer
    from moelab.models import load_model
    from moelab.serve.diffusion import DECODERS, DecodeOptions, DecodeStats, diffusion_generate
    from moelab.train.diffusion import batch_elbo_nats
    from moelab.train.evaluate import evaluate
    from moelab.train.loop import run_train_config

    dm, tok = load_model(run).eval(), load_tokenizer(run)
    val = held_out_text(run, Path(args.ar_run), tok)
    n = run_train_config(run).seq_len
    elbo = evaluate(dm, val, seq_len=n, batch_size=8, max_tokens=8192, nats_fn=batch_elbo_nats)
    arb = evaluate(ar, val, seq_len=n, batch_size=8, max_tokens=8192)
    seen = trained_prompts(run)
    b = dm.cfg.block_size
    info = {
        "run": str(run), "seed": run_train_config(run).seed, "elbo_bpb": elbo.overall.bits_per_byte, "ar_bpb": arb.overall.bits_per_byte,
        "text_bytes": elbo.overall.bytes, "block": b, "skipped": [],
        "blocks_per_text": -(-(16 + args.text_tokens) // b) - 16 // b,
    }  # fmt: skip
    dense_bytes, expert_bytes = byte_sizes(dm)
    bw = args.bandwidth_gbs * 1e9
    nl = tok.encode("\n")[0]
    span = 16 + args.text_tokens
    windows = [st.ids[: 64 * span].split(span)[:-1] for st in val.values()]
    text = [w.tolist() for ws in zip(*windows, strict=False) for w in ws]  # domains in turn
    text = text[: args.text_prompts]
    decoders = {d: DecodeOptions.preset(d, args.tau) for d in DECODERS}
    for k in args.refresh:  # the paper's Refresh-k ablation of DCD
        decoders[f"cache+refresh{k}"] = dataclasses.replace(decoders["cache"], refresh=k)
    rows: dict[str, dict[str, list[float]]] = {d: {} for d in decoders}
    problems: dict[str, dict[str, list[int]]] = {d: {t: [] for t in TASKS} for d in decoders}
    for seed in args.seeds:
        probs = held_out(seed, args.per_task, seen, args.digits)
        info["skipped"].append(
            sum(p in seen for _, p, _ in held_out(seed, args.per_task, digits=args.digits))
        )
        hits = {d: {t: 0 for t in TASKS} for d in decoders}
        task_stats = {d: DecodeStats() for d in decoders}
        for task, prompt, answer in probs:
            ids = tok.encode("\n" + prompt)
            room = len(tok.encode(answer + "\n"))
            for d in decoders:  # interleaved: the box is shared and noisy
                r = diffusion_generate(
                    dm, ids, max_new_tokens=room, stop_id=nl, options=decoders[d]
                )
                ok = tok.decode(r.ids).split("\n")[0] == answer
                hits[d][task] += ok
                task_stats[d].merge(r.stats)
                problems[d][task].append(int(ok))
        stats = {d: DecodeStats() for d in decoders}
        nll = {d: [] for d in decoders}
        agree = {d: [] for d in decoders}
        for w in text:  # long generations: held-out text continuations
            outs = {}
            for d in decoders:
                r = diffusion_generate(dm, w[:16], max_new_tokens=args.text_tokens,
                                       options=decoders[d])  # fmt: skip
                stats[d].merge(r.stats)
                outs[d] = r.ids
                ids = torch.tensor([w[:16] + r.ids])
                with torch.no_grad():
                    lp = ar(ids[:, :-1]).logits.float().log_softmax(-1)[0, 15:]
                nll[d].append(-lp.gather(-1, ids[0, 16:, None]).mean().item())
            for d in decoders:
                same = sum(x == y for x, y in zip(outs[d], outs["vanilla"], strict=False))
                agree[d].append(100 * same / max(len(outs["vanilla"]), 1))
        for d in decoders:
            row = rows[d]
            for t in TASKS:
                row.setdefault(t, []).append(100 * hits[d][t] / args.per_task)
            row.setdefault("all", []).append(100 * sum(hits[d].values()) / len(probs))
            st = stats[d]
            cost = st.cost_proxy_s(dense_bytes / bw, expert_bytes, bw) / max(st.tokens, 1)
            for key, v in (
                ("APF", st.apf), ("TPF", st.tpf), ("APT", st.apt), ("APF all", st.apf_all),
                ("TPF all", st.tpf_all), ("APT all", st.apt_all),
                ("NFE/token", st.nfe / max(st.tokens, 1)), ("tok/s", st.tokens_per_s),
                ("cost µs/token", 1e6 * cost), ("AR NLL", statistics.fmean(nll[d])),
                ("agree %", statistics.fmean(agree[d])),
            ):  # fmt: skip
                row.setdefault(key, []).append(v)
            ts = task_stats[d]
            for key, v in (
                ("APF", ts.apf), ("TPF", ts.tpf), ("APT", ts.apt), ("APT all", ts.apt_all),
                ("NFE/token", ts.nfe / max(ts.tokens, 1)), ("tok/s", ts.tokens_per_s),
            ):  # fmt: skip
                row.setdefault(f"task {key}", []).append(v)
    return {"info": info, "rows": rows, "problems": problems}


def _metric_name(col: str) -> str:
    """A table column as a result metric name (no spaces or slashes, for the docs' directives):
    ``em_<task>`` for exact match, ``APT_all``, ``tok_per_s``, ..."""
    if col in (*TASKS, "all"):
        return f"em_{col}"
    if col.startswith("task "):
        return "task_" + _metric_name(col.removeprefix("task "))
    named = {"tok/s": "tok_per_s", "NFE/token": "NFE_per_token", "cost µs/token": "cost_us_per_token",
             "AR NLL": "AR_NLL", "agree %": "agree_pct"}  # fmt: skip
    return named.get(col, col.replace(" ", "_"))


def write_team_result(models: list[dict], settings: dict, path: Path) -> None:
    """The shared result JSON: arms = decoders, seeds = the models' training seeds, metrics =
    each model's mean over the problem seeds; pairs = every decoder against vanilla."""
    from moelab.utils.results import make_result, write_result

    seeds = [m["info"]["seed"] for m in models]
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"--result: the models' training seeds {seeds} repeat")
    names = list(models[0]["rows"])
    metrics = {
        d: {m["info"]["seed"]: {_metric_name(c): statistics.fmean(v)
                                for c, v in m["rows"][d].items()}
            for m in models}
        for d in names
    }  # fmt: skip
    config = {**settings, "block": models[0]["info"]["block"],
              "runs": [m["info"]["run"] for m in models]}  # fmt: skip
    pairs = [(d, "vanilla") for d in names if d != "vanilla"]
    write_result(make_result("team", "team", config, metrics, pairs=pairs), path)


def stage_eval(args) -> None:
    """One model: mean ± sd over the problem seeds. Several (``--run A B C``, e.g. training
    seeds): each model's mean over the problem seeds, then mean ± sd over the models; the
    ratios to vanilla are paired by model, the accuracy differences by problem (all models'
    problems pooled). ``--json`` files carry their settings; ``--combine`` refuses files (or
    ``--run`` flags) whose settings differ."""
    import torch

    from moelab.models import load_model
    from moelab.utils.results import bootstrap_interval

    want = {"tau": args.tau, "seeds": args.seeds, "per_task": args.per_task,
            "digits": args.digits, "text_tokens": args.text_tokens,
            "text_prompts": args.text_prompts, "bandwidth_gbs": args.bandwidth_gbs}  # fmt: skip
    settings, models = want, []
    for f in args.combine:
        saved = json.loads(Path(f).read_text())
        if saved.get("settings") != want:
            raise SystemExit(f"{f}: settings {saved.get('settings')} differ from {want}")
        models.append(saved["model"])
    if args.run:
        torch.set_num_threads(1)
        ar = load_model(Path(args.ar_run)).eval()
        models += [eval_run(Path(run), args, ar) for run in args.run]
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": settings, "model": models[0]}))
    if args.result:
        write_team_result(models, settings, Path(args.result))
    blocks = {m["info"]["block"] for m in models}
    if len(blocks) > 1:
        raise SystemExit(f"the models have different block sizes {sorted(blocks)}")
    for m in models:
        i = m["info"]
        print(f"{i['run']}: held-out text ({i['text_bytes']:,} bytes of the AR run's validation "
              f"documents, in neither training split): diffusion ELBO {i['elbo_bpb']:.3f} "
              f"bits/byte (upper bound), AR model {i['ar_bpb']:.3f}; test problems replaced "
              f"because they were in the training text: {i['skipped']} per problem seed")  # fmt: skip
    per_run = [m["rows"] for m in models]
    if len(per_run) == 1:
        rows = per_run[0]
    else:
        rows = {
            d: {c: [statistics.fmean(r[d][c]) for r in per_run] for c in per_run[0][d]}
            for d in per_run[0]
        }
    names = list(rows)
    over = "problem seeds" if len(per_run) == 1 else f"{len(per_run)} trained models"
    b = blocks.pop()
    print(f"tau={settings['tau']} block={b} problem seeds={settings['seeds']} "
          f"problems/task/seed={settings['per_task']} digits={settings['digits']}; "
          f"mean ± sd over {over}")  # fmt: skip
    print(f"\nLong generations: {settings['text_prompts']} held-out text prompts × "
          f"{settings['text_tokens']} new tokens ({models[0]['info']['blocks_per_text']} blocks "
          f"of {b}); APF/TPF/APT over denoising forwards (the authors' count), 'all' with the "
          f"KV-storing forwards; tok/s = decode only; cost proxy at "
          f"{settings['bandwidth_gbs']:g} GB/s")  # fmt: skip
    print("| decoder | " + " | ".join(LONG_COLS) + " |")
    print("|" + "---|" * (len(LONG_COLS) + 1))
    for d in names:
        print(f"| {d} | " + " | ".join(_ms(rows[d][c]) for c in LONG_COLS) + " |")
    print("\nTasks: the same statistics over every problem's answer decoding")
    print("| decoder | " + " | ".join(TASK_COLS) + " |")
    print("|" + "---|" * (len(TASK_COLS) + 1))
    for d in names:
        print(f"| {d} | " + " | ".join(_ms(rows[d][c]) for c in TASK_COLS) + " |")
    print("\nTasks: exact match (%)")
    print("| decoder | " + " | ".join(f"EM {c}" for c in (*TASKS, "all")) + " |")
    print("|" + "---|" * (len(TASKS) + 2))
    for d in names:
        print(f"| {d} | " + " | ".join(_ms(rows[d][c]) for c in (*TASKS, "all")) + " |")
    base = rows["vanilla"]
    pooled = {
        d: {t: [x for m in models for x in m["problems"][d][t]] for t in TASKS} for d in names
    }
    above = [t for t in TASKS if 100 * statistics.fmean(pooled["vanilla"][t]) > args.floor]
    print(f"\nAgainst vanilla (tasks above the {args.floor:g} % floor: {', '.join(above)}):")
    for d in names[1:]:

        def ratio(col: str, d: str = d) -> list[float]:
            return [a / v for a, v in zip(rows[d][col], base[col], strict=True)]

        apt = [100 * (1 - x) for x in ratio("APT")]
        task_apt = [100 * (1 - x) for x in ratio("task APT")]
        apt_all = [100 * (1 - x) for x in ratio("APT all")]
        diffs = [
            a - v for t in above for a, v in zip(pooled[d][t], pooled["vanilla"][t], strict=True)
        ]
        em = ""
        if diffs:
            lo, hi = bootstrap_interval(diffs)
            em = (f"; EM {100 * statistics.fmean(diffs):+.2f} points "
                  f"[{100 * lo:+.2f}, {100 * hi:+.2f}] (paired, {len(diffs)} problems)")  # fmt: skip
        print(f"{d}: APT -{_ms(apt)} % (all forwards -{_ms(apt_all)} %); decode tok/s "
              f"x{_ms(ratio('tok/s'))}; cost proxy x{_ms(ratio('cost µs/token'))}; NFE/token "
              f"x{_ms(ratio('NFE/token'))}; tasks: APT -{_ms(task_apt)} %, decode tok/s "
              f"x{_ms(ratio('task tok/s'))}{em}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="stage", required=True)
    t = sub.add_parser("train")
    t.add_argument("--out", required=True)
    t.add_argument("--steps", type=int, default=400)
    t.add_argument("--batch-size", type=int, default=8)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--seq-len", type=int, default=32)
    t.add_argument("--init-from", default=AR_RUN)
    t.add_argument("--time-budget", type=float, default=None)
    t.add_argument("--warmup", type=int, default=20)
    t.add_argument("--mix-bytes", type=int, default=300_000)
    t.add_argument("--task-lines", type=int, default=60_000)
    t.add_argument("--block", type=int, default=8, help="tokens per diffusion block")
    t.add_argument("--digits", type=int, default=5, help="digits of copy/reverse problems")
    t.add_argument("--allow-short-init", action="store_true",
                   help="train on an --init-from run that stopped before 90 %% of its steps")  # fmt: skip
    t.add_argument(
        "--seed",
        type=int,
        default=0,
        help="training seed: the data split, the batch order and the sampled mask ratios",
    )
    e = sub.add_parser("eval")
    e.add_argument("--run", nargs="+", default=[], help="trained model(s), e.g. one per seed")
    e.add_argument("--json", help="also write the per-problem-seed rows here (one model)")
    e.add_argument(
        "--combine", nargs="+", default=[],
        help="--json files of models evaluated separately (e.g. in parallel), combined as --run",
    )  # fmt: skip
    e.add_argument("--result", help="write the shared result JSON here (one model per seed)")
    e.add_argument("--ar-run", default=AR_RUN)
    e.add_argument("--per-task", type=int, default=25)
    e.add_argument("--seeds", type=int, nargs="+", default=[0])
    e.add_argument("--tau", type=float, default=0.95)
    e.add_argument("--text-prompts", type=int, default=8)
    e.add_argument("--text-tokens", type=int, default=48, help="new tokens per text prompt")
    e.add_argument("--digits", type=int, default=5, help="digits of copy/reverse problems")
    e.add_argument(
        "--floor",
        type=float,
        default=20.0,
        help="paired EM differences only on tasks where vanilla is above this %%",
    )
    e.add_argument("--bandwidth-gbs", type=float, default=2000.0,
                   help="bandwidth of the cost proxy (GB/s; 2000 ~ a GPU's HBM)")  # fmt: skip
    e.add_argument("--refresh", type=int, nargs="*", default=[],
                   help="also DCD with Refresh-k for these k")  # fmt: skip
    args = ap.parse_args()
    if args.stage == "eval" and not (args.run or args.combine):
        ap.error("eval: give --run and/or --combine")
    if args.stage == "eval" and args.json and (len(args.run) != 1 or args.combine):
        ap.error("eval --json: one --run and no --combine")
    if args.stage == "train":
        stage_train(args)
    else:
        stage_eval(args)


if __name__ == "__main__":
    main()
