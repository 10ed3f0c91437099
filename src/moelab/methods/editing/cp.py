"""TIME's edit experts: rank-R CP tensors over a factorised input whose input factors are
also the router (intrinsic routing).

Paper: "TIME: Tensor-Factorized Mixture-of-Experts with Intrinsic Routing for Lifelong
Multimodal Knowledge Editing", ICML 2026 (poster 64179; no arXiv version, no code). From its
abstract [S]: each edit is a CP-decomposed tensor, and its input factors define the subspace
in which it is active. Everything below is the formalisation of
``shared/research/methods-group3.md`` (d), labelled inferred [I]:

* the edited layer's input ``a ∈ R^{d_in}``, ``d_in = d1·d2``, is reshaped to ``H [d1, d2]``;
  edit e holds ``u_r ∈ R^{d1}``, ``v_r ∈ R^{d2}``, ``w_r ∈ R^{d_out}`` (r < R) and adds
  ``ΔW_e a = Σ_r w_r · (u_rᵀ H v_r)``: ``R·(d1 + d2 + d_out)`` parameters;
* its firing score uses the input factors only:
  ``s_e(a) = ‖(u_rᵀ H v_r)_r‖₂ / (‖H‖_F · max_r ‖u_r‖‖v_r‖)`` (in ``[0, √R]``; at most 1
  when the rank-one terms ``u_r ⊗ v_r`` are orthonormal); it fires when ``s_e ≥ θ``;
* training adds hinge terms ``max(0, β − s_e(a_edit))`` and ``mean max(0, s_e(a_neg) − α)``
  to the cross-entropy, ``θ = (α + β)/2`` (T-Patcher/WISE-style margins);
* [I, ours] the input factors start as the top-R singular pairs of the edit's mean ``H``
  (so the edit scores high on itself from the first step), the output factors at 0 (the
  edit starts silent).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moelab.errors import InvalidValueError
from moelab.methods.editing.layer import EditBank

EPS = 1e-12


def square_factors(d_in: int) -> tuple[int, int]:
    """The most square ``(d1, d2)`` with ``d1 ≤ d2`` and ``d1·d2 = d_in`` (1536 → 32 × 48)."""
    d1 = max(d for d in range(1, int(d_in**0.5) + 1) if d_in % d == 0)
    return d1, d_in // d1


def cp_parameter_count(rank: int, dims: tuple[int, ...]) -> int:
    """Parameters of a rank-``rank`` CP tensor with factor sizes ``dims``: ``R·Σ dims``."""
    return rank * sum(dims)


def cp_responses(a: Tensor, u: Tensor, v: Tensor) -> Tensor:
    """``u_rᵀ H v_r`` for inputs ``a [N, d1·d2]`` and factors ``u [..., R, d1]``,
    ``v [..., R, d2]`` → ``[N, ..., R]`` fp32 (``H`` is ``a`` reshaped row-major).

    Two matmul-shaped steps, ``H V^T`` then a contraction with ``U`` over ``d1``
    (``N·d1·d2·|..R|`` multiply-adds), never the rank-one tensors themselves."""
    d1, d2 = u.shape[-1], v.shape[-1]
    lead = u.shape[:-1]
    h = a.float().reshape(-1, d1, d2)
    hv = h @ v.float().reshape(-1, d2).T  # [N, d1, ..R]
    return (hv * u.float().reshape(-1, d1).T).sum(1).reshape(-1, *lead)


def cp_scores(a: Tensor, u: Tensor, v: Tensor) -> Tensor:
    """TIME's intrinsic firing score (see the module docstring) of ``a [N, d_in]`` against
    factors ``u [..., R, d1]``, ``v [..., R, d2]`` → ``[N, ...]`` fp32."""
    resp = cp_responses(a, u, v)
    scale = (u.float().norm(dim=-1) * v.float().norm(dim=-1)).amax(-1)  # [...]
    return resp.norm(dim=-1) / (
        a.float().norm(dim=-1).reshape(-1, *[1] * scale.dim()) * scale + EPS
    )


class CPEditBank(EditBank):
    """Frozen CP edits (buffers ``u [E, R, d1]``, ``v [E, R, d2]``, ``w [E, R, d_out]``),
    all with threshold ``threshold``, plus one pending edit while training.

    Raises:
        InvalidValueError: ``d1·d2 != d_in`` or ``rank > min(d1, d2)``.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        rank: int,
        factor_shape: tuple[int, int] | None,
        threshold: float,
    ) -> None:
        super().__init__()
        d1, d2 = factor_shape if factor_shape is not None else square_factors(d_in)
        if d1 * d2 != d_in:
            raise InvalidValueError(f"factor_shape: {d1} × {d2} != the layer's d_in {d_in}")
        if rank > min(d1, d2):
            raise InvalidValueError(f"rank: {rank} exceeds min(d1, d2) = {min(d1, d2)}")
        self.rank, self.dims, self.threshold = rank, (d1, d2, d_out), threshold
        self.params_per_edit = cp_parameter_count(rank, self.dims)
        self.register_buffer("u", torch.zeros(0, rank, d1))
        self.register_buffer("v", torch.zeros(0, rank, d2))
        self.register_buffer("w", torch.zeros(0, rank, d_out))
        self.pending: nn.ParameterDict | None = None

    @property
    def num_edits(self) -> int:
        return self.u.shape[0]

    def scores(self, a: Tensor) -> Tensor:
        return cp_scores(a, self.u, self.v)

    def thresholds(self) -> Tensor:
        return torch.full((self.num_edits,), self.threshold, device=self.u.device)

    def outputs(self, a: Tensor, base: Tensor, idx: Tensor) -> Tensor:
        d1, d2, _ = self.dims
        h = a.float().reshape(-1, d1, d2)
        hv = torch.bmm(h, self.v[idx].float().transpose(1, 2))  # [n, d1, R]
        resp = (hv * self.u[idx].float().transpose(1, 2)).sum(1)  # [n, R]
        return base + torch.bmm(resp[:, None], self.w[idx].float())[:, 0]

    def start(self, a: Tensor, layer: nn.Linear) -> list[nn.Parameter]:
        d1, d2, d_out = self.dims
        h = a.float().mean(0).reshape(d1, d2)
        left, _, right = torch.linalg.svd(h, full_matrices=False)
        self.pending = nn.ParameterDict(
            {
                "u": nn.Parameter(left[:, : self.rank].T.contiguous()),
                "v": nn.Parameter(right[: self.rank].contiguous()),
                "w": nn.Parameter(torch.zeros(self.rank, d_out)),
            }
        )
        return list(self.pending.values())

    def pending_scores(self, a: Tensor) -> Tensor:
        """The pending edit's scores ``[N]`` (differentiable: the margin losses train them)."""
        return cp_scores(a, self.pending["u"], self.pending["v"])

    def pending_outputs(self, a: Tensor, base: Tensor) -> Tensor:
        resp = cp_responses(a, self.pending["u"], self.pending["v"])
        return base + resp @ self.pending["w"]

    def commit(self) -> None:
        self._append(**{k: p for k, p in self.pending.items()})
        self.pending = None
