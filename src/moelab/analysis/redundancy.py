"""Expert redundancy: mean pairwise cosine similarity of different experts' outputs.

Comparing experts by the similarity of their outputs on the same inputs is how output-based
expert merging and pruning find redundant experts (e.g. HC-SMoE, Chen et al., "Retraining-Free
Merging of Sparse MoE via Hierarchical Clustering", 2024, arXiv:2410.08589, which clusters
experts by their outputs). The exact statistic here (token-wise cosine, averaged over tokens and
over unordered expert pairs) is this project's definition.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moelab.analysis._common import to_list


@dataclass(frozen=True)
class Redundancy:
    """Attributes:
    similarity: ``[E, E]`` float64 ``S[i, j] = mean_t cos(y_it, y_jt)``; diagonal 1.
    mean_pairwise: mean of ``S[i, j]`` over the ``E(E-1)/2`` pairs ``i < j``, in ``[-1, 1]``.
    """

    similarity: Tensor
    mean_pairwise: float

    def to_dict(self) -> dict:
        return {"similarity": to_list(self.similarity), "mean_pairwise": self.mean_pairwise}


def expert_redundancy(outputs_ETD: Tensor, eps: float = 1e-12) -> Redundancy:
    """Mean pairwise cosine similarity between experts' outputs on the same tokens.

    ``S[i, j] = (1/T) Σ_t <y_it, y_jt> / (max(‖y_it‖, eps) · max(‖y_jt‖, eps))`` and
    ``mean_pairwise = 2 / (E(E-1)) Σ_{i<j} S[i, j]``. Identical experts give 1, experts with
    orthogonal outputs 0. A zero output vector has cosine 0 with everything.

    Args:
        outputs_ETD: ``[E, T, D]`` every expert's output for the same T tokens (the caller runs
            every expert on every token).

    Raises:
        ValueError: when the tensor is not 3-D, E < 2 or T = 0.
    """
    if outputs_ETD.dim() != 3:
        raise ValueError(f"outputs_ETD must be [E, T, D], got {tuple(outputs_ETD.shape)}")
    E, T, _ = outputs_ETD.shape
    if E < 2:
        raise ValueError(f"expert redundancy needs E >= 2 experts, got E={E}")
    if T == 0:
        raise ValueError("outputs_ETD has no token (T=0)")
    y = outputs_ETD.detach().double().cpu()
    y = y / y.norm(dim=-1, keepdim=True).clamp_min(eps)
    S = torch.einsum("itd,jtd->ij", y, y) / T
    iu = torch.triu_indices(E, E, offset=1)
    mean = float(S[iu[0], iu[1]].mean())
    S.fill_diagonal_(1.0)
    return Redundancy(similarity=S, mean_pairwise=mean)
