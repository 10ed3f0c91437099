"""Apply a stream of edits to a frozen causal LM, one at a time, and restore it.

The edited site is one ``nn.Linear`` named by ``EditConfig.layer``. TIME, LoRA + key and
GRACE replace it by an :class:`~moelab.methods.editing.layer.EditedLinear` (the original
module is kept and put back by :meth:`Editor.restore`, so restoring is bit-identical); FT-L
trains the layer's weight in place and :meth:`Editor.restore` copies the saved weight back.

Each edit trains only its own new parameters (``steps`` Adam steps; every model parameter is
frozen meanwhile and its ``requires_grad`` flag restored after). The lower blocks are frozen,
so an edit inside ``blocks.<i>`` computes the states entering block i once
(:meth:`~moelab.models.MoETransformer.hidden_at`) and each step recomputes only blocks i…L-1
(:meth:`~moelab.models.MoETransformer.forward_from`); the activations at the edited layer do
not depend on the edits, so TIME's negative memory is cached once.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moelab.errors import InvalidTypeError, InvalidValueError
from moelab.methods.editing.config import EditConfig
from moelab.methods.editing.cp import CPEditBank
from moelab.methods.editing.grace import GraceBank
from moelab.methods.editing.layer import EditBank, EditedLinear
from moelab.methods.editing.lora_key import LoRAKeyBank
from moelab.methods.editing.requests import EditRequest, TokenizedEdit, tokenize_edit
from moelab.models.linear import Linear

_BLOCK = re.compile(r"(?:^|\.)blocks\.(\d+)\.")


def pad_batch(seqs: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Right-pad 1-D int64 sequences with 0 → ``ids [B, S]`` and ``mask [B, S]`` (True = real)."""
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
        mask[i, : len(s)] = True
    return ids, mask


def make_bank(config: EditConfig, layer: nn.Linear) -> EditBank | None:
    """The edit bank of ``config.method`` for ``layer`` (None for FT-L)."""
    d_out, d_in = layer.weight.shape
    if config.method == "time":
        return CPEditBank(d_in, d_out, config.rank, config.factor_shape, config.threshold)
    if config.method == "lora-key":
        return LoRAKeyBank(d_in, d_out, config.rank, config.key_threshold)
    if config.method == "grace":
        return GraceBank(d_in, d_out, config.grace_eps)
    return None


