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
  previous step) reuses its per-layer MoE output from the previous forward. Tokens that
  speculation accepted (the filled p1/p2 of the chosen branch) are not "transferred": that
  forward computed their outputs from the filled tokens themselves, so the next step reuses
  them (the authors' ``decoded_index = (cur_x != mask_id) & ~transfer_index``, where
  ``transfer_index`` excludes the fills) [C]; ``reuse_fills=False`` recomputes them once more
  (this project's earlier rule, +1.7 % APF on a toy model per the audit). With speculation,
  every branch reuses the outputs of the branch that was accepted (the authors'
  ``SDARMoeDecoderLayer.forward`` slices the ``choice_id`` branch's stored states and tiles
  them over the four branches).
- ``limit`` (LAC, :mod:`.experts`): cold masked tokens may only use experts activated by the
  non-cold tokens. Cold (authors' code) = still masked, distance to every unmasked position of
  the both-filled branch ``> hot_distance`` (3), not one of the ``hot_top`` = 2 most confident
  masked positions of the current block (B0) at the previous step, previous confidence
  ``< hot_threshold`` (0.7); when that branch has no unmasked position every distance is 0,
  so nothing is cold.
- ``speculate`` (SEH, :mod:`.branches`): 4 branches in one forward.

Our choices (labelled): the LAC distance is the authors' absolute 3 by default (their block is
32); ``hot_distance=None`` scales it to the block, ``max(1, round(3·b/32))`` [I] (1 at block
8). Nothing is cold on a block's first step (no previous confidences yet). SEH needs a previous
step and >= 2 masked positions; otherwise the step runs B0 alone (the authors always run 4
branches from the second step, B2 = B0 and B3 = B1 with one masked position: the same tokens
with more rows). The KV-storing forward of a finished block computes every token's MoE output,
with no reuse and no limit (the authors' code runs it without stored states), so the
keys/values later blocks attend to are exact; it is recorded as a KV forward (0 tokens
accepted), which :class:`DecodeStats` leaves out of APF/TPF/APT/NFE and keeps in their
``*_all`` variants. The prompt prefill is not counted as a forward and its time is recorded
apart (``prefill_s``). The decoded length is rounded up to whole blocks and cut to
``max_new_tokens``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch
from torch import Tensor

from moelab.errors import InvalidValueError, NonFiniteOutputError
from moelab.models import ModelConfig, MoETransformer
from moelab.models.block_diffusion import (
    PrefixKV,
    block_causal_mask,
    check_diffusion_model,
    diffusion_forward,
)
from moelab.serve.diffusion.branches import branch_forward, build_branches, choose_branch
from moelab.serve.diffusion.experts import TeamMoEStep, check_team_router
from moelab.serve.diffusion.stats import DecodeStats
from moelab.serve.sampling import check_sampling, filtered_logits

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
            position); 3 in the authors' code; None = ``max(1, round(3·block_size/32))``.
        hot_top: the previous step's most confident masked positions that are always hot.
        refresh: with ``cache``, every ``refresh``-th step of a block recomputes every token
            (the paper's Refresh-k ablation); None = refresh-free, the authors' default.
        reuse_fills: with ``cache``, the tokens speculation accepted reuse their outputs from
            the accepting forward (the authors' rule); False recomputes them once more.
    """

    threshold: float = 0.95
    cache: bool = False
    limit: bool = False
    speculate: bool = False
    hot_threshold: float = 0.7
    hot_distance: int | None = 3
    hot_top: int = 2
    refresh: int | None = None
    reuse_fills: bool = True

    @classmethod
    def preset(cls, name: str, threshold: float = 0.95) -> DecodeOptions:
        """``vanilla``, ``cache``, ``cache+limit`` or ``team`` (all three)."""
        if name not in DECODERS:
            raise InvalidValueError(f"decoder: must be one of {DECODERS}, got {name!r}")
        return cls(
            threshold=threshold,
            cache=name != "vanilla",
            limit=name in ("cache+limit", "team"),
            speculate=name == "team",
        )

    def __post_init__(self) -> None:
        if not 0 < self.threshold <= 1:
            raise InvalidValueError(f"threshold: must be in (0, 1], got {self.threshold}")
        if not 0 <= self.hot_threshold <= 1:
            raise InvalidValueError(f"hot_threshold: must be in [0, 1], got {self.hot_threshold}")
        if self.hot_distance is not None and self.hot_distance < 0:
            raise InvalidValueError(f"hot_distance: must be >= 0, got {self.hot_distance}")
        if self.refresh is not None and self.refresh < 1:
            raise InvalidValueError(f"refresh: must be >= 1, got {self.refresh}")


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
    branch: Tensor,
    ref: Tensor,
    base: Tensor,
    prev_conf: Tensor,
    mask_id: int,
    opts: DecodeOptions,
    b: int,
) -> Tensor:
    """Bool ``[b]``: LAC's cold rule for ``branch [b]`` with distances measured in ``ref [b]``
    (the both-filled branch; none unmasked there: every distance is 0, nothing is cold, as in
    the authors' code), the ``hot_top`` most confident masked positions taken in ``base [b]``
    (the current block, B0: the authors' ``mask_index``; with speculation these are the two
    positions the branches fill) and the previous step's confidences ``prev_conf [b]``."""
    dist_max = opts.hot_distance if opts.hot_distance is not None else max(1, round(3 * b / 32))
    masked = branch == mask_id
    pos = torch.arange(b, device=branch.device)
    unm = (ref != mask_id).nonzero().squeeze(1)
    if unm.numel():
        dist = (pos[:, None] - unm[None, :]).abs().min(dim=1).values
    else:
        dist = torch.zeros(b, dtype=torch.long, device=branch.device)
    top = prev_conf.masked_fill(base != mask_id, -1.0).topk(min(opts.hot_top, b)).indices
    in_top = torch.zeros(b, dtype=torch.bool, device=branch.device)
    in_top[top] = True
    return masked & (dist > dist_max) & ~in_top & (prev_conf < opts.hot_threshold)


Picker = Callable[[Tensor], tuple[Tensor, Tensor]]
"""``logits [n, b, V]`` (float32, the mask id at ``-inf``) → ``(confidence [n, b],
prediction [n, b])``."""


def greedy_pick(logits: Tensor) -> tuple[Tensor, Tensor]:
    """The most likely token and its probability (the authors' top_k = 1 setting)."""
    return logits.softmax(dim=-1).max(dim=-1)


def sampling_picker(
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Picker:
    """A :data:`Picker` that samples each position from its temperature/top-k/top-p filtered
    distribution, with the sampled token's probability as its confidence (SDAR's
    ``sample_with_temperature_topk_topp``). A temperature below 1e-6 is greedy.

    Raises:
        ValueError: temperature not a finite number >= 0, top_k < 1, or top_p outside (0, 1].
    """
    check_sampling(temperature, top_k, top_p)
    if temperature < 1e-6:
        return greedy_pick

    def pick(logits: Tensor) -> tuple[Tensor, Tensor]:
        probs = filtered_logits(logits, temperature, top_k, top_p).softmax(dim=-1)
        flat = probs.reshape(-1, probs.shape[-1])
        pred = torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])
        return probs.gather(-1, pred.unsqueeze(-1)).squeeze(-1), pred

    return pick


@dataclass
class DecodedBlock:
    """What one block added.

    Attributes:
        ids: the new tokens (after the prompt, cut at ``max_new_tokens`` and after a stop id).
        experts: with ``routing``, per new token and MoE layer (in layer order) the experts
            its position used in the forward that accepted it; else None.
        expert_counts: with ``count_experts``, per MoE layer, routed (position, expert)
            pairs per expert over the block's forwards (speculative branches included, reused
            positions excluded); else None.
    """

    ids: list[int]
    experts: list[list[list[int]]] | None
    expert_counts: list[list[int]] | None


def check_prompt(cfg: ModelConfig, prompt_ids: list[int]) -> None:
    """Refuse a prompt a block-diffusion model cannot continue: empty, an id outside
    ``[0, mask_token_id)`` (the mask token included), or so long that no whole block of the
    context is left to decode.

    Raises:
        ValueError: naming the reason.
    """
    if not prompt_ids:
        raise InvalidValueError("prompt: must encode to at least one token")
    if cfg.mask_token_id in prompt_ids:
        raise InvalidValueError(f"prompt: token id {cfg.mask_token_id} is the mask token")
    if min(prompt_ids) < 0 or max(prompt_ids) >= cfg.mask_token_id:
        raise InvalidValueError(f"prompt: ids must be in [0, {cfg.mask_token_id})")
    room = cfg.max_seq_len // cfg.block_size * cfg.block_size
    if len(prompt_ids) >= room:
        raise InvalidValueError(
            f"prompt: {len(prompt_ids)} tokens leave no block to decode in the context of "
            f"{cfg.max_seq_len} (blocks of {cfg.block_size})"
        )


class BlockDecoder:
    """Block-by-block decoding of one sequence (what :func:`diffusion_generate` loops over and
    the serving engine interleaves between sequences).

    Construction prefills the prompt's complete blocks; each :meth:`next_block` denoises one
    block until no mask is left and stores its keys/values. The model must be in eval mode.

    Args:
        model: a block-diffusion :class:`MoETransformer` with dropless token-choice routers.
        prompt_ids: the prompt (ids below the mask id).
        max_new_tokens: most tokens to add (>= 1); ``max_seq_len`` also bounds the sequence.
        options: the decoder (:class:`DecodeOptions`; default vanilla at τ = 0.95).
        stop_ids: decoding ends after the block in which one appears (cut after it).
        pick: how a position's token and confidence are chosen (default greedy).
        routing: also collect :attr:`DecodedBlock.experts`.
        count_experts: also collect :attr:`DecodedBlock.expert_counts`.

    Raises:
        ValueError: a causal model (decode it with ``moelab.serve.generate``), an empty
            prompt, ``max_new_tokens < 1``, ids out of range, a prompt that fills the context,
            a router TEAM cannot drive.
        NonFiniteOutputError: (from :meth:`next_block`; a FloatingPointError) NaN or inf logits.
    """

    def __init__(
        self,
        model: MoETransformer,
        prompt_ids: list[int],
        *,
        max_new_tokens: int,
        options: DecodeOptions | None = None,
        stop_ids: Collection[int] = (),
        pick: Picker = greedy_pick,
        routing: bool = False,
        count_experts: bool = False,
    ) -> None:
        check_diffusion_model(model)
        cfg = model.cfg
        check_prompt(cfg, prompt_ids)
        if max_new_tokens < 1:
            raise InvalidValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
        self.moe_blocks = [blk for blk in model.blocks if blk.is_moe]
        for blk in self.moe_blocks:
            check_team_router(blk)
        t0 = time.perf_counter()
        self.model, self.opts = model, options or DecodeOptions()
        self.pick, self.routing = pick, routing
        self.layer_experts = [b.ffn.config.router.num_experts for b in self.moe_blocks]
        num_experts = max(self.layer_experts, default=0)  # a pruned model's layers differ
        self.counts_shape = (len(self.moe_blocks), num_experts) if count_experts else None
        self.stop_ids = set(stop_ids)
        b, P0 = cfg.block_size, len(prompt_ids)
        self.P0, self.end = P0, min(P0 + max_new_tokens, cfg.max_seq_len)
        self.n_blocks = min(-(-self.end // b), cfg.max_seq_len // b)
        self.device = model.embed.weight.device
        self.x = torch.full(
            (self.n_blocks * b,), cfg.mask_token_id, dtype=torch.long, device=self.device
        )
        self.x[:P0] = torch.tensor(prompt_ids, device=self.device)
        self.prefix = PrefixKV()
        self.stats = DecodeStats()
        self.j = P0 // b  # the next block to decode
        self.done = False
        if self.j:
            pos = torch.arange(self.j * b, device=self.device)
            with torch.no_grad():
                diffusion_forward(
                    model, self.x[None, : self.j * b], pos, block_causal_mask(pos, pos, b),
                    prefix=self.prefix, store=True,
                )  # fmt: skip
        self.stats.prefill_s += time.perf_counter() - t0
        self.stats.wall_s += time.perf_counter() - t0

    @torch.no_grad()
    def next_block(self) -> DecodedBlock:
        """Denoise the next block. Raises ``RuntimeError`` once :attr:`done`."""
        if self.done:
            raise RuntimeError("next_block: decoding already finished")
        t0 = time.perf_counter()
        cfg, opts = self.model.cfg, self.opts
        b, mask_id, device = cfg.block_size, cfg.mask_token_id, self.device
        s = self.j * b
        cur = self.x[s : s + b].clone()
        counts = torch.zeros(self.counts_shape, dtype=torch.long) if self.counts_shape else None
        experts: dict[int, list[list[int]]] = {}
        stored, prev_conf, prev_pred = None, None, None
        just = torch.zeros(b, dtype=torch.bool, device=device)  # recompute at the next step
        step = 0
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
            fresh = opts.refresh is not None and step % opts.refresh == 0
            hook = _hook(
                branches, cur, just, None if fresh else stored, prev_conf, mask_id, opts, b
            )
            step += 1
            logits = branch_forward(self.model, branches, s, self.prefix, hook).float()
            logits[..., mask_id] = float("-inf")
            if not math.isfinite(float(logits.amax())):  # NaN propagates through amax
                raise NonFiniteOutputError(
                    f"block at position {s}: the model's logits are not finite; its weights "
                    "or activations hold NaN or inf"
                )
            conf, pred = self.pick(logits)
            tr = transfer_set(conf, branches == mask_id, opts.threshold)
            k = choose_branch(tr, pred, p1, p2, f1, f2) if spec else 0
            new = branches[k].clone()
            new[tr[k]] = pred[k][tr[k]]
            accepted = masked & (new != mask_id)  # transferred, plus the accepted fills
            just = tr[k] if opts.reuse_fills else accepted  # outputs computed from masks
            self.stats.add(hook.experts_per_layer(), int(accepted.sum()))
            _add_pair_counts(counts, hook)
            if self.routing:
                pos = accepted.nonzero().squeeze(1).tolist()
                experts.update(_token_experts(hook, k * b, pos))
            stored = {i: y.view(n, b, -1)[k] for i, y in hook.outputs.items()}
            prev_conf, prev_pred = conf[k], pred[k]
            cur = new
        self.x[s : s + b] = cur
        lo, hi = max(s, self.P0), min(s + b, self.end)
        ids = self.x[lo:hi].tolist()
        stop = next((i for i, t in enumerate(ids) if t in self.stop_ids), None)
        if stop is not None:
            ids = ids[: stop + 1]
        self.j += 1
        self.done = stop is not None or self.j >= self.n_blocks or hi >= self.end
        if not self.done:  # store the finished block's keys/values
            hook = TeamMoEStep()  # a full recompute: DCD's stale outputs stay out of the KV
            pos = torch.arange(s, s + b, device=device)
            diffusion_forward(
                self.model, cur[None], pos,
                torch.ones(b, self.prefix.length + b, dtype=torch.bool, device=device),
                prefix=self.prefix, store=True, moe_hook=hook,
            )  # fmt: skip
            self.stats.add(hook.experts_per_layer(), 0, kv=True)
            _add_pair_counts(counts, hook)
        self.stats.wall_s += time.perf_counter() - t0
        token_experts = [experts[p - s] for p in range(lo, lo + len(ids))] if self.routing else None
        per_layer = None
        if counts is not None:  # each layer's own experts: the padding columns are not experts
            per_layer = [c[:E] for c, E in zip(counts.tolist(), self.layer_experts, strict=True)]
        return DecodedBlock(ids, token_experts, per_layer)


def _add_pair_counts(counts: Tensor | None, hook: TeamMoEStep) -> None:
    """Add one forward's routed (row, expert) pairs per MoE layer to ``counts [L, E]``."""
    if counts is None:
        return
    for row, i in enumerate(sorted(hook.choice)):
        counts[row] += torch.bincount(hook.choice[i].reshape(-1).cpu(), minlength=counts.shape[1])


def _token_experts(
    hook: TeamMoEStep, row0: int, positions: list[int]
) -> dict[int, list[list[int]]]:
    """Per block position in ``positions``, the experts of row ``row0 + position`` in every
    MoE layer (an accepted position was masked in the current block, so it was computed,
    never reused)."""
    out: dict[int, list[list[int]]] = {p: [] for p in positions}
    for i in sorted(hook.choice):
        where = {int(r): j for j, r in enumerate(hook.computed[i].tolist())}
        choice = hook.choice[i].tolist()
        for p in positions:
            out[p].append(choice[where[row0 + p]])
    return out


@torch.no_grad()
def diffusion_generate(
    model: MoETransformer,
    prompt_ids: list[int],
    *,
    max_new_tokens: int = 64,
    options: DecodeOptions | None = None,
    stop_id: int | None = None,
    pick: Picker = greedy_pick,
) -> DecodeResult:
    """Decode ``max_new_tokens`` tokens after ``prompt_ids`` with block diffusion.

    Stops after the block in which ``stop_id`` appears (the result is cut after it) or at
    ``max_seq_len``. ``pick`` chooses tokens (default greedy; see :func:`sampling_picker`).

    Raises:
        ValueError: as :class:`BlockDecoder`.
    """
    was_training = model.training
    model.eval()
    try:
        dec = BlockDecoder(
            model, list(prompt_ids), max_new_tokens=max_new_tokens, options=options,
            stop_ids=() if stop_id is None else (stop_id,), pick=pick,
        )  # fmt: skip
        ids: list[int] = []
        while not dec.done:
            ids += dec.next_block().ids
        return DecodeResult(ids=ids, stats=dec.stats)
    finally:
        model.train(was_training)


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
        cold = torch.cat(
            [cold_positions(br, ref, branches[0], prev_conf, mask_id, opts, b) for br in branches]
        )
    return TeamMoEStep(reuse=reuse, stored=stored, cold=cold)
