"""Token ids of chains with an output-oriented stage label per position.

A chain is ``prompt ids + stage 0 ids + … + stage 3 ids + [eot]``, each stage encoded on its
own (its marker first) so every target token belongs to exactly one stage; the end token
belongs to the last stage. Position t of the model input predicts token t+1, so its stage
label is the stage of token t+1 (output-oriented activation [P]); positions whose next token
is still the prompt are labelled stage 0, the screen-summary expert [I].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from moelab.data.tokenizer import Tokenizer
from moelab.errors import InvalidValueError
from moelab.methods.agents.chain import MARKERS, ChainStep

IGNORE = -100


@dataclass(frozen=True)
class EncodedChain:
    """One chain as ids: ``ids`` int64 ``[n]``, ``prompt_len`` (ids before ``<ss>``) and
    ``stage`` int64 ``[n]`` (the stage of each token, -1 for prompt tokens)."""

    ids: np.ndarray
    prompt_len: int
    stage: np.ndarray


def encode_target(tokenizer: Tokenizer, stages: Sequence[str], eot_id: int) -> list[list[int]]:
    """The ids of each stage (marker included; the first stage's text without a leading
    space, later ones with one); ``eot_id`` closes the last stage."""
    out = []
    for k, (marker, text) in enumerate(zip(MARKERS, stages, strict=True)):
        out.append(tokenizer.encode(("" if k == 0 else " ") + f"{marker} {text}"))
    out[-1].append(eot_id)
    return out


def fit_prompt(prompt: list[int], room: int) -> list[int]:
    """``prompt`` cut to ``room`` ids by dropping DOM ids from its end (its last id, the
    newline before the chain, is kept)."""
    return prompt if len(prompt) <= room else prompt[: room - 1] + prompt[-1:]


def encode_chain(tokenizer: Tokenizer, step: ChainStep, eot_id: int, max_len: int) -> EncodedChain:
    """Encode one chain step; a prompt too long for ``max_len`` keeps its first and last
    lines' tokens by dropping DOM tokens from its end (the chain is never cut).

    Raises:
        ValueError: the target alone does not fit in ``max_len`` (with a 16-token prompt).
    """
    parts = encode_target(tokenizer, step.stages, eot_id)
    n_target = sum(len(p) for p in parts)
    prompt = tokenizer.encode(step.prompt)
    room = max_len - n_target
    if room < 16:
        raise InvalidValueError(f"max_len: {max_len} leaves no room for a {n_target}-token chain")
    prompt = fit_prompt(prompt, room)
    ids = np.array(prompt + [t for p in parts for t in p], dtype=np.int64)
    stage = np.array([-1] * len(prompt) + [k for k, p in enumerate(parts) for _ in p])
    return EncodedChain(ids=ids, prompt_len=len(prompt), stage=stage.astype(np.int64))


@dataclass
class Batch:
    """A padded batch of chains for teacher forcing (all ``[B, S]``, S = longest chain − 1).

    Attributes:
        inputs: int64 ids (padding 0).
        mask: bool, True at real positions.
        targets: int64 next ids; ``IGNORE`` on prompt and padding positions (the loss is on
            the chain only).
        stage: int64 output-oriented stage label of each position (prompt positions 0,
            padding ``IGNORE``).
        chain: bool, True where the target is a chain token.
    """

    inputs: Tensor
    mask: Tensor
    targets: Tensor
    stage: Tensor
    chain: Tensor


def collate(chains: Sequence[EncodedChain]) -> Batch:
    """Pad chains into a :class:`Batch` (see the module docstring for the labels)."""
    if not chains:
        raise InvalidValueError("chains: need at least one")
    S = max(len(c.ids) for c in chains) - 1
    B = len(chains)
    inputs = torch.zeros(B, S, dtype=torch.long)
    targets = torch.full((B, S), IGNORE, dtype=torch.long)
    stage = torch.full((B, S), IGNORE, dtype=torch.long)
    mask = torch.zeros(B, S, dtype=torch.bool)
    for b, c in enumerate(chains):
        n = len(c.ids) - 1
        ids = torch.from_numpy(c.ids)
        inputs[b, :n] = ids[:-1]
        mask[b, :n] = True
        nxt = torch.from_numpy(c.stage[1:])
        stage[b, :n] = nxt.clamp_min(0)
        chain = nxt >= 0
        targets[b, :n] = torch.where(chain, ids[1:], IGNORE)
    return Batch(inputs, mask, targets, stage, targets != IGNORE)
