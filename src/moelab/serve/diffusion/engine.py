"""Serving a block-diffusion MoE LM: the continuous-batching engine at block granularity.

:class:`DiffusionEngine` keeps :class:`~moelab.serve.engine.Engine`'s queue, limits, threads,
events, stop handling and statistics, and replaces its two model steps:

- admission builds a :class:`~moelab.serve.diffusion.decode.BlockDecoder` per request (the
  prompt's complete blocks are prefilled into that sequence's own prefix cache);
- each iteration denoises **one block of every running sequence** (threshold decoding or
  TEAM, :class:`~moelab.serve.diffusion.decode.DecodeOptions`) and emits its new tokens.
  Requests join and leave between iterations, as on the causal path.

Our choices, labelled: sequences are interleaved, not stacked into one forward (TEAM's
speculative branches already batch inside a sequence, and sequences sit at different block
offsets with their own prefix lengths); a request's temperature/top-k/top-p apply to every
position's draw, its confidence being the drawn token's probability (SDAR's sampler), and
temperature 0 is the authors' greedy setting; the ``routing`` extension reports, per token,
the experts of its position in the forward that accepted it.
"""

from __future__ import annotations

import logging

from moelab.models import MoETransformer
from moelab.models.block_diffusion import check_diffusion_model
from moelab.serve.diffusion.decode import (
    BlockDecoder,
    DecodeOptions,
    check_prompt,
    sampling_picker,
)
from moelab.serve.diffusion.experts import check_team_router
from moelab.serve.engine import Engine, Sequence

logger = logging.getLogger(__name__)


class DiffusionEngine(Engine):
    """Continuous batching over a block-diffusion model (see the module docstring).

    Args:
        model: a block-diffusion :class:`MoETransformer` with dropless token-choice routers.
        options: the decoder every request uses (default full TEAM at τ = 0.95).
        **kwargs: as :class:`~moelab.serve.engine.Engine` (``tokenizer``, ``max_batch``,
            ``max_queue``, ``prefill_tokens``, ``track_experts``).

    Raises:
        ValueError: a causal model, or a router TEAM cannot drive; as ``Engine`` otherwise.
    """

    def __init__(
        self, model: MoETransformer, *args, options: DecodeOptions | None = None, **kwargs
    ) -> None:
        if isinstance(model, MoETransformer):
            check_diffusion_model(model)
            for blk in model.blocks:
                if blk.is_moe:
                    check_team_router(blk)
        self.options = options or DecodeOptions.preset("team")
        self.decoders: list[BlockDecoder] = []  # decoders[i] decodes running[i]
        super().__init__(model, *args, **kwargs)

    def _make_cache(self) -> None:
        return None  # each BlockDecoder holds its sequence's prefix keys/values

    def submit(self, prompt_ids, params, sink=None) -> Sequence:
        """As :meth:`Engine.submit`; the mask token is not a prompt token either, and the
        prompt must end before the context's last whole block."""
        check_prompt(self.model.cfg, prompt_ids)
        return super().submit(prompt_ids, params, sink)

    def _prefill(self, batch: list[Sequence]) -> None:
        for seq in batch:
            p = seq.params
            dec = BlockDecoder(
                self.model, seq.prompt_ids, max_new_tokens=p.max_tokens, options=self.options,
                stop_ids=p.stop_ids, routing=p.routing, count_experts=self.track_experts,
                pick=sampling_picker(p.temperature, p.top_k, p.top_p, seq._generator),
            )  # fmt: skip
            self.stats.prompt_tokens += len(seq.prompt_ids)
            self.running.append(seq)
            self.decoders.append(dec)

    def _decode(self) -> None:
        for i in range(len(self.running) - 1, -1, -1):  # backwards: removals move later rows
            seq, dec = self.running[i], self.decoders[i]
            try:
                block = dec.next_block()
            except Exception as e:  # one sequence's forward: it fails alone, not the batch
                if not isinstance(e, FloatingPointError):  # broken weights are no bug
                    logger.exception("engine: a block-diffusion step failed for one request")
                self._remove_row(i)
                self._fail([seq], e, str(e) if isinstance(e, FloatingPointError) else None)
                continue
            if block.expert_counts is not None:
                self._count_experts(block.expert_counts)
            for t, token in enumerate(block.ids):
                self._accept(i, seq, token, block.experts[t] if block.experts else None)
                if seq.finish_reason is not None:
                    break
            if seq.finish_reason is None and dec.done:  # the context is full
                self._remove_row(i)
                self._finish(seq, "length")

    def _clear_rows(self) -> None:
        self.decoders.clear()

    def _remove_row(self, row: int) -> None:
        self.decoders[row] = self.decoders[-1]
        self.decoders.pop()
        self.running[row] = self.running[-1]
        self.running.pop()