class Editor:
    """Edits ``model`` (a causal :class:`~moelab.models.MoETransformer`) with
    ``config.method`` at ``config.layer``; the model is changed in place until
    :meth:`restore`.

    Raises:
        InvalidValueError: no module ``config.layer``, or not an ``nn.Linear`` (an already
            edited layer included); a bad ``factor_shape``/``rank`` for TIME.
        InvalidTypeError: ``model`` has no cached-prefix forward (``hidden_at``/``forward_from``).
    """

    def __init__(self, model: nn.Module, config: EditConfig) -> None:
        if not all(hasattr(model, n) for n in ("hidden_at", "forward_from")):
            raise InvalidTypeError(
                f"model: {type(model).__name__} is not a causal moelab LM (no forward_from)"
            )
        try:
            layer = model.get_submodule(config.layer)
        except AttributeError:
            raise InvalidValueError(f"layer: the model has no module {config.layer!r}") from None
        if type(layer) not in (nn.Linear, Linear):  # not a wrapped or quantized projection
            raise InvalidValueError(
                f"layer: {config.layer!r} is a {type(layer).__name__}, not an nn.Linear"
            )
        self.model, self.config, self.original = model, config, layer
        found = _BLOCK.search("." + config.layer)
        self.start_block = int(found.group(1)) if found else 0
        self.max_len = model.cfg.max_seq_len
        self.edit_seconds: list[float] = []
        self.applied = 0
        self.stream_length = 0
        self.requests: list[EditRequest] = []
        self._negatives: Tensor | None = None
        self.bank = make_bank(config, layer)
        parent_name, _, self._child = config.layer.rpartition(".")
        self._parent = model.get_submodule(parent_name) if parent_name else model
        self._saved_weight = layer.weight.detach().clone()
        self.site: nn.Module = layer
        if self.bank is not None:
            self.bank.to(layer.weight.device)
            self.site = EditedLinear(layer, self.bank)
            setattr(self._parent, self._child, self.site)

    # ----------------------------------------------------------------- queries
    @property
    def num_edits(self) -> int:
        """Edits applied (and held) so far."""
        return self.applied

    @property
    def params_per_edit(self) -> int:
        """Values one edit adds (TIME: R·(d1+d2+d_out)); FT-L: the layer's weight, all changed."""
        return self.bank.params_per_edit if self.bank is not None else self.original.weight.numel()

    def logits(
        self, ids: Tensor, mask: Tensor | None = None, hidden: Tensor | None = None
    ) -> Tensor:
        """Logits ``[B, S, V]`` of the edited model; ``hidden``: the cached states entering
        the start block (from :meth:`prefix`), else computed."""
        if hidden is None:
            hidden = self.prefix(ids, mask)
        return self.model.forward_from(hidden, mask, start_block=self.start_block)

    def prefix(self, ids: Tensor, mask: Tensor | None = None) -> Tensor:
        """The frozen states entering the start block, ``[B, S, D]`` (edits never change them)."""
        return self.model.hidden_at(ids, mask, block=self.start_block)

    def site_inputs(
        self, ids: Tensor, mask: Tensor | None = None, hidden: Tensor | None = None
    ) -> Tensor:
        """The edited layer's inputs at the real tokens, ``[N, d_in]`` (row-major over the batch)."""
        seen: list[Tensor] = []
        handle = self.site.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
        try:
            with torch.no_grad():
                self.logits(ids, mask, hidden)
        finally:
            handle.remove()
        a = seen[0]
        return a[mask] if mask is not None else a.reshape(-1, a.shape[-1])

    # ----------------------------------------------------------------- editing
    def set_negatives(self, seqs: Sequence[Tensor], batch_size: int = 32) -> None:
        """TIME's memory of unrelated inputs: the edited layer's inputs at every real token of
        ``seqs`` (1-D int64 token sequences)."""
        parts = []
        for i in range(0, len(seqs), batch_size):
            ids, mask = pad_batch(seqs[i : i + batch_size])
            parts.append(self.site_inputs(ids, mask))
        self._negatives = torch.cat(parts) if parts else None

    def tokenize(self, requests: Sequence[EditRequest], tokenizer) -> list[TokenizedEdit]:
        """Tokenise and check a whole stream before any edit is applied.

        Raises:
            InvalidValueError: a bad request (named by its index), or more edits than
                ``capacity`` allows.
        """
        free = self.config.capacity - self.num_edits
        if len(requests) > free:
            raise InvalidValueError(
                f"edits: {len(requests)} edits exceed the capacity left ({free} of "
                f"{self.config.capacity})"
            )
        return [
            tokenize_edit(r, tokenizer, self.max_len, f"edit {i}") for i, r in enumerate(requests)
        ]

    def apply_stream(
        self,
        requests: Sequence[EditRequest],
        tokenizer,
        on_edit: Callable[[int, float], None] | None = None,
    ) -> None:
        """Check every request (:meth:`tokenize`), then apply them in order;
        ``on_edit(i, seconds)`` after each."""
        edits = self.tokenize(requests, tokenizer)
        self.stream_length += len(edits)
        for i, (request, edit) in enumerate(zip(requests, edits, strict=True)):
            seconds = self.apply(edit)
            self.requests.append(request)
            if on_edit is not None:
                on_edit(i, seconds)

    def apply(self, edit: TokenizedEdit) -> float:
        """Train one edit (its own new parameters only) and freeze it; returns its seconds.

        Raises:
            InvalidValueError: the model already holds ``capacity`` edits.
        """
        if self.site is self.original and self.bank is not None:
            raise InvalidValueError("editor: restored; start a new Editor to edit again")
        if self.num_edits >= self.config.capacity:
            raise InvalidValueError(f"edits: the capacity of {self.config.capacity} is reached")
        start = time.perf_counter()
        ids = edit.input_ids[None]
        hidden = self.prefix(ids)
        flags = {p: p.requires_grad for p in self.model.parameters()}
        for p in flags:
            p.requires_grad_(False)
        try:
            if self.bank is None:
                self._train_layer(hidden, edit)
            else:
                self._train_expert(ids, hidden, edit)
        finally:
            for p, flag in flags.items():
                p.requires_grad_(flag)
        seconds = time.perf_counter() - start
        self.edit_seconds.append(seconds)
        self.applied += 1
        return seconds

    def _ce(self, hidden: Tensor, edit: TokenizedEdit) -> Tensor:
        if len(edit.positions) == 1:  # the LM head at one position costs as much as 8 blocks
            at = edit.positions
            logits = self.model.forward_from(hidden, start_block=self.start_block, logits_at=at)
            return F.cross_entropy(logits[0].float(), edit.targets)
        logits = self.model.forward_from(hidden, start_block=self.start_block)[0]
        return F.cross_entropy(logits[edit.positions].float(), edit.targets)

    def _train_layer(self, hidden: Tensor, edit: TokenizedEdit) -> None:
        weight = self.original.weight
        weight.requires_grad_(True)
        opt = torch.optim.Adam([weight], lr=self.config.ft_lr)
        for _ in range(self.config.steps):
            loss = self._ce(hidden, edit)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        weight.grad = None

    def _train_expert(self, ids: Tensor, hidden: Tensor, edit: TokenizedEdit) -> None:
        cfg, bank, site = self.config, self.bank, self.site
        a_edit = self.site_inputs(ids, None, hidden)[edit.positions]
        params = bank.start(a_edit, self.original)
        lr = cfg.grace_lr if cfg.method == "grace" else cfg.lr
        opt = torch.optim.Adam(params, lr=lr)
        train_positions = torch.zeros(ids.shape, dtype=torch.bool)
        train_positions[0, edit.positions] = True
        site.train_positions = train_positions
        try:
            for _ in range(cfg.steps):
                loss = self._ce(hidden, edit)
                if cfg.method == "time" and cfg.margin_weight > 0:
                    loss = (
                        loss
                        + cfg.margin_weight * F.relu(cfg.beta - bank.pending_scores(a_edit)).mean()
                    )
                    if self._negatives is not None and len(self._negatives):
                        neg = bank.pending_scores(self._negatives)
                        loss = loss + cfg.margin_weight * F.relu(neg - cfg.alpha).mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        finally:
            site.train_positions = None
        bank.commit()

    # ----------------------------------------------------------------- restore
    def restore(self) -> None:
        """Undo every edit: the original layer module back in place (TIME, LoRA + key,
        GRACE) or its saved weight copied back (FT-L); bit-identical to before. A restored
        TIME/LoRA/GRACE editor applies no more edits."""
        if self.bank is not None:
            setattr(self._parent, self._child, self.original)
        else:
            with torch.no_grad():
                self.original.weight.copy_(self._saved_weight)
        self.site = self.original
        self.edit_seconds.clear()
        self.requests.clear()
        self.applied = self.stream_length = 0
