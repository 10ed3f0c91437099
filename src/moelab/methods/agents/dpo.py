"""Info-DPO: information gain of the reasoning stages, preference pairs, and the DPO loss.

Our reading of CoME's Info-DPO (no code; ``shared/research/wave3-agents-alignment.md`` §3.2,
3.4):

* a reward LM estimates ``P_k = P(gold action function | prompt, stages ≤ k)`` for k = 0
  (no reasoning) … 3 (summary, subtask, decision) [S]; here the dense warm-up model fine-tuned
  with stage dropout (a random prefix of the reasoning stages kept before ``<af>``) [I];
* ``IG_k = P_k − P_{k−1}`` [S]; the reasoning reward ``R = Π_k max(IG_k, 1e-3)`` [S product,
  I floor];
* K chains sampled per training prompt; chosen: the correct action with the highest R (the gold
  chain when no sample is correct); rejected: the wrong action with the lowest R, else the
  correct one with the lowest R [I]. Rule-DPO [S, baseline of the paper's Table 4]: any
  correct chain against any wrong one;
* DPO (Rafailov et al. 2023, arXiv 2305.18290, Eq. 7):
  ``−log σ(β[(log π(y_w) − log π_ref(y_w)) − (log π(y_l) − log π_ref(y_l))])`` over summed
  response log-probabilities, β = 0.1, the reference the CoT-FT model.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from moelab.errors import InvalidValueError
from moelab.methods.agents.chain import STAGES, ChainStep, action_type, parse_target
from moelab.methods.agents.config import ComeConfig
from moelab.methods.agents.data import AgentData
from moelab.methods.agents.evaluate import generate_chains
from moelab.methods.agents.tokens import IGNORE, EncodedChain, collate, encode_target
from moelab.models import MoETransformer

IG_FLOOR = 1e-3
REASONING = len(STAGES) - 1  # the stages before the action function


def dpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    beta: float,
) -> Tensor:
    """Mean DPO loss over pairs (all inputs ``[N]`` summed response log-probs, nats).

    ``−log σ(β[(π_w − ref_w) − (π_l − ref_l)])`` (Rafailov et al. 2023, Eq. 7).
    """
    margin = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    return -F.logsigmoid(beta * margin).mean()


def information_gain(probs: Sequence[float]) -> list[float]:
    """``IG_k = P_k − P_{k−1}`` for k = 1 … len(probs) − 1 (``probs[0]``: no reasoning)."""
    return [probs[k] - probs[k - 1] for k in range(1, len(probs))]


def reasoning_reward(gains: Sequence[float]) -> float:
    """``Π_k max(IG_k, 1e-3)``: high only when every stage adds information."""
    return math.prod(max(g, IG_FLOOR) for g in gains)


def response_logprob(model: MoETransformer, chains: Sequence[EncodedChain]) -> Tensor:
    """Summed log-probability ``[N]`` of each chain's response (its target tokens)."""
    b = collate(chains)
    logp = model(b.inputs, mask=b.mask).logits.float().log_softmax(-1)
    tgt = b.targets.clamp_min(0)
    tok = logp.gather(-1, tgt[..., None])[..., 0]
    return (tok * (b.targets != IGNORE)).sum(-1)


def _chain(prompt: list[int], parts: Sequence[list[int]], response_from: int) -> EncodedChain:
    """Prompt plus stage parts; tokens before part ``response_from`` count as the prompt."""
    ids = prompt + [t for p in parts[:response_from] for t in p]
    prompt_len = len(ids)
    stage = [-1] * prompt_len
    for k, p in enumerate(parts[response_from:], start=response_from):
        ids += p
        stage += [k] * len(p)
    return EncodedChain(np.array(ids, dtype=np.int64), prompt_len, np.array(stage, dtype=np.int64))


def stage_probabilities(
    logprob: Callable[[list[EncodedChain]], Tensor],
    prompt: list[int],
    parts: Sequence[list[int]],
    function_part: list[int],
) -> list[float]:
    """``[P_0, …, P_3]``: the probability of ``function_part`` (the ``<af>`` stage's ids) after
    the prompt and the first k reasoning ``parts``, under the reward ``logprob`` (summed
    response log-probs of chains, e.g. :func:`response_logprob` of a reward LM)."""
    chains = [_chain(prompt, [*parts[:k], function_part], k) for k in range(len(parts) + 1)]
    return [math.exp(float(v)) for v in logprob(chains)]


def _stage_dropout(chains: Sequence[EncodedChain], gen: torch.Generator) -> list[EncodedChain]:
    out = []
    for c in chains:
        stages = c.stage
        keep = int(torch.randint(REASONING + 1, (1,), generator=gen))
        prompt = c.ids[: c.prompt_len].tolist()
        parts = [c.ids[stages == k].tolist() for k in range(len(STAGES))]
        out.append(_chain(prompt, [*parts[:keep], parts[-1]], 0))
    return out


