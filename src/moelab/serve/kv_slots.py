"""A slotted KV cache for continuous batching: one row per running sequence, each at its own
position.

The cache holds ``n_slots`` rows (the engine's maximum number of concurrent sequences).
Running sequences occupy rows ``0 .. n-1`` (kept compact: a finished sequence's row is filled
by moving the last row into it), so a decode step attends over a plain slice of the buffers
and never gathers. New sequences are prefilled into rows ``n ..`` (a window of fresh rows; right padding
is trimmed off afterwards with :meth:`trim`). Buffers start small and grow as
positions are written (:meth:`moelab.models.KVCache.reserve`).

Our choice (vLLM pages its cache in fixed blocks; we do not): contiguous per-row buffers are
enough for the short contexts of moelab's models and keep attention a single SDPA call; the
price is that every row is sized for the longest running sequence.

Routers that carry state over the prefix (USMoE ``causal_prefix``) get one
:class:`~moelab.core.routers.usmoe.PrefixState` per MoE layer over all slots. A forward pass
extends the window's rows by its S positions at the same state index; the other rows get
invalid entries there. The causal-prefix rule only reads the valid entries of a row, in order
(prefix log-sum-exps and a ranking over them), so those gaps change nothing, and when the
state holds more than twice the longest row it is compacted (each row's valid entries moved
to the front, order kept), which keeps memory linear in the longest sequence.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moelab.core.routers.usmoe import PrefixState
from moelab.models import KVCache, MoETransformer


class SlotKVCache(KVCache):
    """``n_slots`` independent sequences in one set of buffers, each row at its own length.

    The model writes into the current *window* of rows ``[lo, hi)`` (:meth:`select`); a call
    with an int ``start_pos`` writes every window row at that position (a prefill), a call
    with an int64 ``[hi-lo]`` tensor writes row ``i`` at ``start_pos[i]`` (a decode step).
    Each row must continue exactly at its own cached length (no gaps, no rewinds).

    Attributes:
        lengths: host list, positions cached per row (0 for a free row).
    """

    def __init__(self, model: MoETransformer, n_slots: int, *, initial_len: int = 64) -> None:
        cfg = model.cfg
        p = model.embed.weight
        super().__init__(
            cfg.n_layers,
            n_slots,
            cfg.n_kv_heads,
            cfg.max_seq_len,
            cfg.head_dim,
            dtype=p.dtype,
            device=p.device,
            initial_len=initial_len,
        )
        self.lengths = [0] * n_slots
        self._lo, self._hi = 0, n_slots
        self._end = 0
        self._rows = torch.arange(n_slots, device=p.device)
        # per MoE layer: the state of every slot, and the window view a forward pass extends
        self._prefix: dict[int, PrefixState] = {}
        self._window: dict[int, tuple[PrefixState, int, int]] = {}

    @property
    def n_slots(self) -> int:
        return self.batch_size

    @property
    def window(self) -> tuple[int, int]:
        """The rows ``(lo, hi)`` the next forward pass reads and writes (:meth:`select`)."""
        return self._lo, self._hi

    def select(self, lo: int, hi: int) -> None:
        """Make rows ``[lo, hi)`` the window the next forward pass reads and writes."""
        if not 0 <= lo < hi <= self.n_slots:
            raise ValueError(f"rows: need 0 <= lo < hi <= {self.n_slots}, got [{lo}, {hi})")
        self._settle()
        self._lo, self._hi = lo, hi

    def release(self, row: int) -> None:
        """Free ``row`` (its positions become unattendable; the buffers are reused)."""
        self._settle()
        self.key_mask[row] = False
        self.lengths[row] = 0
        self.length = max(self.lengths)  # advance() extends this maximum without a rescan
        for state in self._prefix.values():
            state.valid[row] = False

    def trim(self, row: int, length: int) -> None:
        """Forget the positions of ``row`` from ``length`` on (e.g. the right padding of a
        batched prefill); the next write continues at ``length``."""
        self.key_mask[row, length:] = False
        self.lengths[row] = length
        self.length = max(self.lengths)

    def move(self, src: int, dst: int) -> None:
        """Copy row ``src`` (keys, values, mask, length) into row ``dst`` and free ``src``."""
        if src == dst:
            return
        self._settle()
        n = self.lengths[src]
        for k, v in zip(self.k, self.v, strict=True):
            k[dst, :, :n] = k[src, :, :n]
            v[dst, :, :n] = v[src, :, :n]
        for state in self._prefix.values():
            state.logits[dst] = state.logits[src]
            state.valid[dst] = state.valid[src]
        self.key_mask[dst] = self.key_mask[src]
        self.lengths[dst] = n
        self.release(src)

    # ------------------------------------------------ the protocol the model calls
    def check(self, batch_size: int, start_pos: int | Tensor, num_new: int) -> None:
        """Raise ``ValueError`` unless the window continues every row at its length."""
        lo, hi = self._lo, self._hi
        if batch_size != hi - lo:
            raise ValueError(f"kv_cache: the window holds {hi - lo} rows, got batch {batch_size}")
        shared = isinstance(start_pos, int)  # every row at one position
        starts = [start_pos] * (hi - lo) if shared else start_pos.tolist()
        # A compiled decode (Engine(compile=True)) took start_pos from these lengths. Comparing
        # them inside its graph would make each row's length a symbol equal to start_pos, and
        # inductor then sized buffers by a length symbol that is no input of the graph
        # (NameError at run time, from 7 rows on).
        if not (shared and torch.compiler.is_compiling()):
            have = self.lengths[lo:hi]
            if starts != have:
                raise ValueError(
                    f"start_pos: rows must continue at their cached lengths {have}, got {starts}"
                )
        last = (start_pos if shared else max(starts)) + num_new
        if last > self.max_len:
            raise ValueError(
                f"kv_cache: positions up to {last - 1} exceed its max_len={self.max_len}"
            )

    def advance(self, start_pos: int | Tensor, mask: Tensor | None, num_new: int) -> Tensor:
        """Record ``num_new`` positions per window row; return its key mask ``[n, L]``."""
        lo, hi = self._lo, self._hi
        # every window row continues at its length (check() made sure); with one shared
        # position the end and the lengths follow from start_pos alone, so a compiled decode
        # sizes its key/value views by its input rather than by the rows' lengths (see check())
        shared = isinstance(start_pos, int)
        starts = [start_pos] * (hi - lo) if shared else self.lengths[lo:hi]
        self._end = (start_pos if shared else max(starts)) + num_new
        self.reserve(self._end)
        if shared:
            self.key_mask[lo:hi, start_pos : self._end] = True if mask is None else mask
        elif num_new == 1 and mask is None:
            self.key_mask[self._rows[lo:hi], start_pos] = True
        else:
            for i, s in enumerate(starts):
                self.key_mask[lo + i, s : s + num_new] = True if mask is None else mask[i]
        self.lengths[lo:hi] = [s + num_new for s in starts]
        self.length = max(self.length, self._end)  # release() keeps it the longest row's
        return self.key_mask[lo:hi, : self._end]

    def update(
        self, layer: int, start_pos: int | Tensor, k: Tensor, v: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Write ``k, v [n, Hkv, S, hd]`` at each window row's position; return the window's
        keys/values ``[n, Hkv, L, hd]`` (``L`` = the longest row; shorter rows' tails are
        masked out by :meth:`advance`'s key mask)."""
        lo, hi = self._lo, self._hi
        kb, vb = self.k[layer], self.v[layer]
        S = k.shape[2]
        if isinstance(start_pos, int):
            kb[lo:hi, :, start_pos : start_pos + S] = k
            vb[lo:hi, :, start_pos : start_pos + S] = v
        elif S == 1:
            rows = self._rows[lo:hi]
            kb[rows, :, start_pos] = k[:, :, 0]
            vb[rows, :, start_pos] = v[:, :, 0]
        else:
            for i, s in enumerate(start_pos.tolist()):
                kb[lo + i, :, s : s + S] = k[i]
                vb[lo + i, :, s : s + S] = v[i]
        return kb[lo:hi, :, : self._end], vb[lo:hi, :, : self._end]

    def routing_state(self, layer: int, router, start_pos: int | Tensor) -> PrefixState:
        """The window rows' causal-prefix router state of MoE layer ``layer``; the router
        extends it in place and the cache takes the result back before its next use
        (``start_pos`` is not needed: :meth:`check` already requires every row to continue at
        its own length)."""
        self._settle(layer)
        state = self._prefix.get(layer)
        if state is None:
            state = router.new_prefix_state(self.n_slots, self.key_mask.device)
            self._prefix[layer] = state
        lo, hi = self._lo, self._hi
        window = PrefixState(state.logits[lo:hi], state.valid[lo:hi])
        self._window[layer] = (window, lo, hi)
        return window

    def reset(self) -> None:
        super().reset()
        self._prefix.clear()
        self._window.clear()
        self.lengths = [0] * self.n_slots

    def _settle(self, layer: int | None = None) -> None:
        """Write the extended window states back into the all-slot states (every layer, or
        just ``layer``), padding the rows outside the window with invalid entries."""
        for i in [layer] if layer is not None else list(self._window):
            if i not in self._window:
                continue
            window, lo, hi = self._window.pop(i)
            state = self._prefix[i]
            grow = window.length - state.length
            if grow > 0:
                state.logits = torch.cat(
                    [
                        state.logits,
                        state.logits.new_zeros(self.n_slots, grow, state.logits.shape[2]),
                    ],
                    1,
                )
                state.valid = torch.cat([state.valid, state.valid.new_zeros(self.n_slots, grow)], 1)
            state.logits[lo:hi] = window.logits
            state.valid[lo:hi] = window.valid
            if state.length > 2 * max(self.lengths) + 16:
                _compact(state)


def _compact(state: PrefixState) -> None:
    """Move each row's valid entries to the front (order kept) and drop the all-invalid tail."""
    order = torch.sort((~state.valid).to(torch.int8), dim=1, stable=True).indices
    n = int(state.valid.sum(1).max()) if state.valid.numel() else 0
    order = order[:, :n]
    state.logits = state.logits.gather(1, order.unsqueeze(-1).expand(-1, -1, state.logits.shape[2]))
    state.valid = state.valid.gather(1, order)
