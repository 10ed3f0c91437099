"""Block-diffusion decoding: vanilla threshold decoding and TEAM (arXiv 2602.08404).

Base decoder (SDAR's ``block_diffusion_generate``, the authors' config): the prompt's complete
blocks are prefilled into the KV cache; each later block starts as the prompt's tail plus mask
tokens and is denoised step by step: predict every position (the mask id is never predicted),
confidence ``c = p(argmax)``; transfer every masked position with ``c > τ``; if none, transfer
the single most confident one (top-1 fallback; low-confidence remasking = the rest stay
masked). A finished block is forwarded once more to store its keys/values (SDAR's
``store_kv`` pass). Greedy (top_k = 1).

TEAM adds, each switchable (:class:`DecodeOptions`):

- ``cache`` (DCD, :mod:`.experts`): a decoded token (unmasked and not transferred at the
  previous step) reuses its per-layer MoE output from the previous forward.
- ``limit`` (LAC, :mod:`.experts`): cold masked tokens may only use experts activated by the
  non-cold tokens. Cold (authors' code) = still masked, distance to every unmasked position of
  the both-filled branch ``> hot_distance``, not one of the ``hot_top`` = 2 most confident
  masked positions of the previous step, previous confidence ``< hot_threshold`` (0.7).
- ``speculate`` (SEH, :mod:`.branches`): 4 branches in one forward.

Our choices (labelled): the authors' code uses block 32 and distance ``> 3``; we scale the
distance to the block, ``hot_distance = max(1, round(3·b/32))`` unless given. Nothing is cold on
a block's first step (no previous confidences yet). SEH needs a previous step and >= 2 masked
positions; otherwise the step runs B0 alone. The KV-storing forward of a finished block
follows the same DCD rule and counts as a forward (0 tokens accepted); the prompt prefill is
not counted. The decoded length is rounded up to whole blocks and cut to ``max_new_tokens``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from moelab.models import MoETransformer
from moelab.models.block_diffusion import (
    PrefixKV,
    block_causal_mask,
    check_diffusion_model,
    diffusion_forward,
)
from moelab.serve.diffusion.branches import branch_forward, build_branches, choose_branch
from moelab.serve.diffusion.experts import TeamMoEStep, check_team_router
from moelab.serve.diffusion.stats import DecodeStats

DECODERS = ("vanilla", "cache", "cache+limit", "team")


@dataclass
class DecodeOptions:
    """Settings of :func:`diffusion_generate`.

    Attributes:
        threshold: τ in (0, 1]: transfer masked tokens with confidence above it (0.95 in the
            authors' configs).
        cache, limit, speculate: TEAM's DCD, LAC and SEH.
        hot_threshold: τ_h of LAC (0.7 in the authors' code).
        hot_distance: LAC distance (cold iff farther than this from every unmasked
            position); None = ``max(1, round(3·block_size/32))``.
        hot_top: the previous step's most confident masked positions that are always hot.
    """

    threshold: float = 0.95
    cache: bool = False
    limit: bool = False
    speculate: bool = False
    hot_threshold: float = 0.7
    hot_distance: int | None = None
    hot_top: int = 2

    @classmethod
    def preset(cls, name: str, threshold: float = 0.95) -> DecodeOptions:
        """``vanilla``, ``cache``, ``cache+limit`` or ``team`` (all three)."""
        if name not in DECODERS:
            raise ValueError(f"decoder: must be one of {DECODERS}, got {name!r}")
        return cls(
            threshold=threshold,
            cache=name != "vanilla",
            limit=name in ("cache+limit", "team"),
            speculate=name == "team",
        )

    def __post_init__(self) -> None:
        if not 0 < self.threshold <= 1:
            raise ValueError(f"threshold: must be in (0, 1], got {self.threshold}")
        if not 0 <= self.hot_threshold <= 1:
            raise ValueError(f"hot_threshold: must be in [0, 1], got {self.hot_threshold}")
        if self.hot_distance is not None and self.hot_distance < 0:
            raise ValueError(f"hot_distance: must be >= 0, got {self.hot_distance}")


@dataclass
class DecodeResult:
    """``ids``: the new tokens (list of int); ``stats``: :class:`DecodeStats`."""

    ids: list[int]
    stats: DecodeStats = field(default_factory=DecodeStats)


def transfer_set(conf: Tensor, masked: Tensor, threshold: float) -> Tensor:
    """Bool ``[n, b]``: masked positions with ``conf > threshold``; a row with none (but some
    masked) transfers its most confident masked position (top-1 fallback)."""
    tr = masked & (conf > threshold)
    c = conf.masked_fill(~masked, -1.0)
    top = c.argmax(dim=-1)
    need = masked.any(dim=-1) & ~tr.any(dim=-1)
    tr[need, top[need]] = True
    return tr


def cold_positions(
    branch: Tensor, ref: Tensor, prev_conf: Tensor, mask_id: int, opts: DecodeOptions, b: int
) -> Tensor:
    """Bool ``[b]``: LAC's cold rule for ``branch [b]`` with distances measured in ``ref [b]``
    (the both-filled branch) and the previous step's confidences ``prev_conf [b]``."""
    dist_max = opts.hot_distance if opts.hot_distance is not None else max(1, round(3 * b / 32))
    masked = branch == mask_id
    pos = torch.arange(b, device=branch.device)
    unm = (ref != mask_id).nonzero().squeeze(1)
    if unm.numel():
        dist = (pos[:, None] - unm[None, :]).abs().min(dim=1).values
    else:
        dist = torch.full((b,), b + 1, device=branch.device)
    ref_masked = ref == mask_id
    top = prev_conf.masked_fill(~ref_masked, -1.0).topk(min(opts.hot_top, b)).indices
    in_top = torch.zeros(b, dtype=torch.bool, device=branch.device)
    in_top[top] = True
    return masked & (dist > dist_max) & ~in_top & (prev_conf < opts.hot_threshold)


@torch.no_grad()
def diffusion_generate(
    model: MoETransformer,
    prompt_ids: list[int],
    *,
    max_new_tokens: int = 64,
    options: DecodeOptions | None = None,
    stop_id: int | None = None,
) -> DecodeResult:
    """Decode ``max_new_tokens`` tokens after ``prompt_ids`` with block diffusion.

    Stops after the block in which ``stop_id`` appears (the result is cut after it) or at
    ``max_seq_len``.

    Raises:
        ValueError: a causal model (decode it with ``moelab.serve.generate``), an empty
            prompt, ``max_new_tokens < 1``, ids out of range, a router TEAM cannot drive.
    """
    check_diffusion_model(model)
    opts = options or DecodeOptions()
    cfg = model.cfg
    if not prompt_ids:
        raise ValueError("prompt: must encode to at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
    if min(prompt_ids) < 0 or max(prompt_ids) >= cfg.mask_token_id:
        raise ValueError(f"prompt: ids must be in [0, {cfg.mask_token_id})")
    for blk in model.blocks:
        if blk.is_moe:
            check_team_router(blk)
    was_training = model.training
    model.eval()
    try:
        return _decode(model, list(prompt_ids), max_new_tokens, opts, stop_id)
    finally:
        model.train(was_training)


def _decode(model, prompt, max_new, opts: DecodeOptions, stop_id) -> DecodeResult:
    cfg = model.cfg
    b, mask_id = cfg.block_size, cfg.mask_token_id
    device = model.embed.weight.device
    t0 = time.perf_counter()
    P0 = len(prompt)
    end = min(P0 + max_new, cfg.max_seq_len)
    n_blocks = -(-end // b)
    if n_blocks * b > cfg.max_seq_len:
        n_blocks = cfg.max_seq_len // b
    if n_blocks * b <= P0:
        raise ValueError(f"prompt: {P0} tokens leave no room in max_seq_len={cfg.max_seq_len}")
    x = torch.full((n_blocks * b,), mask_id, dtype=torch.long, device=device)
    x[:P0] = torch.tensor(prompt, device=device)
    prefix = PrefixKV()
    stats = DecodeStats()
    first = P0 // b
    if first:
        pos = torch.arange(first * b, device=device)
        diffusion_forward(
            model, x[None, : first * b], pos, block_causal_mask(pos, pos, b), prefix=prefix,
            store=True,
        )  # fmt: skip
    for j in range(first, n_blocks):
        s = j * b
        cur = x[s : s + b].clone()
        stored, prev_conf, prev_pred = None, None, None
        just = torch.zeros(b, dtype=torch.bool, device=device)  # transferred at the last step
        while bool((cur == mask_id).any()):
            masked = cur == mask_id
            spec = opts.speculate and prev_pred is not None and int(masked.sum()) >= 2
            if spec:
                p1, p2 = (int(i) for i in prev_conf.masked_fill(~masked, -1.0).topk(2).indices)
                f1, f2 = int(prev_pred[p1]), int(prev_pred[p2])
                branches = build_branches(cur, p1, p2, f1, f2)
            else:
                branches = cur[None]
            n = branches.shape[0]
            hook = _hook(branches, cur, just, stored, prev_conf, mask_id, opts, b)
            logits = branch_forward(model, branches, s, prefix, hook).float()
            logits[..., mask_id] = float("-inf")
            conf, pred = logits.softmax(dim=-1).max(dim=-1)
            bmasked = branches == mask_id
            tr = transfer_set(conf, bmasked, opts.threshold)
            k = choose_branch(tr, pred, p1, p2, f1, f2) if spec else 0
            new = branches[k].clone()
            new[tr[k]] = pred[k][tr[k]]
            just = masked & (new != mask_id)
            stats.add(hook.experts_per_layer(), int(just.sum()))
            stored = {i: y.view(n, b, -1)[k] for i, y in hook.outputs.items()}
            prev_conf, prev_pred = conf[k], pred[k]
            cur = new
        x[s : s + b] = cur
        done = stop_id is not None and bool((x[max(s, P0) : s + b] == stop_id).any())
        if j + 1 < n_blocks and not done:  # store the finished block's keys/values
            hook = _hook(cur[None], cur, just, stored, None, mask_id, opts, b)
            pos = torch.arange(s, s + b, device=device)
            diffusion_forward(
                model, cur[None], pos, torch.ones(b, prefix.length + b, dtype=torch.bool,
                device=device), prefix=prefix, store=True, moe_hook=hook,
            )  # fmt: skip
            stats.add(hook.experts_per_layer(), 0)
        if done:
            break
    stats.wall_s = time.perf_counter() - t0
    out = x[P0:end].tolist()
    if stop_id is not None and stop_id in out:
        out = out[: out.index(stop_id) + 1]
    return DecodeResult(ids=out, stats=stats)


def _hook(branches, cur, just, stored, prev_conf, mask_id, opts, b) -> TeamMoEStep:
    """The MoE step for this forward: DCD reuse rows and LAC cold rows over all branches."""
    n = branches.shape[0]
    reuse = None
    if opts.cache and stored is not None:
        decoded = (cur != mask_id) & ~just
        reuse = decoded.repeat(n)
        stored = {i: y.repeat(n, 1) for i, y in stored.items()}
    cold = None
    if opts.limit and prev_conf is not None:
        ref = branches[-1]
        cold = torch.cat([cold_positions(br, ref, prev_conf, mask_id, opts, b) for br in branches])
    return TeamMoEStep(reuse=reuse, stored=stored, cold=cold)