def train_reward_model(
    dense: MoETransformer, data: AgentData, config: ComeConfig, seed: int
) -> MoETransformer:
    """The reward LM: a copy of the warm-up model trained ``reward_steps`` steps on chains whose
    reasoning is cut to a random prefix of 0–3 stages before ``<af>`` [I]."""
    model = copy.deepcopy(dense).train()
    gen = torch.Generator().manual_seed(seed + 2)
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.01)
    for _ in range(config.reward_steps):
        idx = torch.randint(len(data.train), (config.batch_size,), generator=gen)
        b = collate(_stage_dropout([data.train[int(i)] for i in idx], gen))
        out = model(b.inputs, mask=b.mask)
        loss = F.cross_entropy(
            out.logits.float().flatten(0, 1), b.targets.flatten(), ignore_index=IGNORE
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        opt.step()
    return model.eval()


@dataclass(frozen=True)
class Pair:
    """One preference pair: chosen and rejected chains (same prompt) and the chosen's R."""

    chosen: EncodedChain
    rejected: EncodedChain
    reward: float


def _stage_parts(tokenizer, text: str, eot_id: int) -> list[list[int]] | None:
    got = parse_target(text)
    if any(name not in got for name in STAGES):
        return None
    return encode_target(tokenizer, [got[n] for n in STAGES], eot_id)


def _correct(text: str, step: ChainStep) -> bool:
    got = parse_target(text)
    return (
        action_type(got.get("decision", "")) == action_type(step.decision)
        and got.get("function") == step.function
    )


def build_pairs(
    policy: MoETransformer,
    reward: MoETransformer | None,
    data: AgentData,
    config: ComeConfig,
    seed: int,
) -> list[Pair]:
    """Sample ``dpo_samples`` chains for each of ``dpo_prompts`` training prompts and pick a
    pair per prompt (module docstring); ``reward`` None gives Rule-DPO pairs."""
    gen = torch.Generator().manual_seed(seed + 3)
    n = min(config.dpo_prompts, len(data.train))
    picked = torch.randperm(len(data.train), generator=gen)[:n].tolist()
    prompts = [data.train[i].ids[: data.train[i].prompt_len].tolist() for i in picked]
    K = config.dpo_samples
    outs = generate_chains(
        policy,
        [p for p in prompts for _ in range(K)],
        data.eot_id,
        temperature=config.dpo_temperature,
        seed=seed * 100_003,
    )
    tok = data.tokenizer
    pairs = []
    with torch.no_grad():
        for j, i in enumerate(picked):
            step, gold = data.train_steps[i], data.train[i]
            gold_parts = encode_target(tok, step.stages, data.eot_id)
            cands = []
            for o in outs[j * K : (j + 1) * K]:
                text = tok.decode(o)
                parts = _stage_parts(tok, text, data.eot_id)
                if parts is None:
                    cands.append((False, -1.0, _chain(prompts[j], [[*o, data.eot_id]], 0)))
                    continue
                r = 0.0
                if reward is not None:
                    probs = stage_probabilities(
                        lambda cs: response_logprob(reward, cs),
                        prompts[j],
                        parts[:REASONING],
                        gold_parts[-1],
                    )
                    r = reasoning_reward(information_gain(probs))
                cands.append((_correct(text, step), r, _chain(prompts[j], parts, 0)))
            right = sorted((c for c in cands if c[0]), key=lambda c: -c[1])
            wrong = sorted((c for c in cands if not c[0]), key=lambda c: c[1])
            chosen = right[0] if right else (True, 0.0, gold)
            if wrong:
                rejected = wrong[0]
            elif reward is not None and len(right) > 1 and right[-1][1] < chosen[1]:
                rejected = right[-1]
            else:
                continue
            pairs.append(Pair(chosen[2], rejected[2], chosen[1]))
    return pairs


def train_dpo(
    policy: MoETransformer, pairs: Sequence[Pair], config: ComeConfig, seed: int
) -> list[float]:
    """``dpo_steps`` AdamW steps of the DPO loss on ``pairs`` (batches of ``batch_size // 2``
    pairs), the reference a frozen copy of ``policy`` as given; the per-step losses.

    Raises:
        ValueError: no pairs.
    """
    if not pairs:
        raise InvalidValueError("pairs: no preference pair was built (every sample agreed)")
    ref = copy.deepcopy(policy).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed + 4)
    opt = torch.optim.AdamW(policy.parameters(), lr=config.dpo_lr, weight_decay=0.0)
    size = max(1, config.batch_size // 2)
    policy.train()
    losses = []
    for _ in range(config.dpo_steps):
        idx = torch.randint(len(pairs), (size,), generator=gen).tolist()
        chains = [pairs[i].chosen for i in idx] + [pairs[i].rejected for i in idx]
        lp = response_logprob(policy, chains)
        with torch.no_grad():
            lr_ = response_logprob(ref, chains)
        loss = dpo_loss(lp[:size], lp[size:], lr_[:size], lr_[size:], config.dpo_beta)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), config.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
    policy.eval()
    return losses
