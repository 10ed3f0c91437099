"""The same weights in moelab and in transformers, for the side-by-side benchmarks.

``ensure_hf`` exports a run with ``moelab convert`` (reused when present); ``greedy_fns``
returns greedy generators for both libraries over the same prompts, and ``decode_rate`` turns
two timings into decode tokens/s with the prefill cancelled out.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from moelab.models import MoETransformer
from moelab.serve import Engine, SamplingParams


def ensure_hf(run: Path, work: Path) -> Path:
    """``work/<run name>-hf``: the run exported to a Hugging Face folder (made once)."""
    from moelab.interop.hf import convert

    dst = work / (run.resolve().name + "-hf")
    if not (dst / "config.json").is_file():
        convert(run, dst, "hf")
    return dst


def load_hf(hf_dir: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype).eval()


def greedy_fns(
    model: MoETransformer, hf, prompts: list[list[int]], compile: bool = False
) -> tuple[Callable[[int, int], list[list[int]]], Callable[[int, int], list[list[int]]]]:
    """``(ours, theirs)``: ``f(B, n)`` greedily generates n tokens for the first B prompts
    (all of one length, so no padding) in one batch and returns the new ids per prompt.
    Ours runs moelab's serving engine (its decode steps compiled with ``compile``); theirs
    ``generate(do_sample=False)``."""
    L = len(prompts[0])

    def ours(B: int, n: int) -> list[list[int]]:
        engine = Engine(model, max_batch=B, compile=compile)
        seqs = [engine.submit(p, SamplingParams(max_tokens=n, temperature=0)) for p in prompts[:B]]
        while engine.has_work():
            engine.step()
        return [q.output_ids for q in seqs]

    @torch.inference_mode()
    def theirs(B: int, n: int) -> list[list[int]]:
        x = torch.tensor(prompts[:B])
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                          min_new_tokens=n, do_sample=False, pad_token_id=0)  # fmt: skip
        return out[:, L:].tolist()

    return ours, theirs


def decode_rate(batch: int, n: int, t_n: float, t_1: float) -> float:
    """Decode tokens/s ``B·(n−1) / (T(n) − T(1))``: the prefill and first token cancel out."""
    return batch * (n - 1) / (t_n - t_1)
