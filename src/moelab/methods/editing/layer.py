"""A linear layer that carries a bank of edit experts: each token goes to the best-scoring
edit whose score clears its threshold, or to none (then the output is the layer's own, bit
for bit).

An :class:`EditBank` holds the frozen edits as stacked buffers (saved with the model's
state) and, while an edit is being trained, one *pending* edit as separate parameters, so
old edits never move. :class:`EditedLinear` routes: per token, the scores of every frozen
edit, the winner among those at or above their thresholds (argmax), and the winner's output.
While an edit trains, the pending edit is applied, ungated, at the positions the editor marks
(``train_positions``); everywhere else routing is as at inference.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import Tensor, nn


class EditBank(ABC, nn.Module):
    """The interface of an edit-expert kind (TIME's CP tensors, LoRA + key, GRACE).

    Subclasses implement :meth:`scores`, :meth:`thresholds`, :meth:`outputs`,
    :meth:`start`, :meth:`pending_outputs` and :meth:`commit`;
    ``params_per_edit`` is the number of stored values one edit adds.
    """

    params_per_edit: int

    @property
    @abstractmethod
    def num_edits(self) -> int:
        """Frozen edits in the bank."""

    @abstractmethod
    def scores(self, a: Tensor) -> Tensor:
        """Routing scores ``[N, E]`` fp32 of inputs ``a [N, d_in]`` against every frozen edit."""

    @abstractmethod
    def thresholds(self) -> Tensor:
        """``[E]``: edit e fires on a token whose score is >= its threshold."""

    @abstractmethod
    def outputs(self, a: Tensor, base: Tensor, idx: Tensor) -> Tensor:
        """Outputs ``[n, d_out]`` of the tokens ``a [n, d_in]`` routed to edits ``idx [n]``;
        ``base [n, d_out]`` is the layer's own output there."""

    @abstractmethod
    def start(self, a: Tensor, layer: nn.Linear) -> list[nn.Parameter]:
        """Create the pending edit from its activations ``a [P, d_in]`` at the edited
        positions; returns its trainable parameters."""

    @abstractmethod
    def pending_outputs(self, a: Tensor, base: Tensor) -> Tensor:
        """The pending edit's outputs ``[n, d_out]`` (differentiable)."""

    @abstractmethod
    def commit(self) -> None:
        """Freeze the pending edit into the stacked buffers."""

    def _append(self, **tensors: Tensor) -> None:
        """Append one edit's tensors (no leading axis) to the same-named buffers."""
        for name, value in tensors.items():
            old = getattr(self, name)
            setattr(self, name, torch.cat([old, value.detach().to(old.dtype)[None]]))


class EditedLinear(nn.Module):
    """``base`` (an ``nn.Linear``, untouched) plus an :class:`EditBank`.

    Shapes: ``x [..., d_in]`` → ``[..., d_out]``. Telemetry: ``last_routes`` (``[...]``
    int64, the edit each token of the last call went to, -1 for none) and ``fire_counts``
    (``[E]`` int64, tokens routed to each edit since :meth:`reset_telemetry`).
    """

    def __init__(self, base: nn.Linear, bank: EditBank) -> None:
        super().__init__()
        self.base = base
        self.bank = bank
        self.train_positions: Tensor | None = None
        self.last_routes: Tensor | None = None
        self.fire_counts = torch.zeros(0, dtype=torch.long)

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    @property
    def weight(self) -> Tensor:
        return self.base.weight

    def reset_telemetry(self) -> None:
        self.fire_counts = torch.zeros(self.bank.num_edits, dtype=torch.long)
        self.last_routes = None

    def forward(self, x: Tensor) -> Tensor:
        base = self.base(x)
        a = x.reshape(-1, x.shape[-1])
        out = base.reshape(-1, base.shape[-1])
        routes = torch.full((a.shape[0],), -1, dtype=torch.long, device=x.device)
        if self.bank.num_edits:
            with torch.no_grad():
                scores = self.bank.scores(a)
                fired = scores >= self.bank.thresholds()
                idx = scores.masked_fill(~fired, float("-inf")).argmax(-1)
                routes = torch.where(fired.any(-1), idx, routes)
            rows = (routes >= 0).nonzero()[:, 0]
            if rows.numel():
                new = self.bank.outputs(a[rows], out[rows], routes[rows]).to(out.dtype)
                out = out.index_put((rows,), new)
            counts = torch.bincount(routes[routes >= 0].cpu(), minlength=self.bank.num_edits)
            if self.fire_counts.numel() != counts.numel():
                self.fire_counts = torch.zeros_like(counts)
            self.fire_counts += counts
        if self.train_positions is not None:
            rows = self.train_positions.reshape(-1).nonzero()[:, 0]
            new = self.bank.pending_outputs(a[rows], out[rows]).to(out.dtype)
            out = out.index_put((rows,), new)
        self.last_routes = routes.reshape(x.shape[:-1])
        return out.reshape(base.shape)
