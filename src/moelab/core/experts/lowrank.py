"""Low-rank corrections of a bank of expert matrices, and the fused path that applies them.

Every scheme is one factor grid: expert ``e`` sits at grid cell ``(row(e), col(e))`` and its
correction of a matrix ``W_e [O, I]`` is

    ``L_e = U_{row(e)} · S_e · Ṽ_{col(e)}ᵀ``,   ``U [M, O, r]``, ``Ṽ [N, I, r]``, ``S [K, r, r]``

- per-expert (LQER / MiLo style): ``M = N = K``, ``row(e) = col(e) = e``, no core (``S = I``);
  extra parameters ``K·r·(I + O)``;
- 1-D shared: one column factor (``N = 1``), one row factor per expert (``M = K``), no core;
  ``r·I + K·r·O``;
- ``tileq`` — TileQ 2-D (arXiv 2605.09281) as the authors' code builds it
  (``get_experts_2Dlora`` in ``get_scale_quant.py``, vendored in nicyyyy/GLoRCQ [K]):
  ``K <= cells`` experts on a grid (empty cells allowed), shared output-side factors ``U``
  (with the one shared length-r ``Σ`` folded in), shared input-side factors ``V``, **no core**,
  and a per-expert input un-scaling ``in_scale [K, I]`` (the code's ``Sa_e = 1/s_e``):

      ``L_e = U_{row(e)} · V_{col(e)}ᵀ · diag(in_scale_e)``;

  extra parameters ``r·(#U·O + #V·I) + K·I``;
- ``tileq-core`` — moelab's own variant (a strict generalisation we measured): ``K = M·N``
  experts bijectively on an ``M × N`` grid, shared row factors ``U_m``, shared column factors
  ``Ṽ_n`` and an ``r × r`` core per expert; ``M·r·O + N·r·I + K·r²``.

Except for ``tileq``'s ``in_scale``, ``Ṽ`` already carries the inverse activation scaling
(``Ṽ = D⁻¹V``), so inference never touches the calibration statistics.

The fused path (TileQ's "global input projection, routing-weighted accumulation,
reconstruction") runs every selected expert's correction with three dense GEMMs and two
masks, no per-expert loop:

0. (``tileq`` only) ``x ← x ⊙ in_scale[e]`` — one gathered element-wise product per row;
1. ``z = x · [Ṽ_1 … Ṽ_N]`` — one GEMM ``[rows, I] × [I, N·r]`` (the input projection onto all
   column factors), then keep only the block ``col(e)`` of each row's expert;
2. ``h = z · C`` with the block matrix ``C [N·r, M·r]`` whose block ``(col(e), row(e))`` is
   ``S_eᵀ`` (identity without cores; the expert → cell map is injective, so ``C`` holds every
   core once and an empty cell's block is zero), then keep
   only block ``row(e)``; for the token form the rows are scaled by their combine weights and
   summed per token (routing-weighted accumulation into each grid row's ``r`` slots);
3. ``y = h · [U_1 … U_M]ᵀ`` — one GEMM ``[., M·r] × [M·r, O]`` (the reconstruction).

The token form is exact only for a linear map followed by the weighted combine (the down
projection): the gate/up corrections must stay per row because the activation follows them.
Choice [I]: the masked dense GEMMs (rather than gathers per row) are our reading of the paper's
"sparse per-expert work as batched dense GEMMs"; the paper's kernel (LoTileMoE) is not public.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moelab.errors import InvalidValueError

SCHEMES = ("per-expert", "shared-1d", "tileq-core", "tileq")


def expert_of_rows(counts: Tensor) -> Tensor:
    """``[N]`` expert index of every row for rows sorted by expert with ``counts [E]``."""
    return torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts)


class LowRankFactors(nn.Module):
    """The factors of one projection's low-rank correction over K experts (see module doc).

    Buffers:
        U: ``[M, O, r]`` row factors.
        V: ``[N, I, r]`` column factors (``Ṽ = D⁻¹V``, activation scaling folded in).
        S: ``[K, r, r]`` cores (tileq-core only; absent means identity).
        in_scale: ``[K, I]`` per-expert input un-scaling (tileq only; the code's ``Sa_e``).
        row_of, col_of: ``[K]`` int64 grid cell of every expert (indices into ``U`` / ``V``).

    Raises:
        ValueError: inconsistent shapes, or a grid map that puts two experts on one cell.
    """

    def __init__(
        self,
        scheme: str,
        U: Tensor,
        V: Tensor,
        row_of: Tensor,
        col_of: Tensor,
        S: Tensor | None = None,
        in_scale: Tensor | None = None,
    ) -> None:
        super().__init__()
        if scheme not in SCHEMES:
            raise InvalidValueError(f"scheme: must be one of {SCHEMES}, got {scheme!r}")
        if U.dim() != 3 or V.dim() != 3 or U.shape[2] != V.shape[2]:
            raise InvalidValueError(
                f"U, V: expected [M, O, r] and [N, I, r], got {tuple(U.shape)}, {tuple(V.shape)}"
            )
        K = row_of.shape[0]
        r = U.shape[2]
        if col_of.shape != (K,):
            raise InvalidValueError(f"col_of: expected [{K}], got {tuple(col_of.shape)}")
        if S is not None and S.shape != (K, r, r):
            raise InvalidValueError(f"S: expected [{K}, {r}, {r}], got {tuple(S.shape)}")
        if scheme == "tileq-core" and S is None:
            raise InvalidValueError("S: the tileq-core scheme needs per-expert cores")
        if scheme == "tileq" and S is not None:
            raise InvalidValueError("S: the tileq scheme has one shared Σ (folded in U), no cores")
        if (scheme == "tileq") != (in_scale is not None):
            raise InvalidValueError("in_scale: given exactly for the tileq scheme")
        if in_scale is not None and in_scale.shape != (K, V.shape[1]):
            raise InvalidValueError(
                f"in_scale: expected [{K}, {V.shape[1]}], got {tuple(in_scale.shape)}"
            )
        cells = row_of.long() * V.shape[0] + col_of.long()
        if int(row_of.max()) >= U.shape[0] or int(col_of.max()) >= V.shape[0]:
            raise InvalidValueError("row_of/col_of: grid index out of range")
        if scheme != "shared-1d" and cells.unique().numel() != K:
            raise InvalidValueError("row_of/col_of: two experts share one grid cell")
        self.scheme = scheme
        self.register_buffer("U", U.contiguous())
        self.register_buffer("V", V.contiguous())
        self.register_buffer("S", S.contiguous() if S is not None else None)
        self.register_buffer("in_scale", in_scale.contiguous() if in_scale is not None else None)
        self.register_buffer("row_of", row_of.long().clone())
        self.register_buffer("col_of", col_of.long().clone())

    # --------------------------------------------------------------- shapes
    @property
    def rank(self) -> int:
        return self.U.shape[2]

    @property
    def num_experts(self) -> int:
        return self.row_of.shape[0]

    @property
    def grid(self) -> tuple[int, int]:
        """``(M, N)``: number of row and column factors."""
        return self.U.shape[0], self.V.shape[0]

    def extra_params(self) -> int:
        """Stored factor entries (``U``, ``V``, ``S`` and ``in_scale``; the int grid map is not
        counted)."""
        n = self.U.numel() + self.V.numel()
        return n + sum(t.numel() for t in (self.S, self.in_scale) if t is not None)

    def _core(self, e: int) -> Tensor:
        if self.S is None:
            return torch.eye(self.rank, dtype=self.U.dtype, device=self.U.device)
        return self.S[e]

    def delta(self, e: int) -> Tensor:
        """Expert ``e``'s dense correction ``L_e = U S Ṽᵀ`` (``· diag(in_scale_e)``) ``[O, I]``."""
        U = self.U[self.row_of[e]]
        V = self.V[self.col_of[e]]
        L = U @ self._core(e) @ V.T
        return L * self.in_scale[e] if self.in_scale is not None else L

    def dense(self) -> Tensor:
        """All corrections ``[K, O, I]``."""
        return torch.stack([self.delta(e) for e in range(self.num_experts)])

    # --------------------------------------------------------------- compute
    def _mixing(self, dtype: torch.dtype) -> Tensor:
        """The block matrix ``C [N·r, M·r]`` with block ``(col(e), row(e)) = S_eᵀ``."""
        M, N = self.grid
        r = self.rank
        C = torch.zeros(N, r, M, r, dtype=dtype, device=self.U.device)
        if self.S is not None:
            cores = self.S.to(dtype).transpose(1, 2)
        else:
            cores = torch.eye(r, dtype=dtype, device=self.U.device).expand(self.num_experts, r, r)
        C[self.col_of, :, self.row_of, :] = cores
        return C.view(N * r, M * r)

    def _row_slots(self, x_N: Tensor, experts: Tensor) -> Tensor:
        """Steps 1-2 of the fused path: ``[rows, M·r]`` with only block ``row(e)`` filled."""
        M, N = self.grid
        r = self.rank
        dt = x_N.dtype
        rows = x_N.shape[0]
        if self.in_scale is not None:
            x_N = x_N * self.in_scale.to(dt)[experts]
        V_cat = self.V.to(dt).permute(1, 0, 2).reshape(-1, N * r)
        z = (x_N @ V_cat).view(rows, N, r)
        if N > 1:
            z = z * nn.functional.one_hot(self.col_of[experts], N).to(dt).unsqueeze(-1)
        h = (z.view(rows, N * r) @ self._mixing(dt)).view(rows, M, r)
        if M > 1:
            h = h * nn.functional.one_hot(self.row_of[experts], M).to(dt).unsqueeze(-1)
        return h.view(rows, M * r)

    def _reconstruct(self, h: Tensor) -> Tensor:
        M, d_out, r = self.U.shape
        U_cat = self.U.to(h.dtype).permute(0, 2, 1).reshape(M * r, d_out)
        return h @ U_cat

    def apply_rows(self, x_N: Tensor, experts: Tensor) -> Tensor:
        """Fused per-row correction ``y[i] = L_{experts[i]} x[i]``.

        Args:
            x_N: ``[rows, I]`` inputs (any float dtype; computed in it).
            experts: ``[rows]`` int64 expert of every row (any order).
        Returns:
            ``[rows, O]``.
        """
        return self._reconstruct(self._row_slots(x_N, experts))

    def apply_tokens(
        self, x_N: Tensor, experts: Tensor, token_idx: Tensor, weight: Tensor, num_tokens: int
    ) -> Tensor:
        """Fused routing-weighted correction ``y[t] = Σ_{rows i of t} w_i · L_{e_i} x_i``.

        The ``r``-dim row-slot vectors are accumulated per token (``h_{t,m} = Σ g_e S_e z``)
        before the one reconstruction GEMM. Args as :meth:`apply_rows` plus ``token_idx``
        ``[rows]`` int64 and ``weight`` ``[rows]`` float combine weights. Returns
        ``[num_tokens, O]`` in float32 (float64 for float64 inputs), like the combine.
        """
        h = self._row_slots(x_N, experts)
        acc = torch.float64 if x_N.dtype == torch.float64 else torch.float32
        h = h.to(acc) * weight.to(acc).unsqueeze(-1)
        h_T = h.new_zeros(num_tokens, h.shape[1]).index_add(0, token_idx, h)
        return self._reconstruct(h_T)

    def apply_loop(self, x_N: Tensor, counts: Tensor) -> Tensor:
        """Reference: one expert at a time on rows sorted by expert (``counts [K]``),
        ``y_e = (((x_e ⊙ in_scale_e) Ṽ_c) S_eᵀ) U_mᵀ``. Returns ``[rows, O]``."""
        out = x_N.new_zeros(x_N.shape[0], self.U.shape[1])
        start = 0
        dt = x_N.dtype
        for e, c in enumerate(counts.tolist()):
            if not c:
                continue
            xe = x_N[start : start + c]
            if self.in_scale is not None:
                xe = xe * self.in_scale[e].to(dt)
            z = xe @ self.V[self.col_of[e]].to(dt)
            if self.S is not None:
                z = z @ self.S[e].to(dt).T
            out[start : start + c] = z @ self.U[self.row_of[e]].to(dt).T
            start += c
        return out
