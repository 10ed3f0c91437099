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

The single pass (TileQ's "global input projection, routing-weighted accumulation,
reconstruction", arXiv 2605.09281 §4 [S]) — rows sorted by expert, ``counts [K]`` per expert:

1. input projection ``z = x · Ṽ_{col(e)}`` (``[rows, r]``):
   - once per **token** when the column factors are shared and expert-independent
     (``shared-1d``, ``tileq-core``: no ``in_scale``; :attr:`LowRankFactors.projects_tokens`):
     one GEMM ``[T, I] × [I, N·r]`` over the token inputs, then each row gathers its
     expert's ``r``-block ``col(e)`` — the gate/up input is the same ``x_t`` for a token's
     k experts, so this is k rows' projections for the price of ``N·r / (k·r)`` of them;
   - per **row** otherwise: for ``tileq`` the input un-scaling makes the projection
     expert-specific (``(x ⊙ s_e) Ṽ_c = x · (diag(s_e) Ṽ_c)``, a per-expert factor), for
     ``per-expert`` every expert has its own factor, and for the down projection the input
     (the activation) differs per row anyway — a grouped matmul by expert, ``I·r`` MACs a row;
2. (``tileq-core``) the core ``z ← z S_eᵀ``, a grouped matmul by expert;
3. reconstruction ``y = z U_{row(e)}ᵀ``: per row (grouped matmul by expert, ``r·O`` MACs a
   row) — gate/up must stay per row because the activation follows them; for the down
   projection of the TileQ schemes (:meth:`LowRankFactors.apply_tokens`) the rows' ``z`` are
   scaled by their combine weights and accumulated per token into grid row ``row(e)``'s ``r``
   slots, then one GEMM ``[T, M·r] × [M·r, O]`` reconstructs every token (exact because the
   down projection is linear and followed by the weighted combine).

The per-expert and shared-1d baselines keep their own simplest kernels (per-row grouped
matmuls; shared-1d's single column factor is projected once per token), not TileQ's form.
Choice [I]: grouped matmuls stand in for the paper's kernel (LoTileMoE, not public).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moelab.core.experts.grouped_mm import grouped_mm
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
    @property
    def projects_tokens(self) -> bool:
        """Whether the input projection is done once per token: the column factors are shared
        (fewer than the experts) and expert-independent (no ``in_scale``)."""
        return self.in_scale is None and self.V.shape[0] < self.num_experts

    @property
    def accumulates_tokens(self) -> bool:
        """Whether :meth:`apply_tokens` applies (the TileQ schemes' routing-weighted
        accumulation into grid-row slots)."""
        return self.scheme in ("tileq", "tileq-core")

    def _coords(
        self, x_N: Tensor, counts: Tensor, x_T: Tensor | None, token_idx: Tensor | None
    ) -> Tensor:
        """Steps 1-2: ``[rows, r]`` coordinates ``(x Ṽ_{col(e)}) S_eᵀ`` of every row."""
        dt = x_N.dtype
        if x_T is not None and self.projects_tokens:
            N, r = self.V.shape[0], self.rank
            V_cat = self.V.to(dt).permute(1, 0, 2).reshape(-1, N * r)
            z_T = (x_T.to(dt) @ V_cat).view(x_T.shape[0], N, r)
            z = z_T[token_idx, self.col_of[expert_of_rows(counts)]]
        else:
            V_e = self.V.to(dt)[self.col_of]
            if self.in_scale is not None:
                V_e = V_e * self.in_scale.to(dt).unsqueeze(-1)
            z = grouped_mm(x_N, V_e, counts)
        if self.S is not None:
            z = grouped_mm(z, self.S.to(dt).transpose(1, 2), counts)
        return z

    def apply_rows(
        self,
        x_N: Tensor,
        counts: Tensor,
        x_T: Tensor | None = None,
        token_idx: Tensor | None = None,
    ) -> Tensor:
        """Per-row correction ``y[i] = L_{e_i} x[i]`` (single pass, see module doc).

        Args:
            x_N: ``[rows, I]`` inputs sorted by expert (any float dtype; computed in it).
            counts: ``[K]`` int64 rows per expert.
            x_T: ``[T, I]`` token inputs with ``x_N == x_T[token_idx]`` (gate/up): lets the
                shared-factor schemes project each token once; None projects per row.
            token_idx: ``[rows]`` int64 token of every row (with ``x_T``).
        Returns:
            ``[rows, O]``.
        """
        z = self._coords(x_N, counts, x_T, token_idx)
        return grouped_mm(z, self.U.to(z.dtype)[self.row_of].transpose(1, 2), counts)

    def apply_tokens(
        self, x_N: Tensor, counts: Tensor, token_idx: Tensor, weight: Tensor, num_tokens: int
    ) -> Tensor:
        """Routing-weighted correction ``y[t] = Σ_{rows i of t} w_i · L_{e_i} x_i`` with the
        ``r``-dim coordinates accumulated per token into grid row ``row(e)``'s slots before one
        reconstruction GEMM (TileQ schemes; see module doc).

        Args as :meth:`apply_rows` (rows sorted by expert) plus ``token_idx [rows]`` int64 and
        ``weight [rows]`` float combine weights. Returns ``[num_tokens, O]`` in float32
        (float64 for float64 inputs), like the combine.
        """
        M, d_out, r = self.U.shape
        acc = torch.float64 if x_N.dtype == torch.float64 else torch.float32
        z = self._coords(x_N, counts, None, None).to(acc) * weight.to(acc).unsqueeze(-1)
        slot = token_idx * M + self.row_of[expert_of_rows(counts)]
        h_T = z.new_zeros(num_tokens * M, r).index_add(0, slot, z)
        U_cat = self.U.to(acc).permute(0, 2, 1).reshape(M * r, d_out)
        return h_T.view(num_tokens, M * r) @ U_cat

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
