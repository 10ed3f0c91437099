"""Gaussian classifier alignment (SLCA, Zhang et al., ICCV 2023, arXiv 2303.05118; as CaRE's
``models/care.py::classifer_align`` runs it [C]).

Per class a mean and full covariance of its features (+1e-4·I) are stored once, when the
class is learned (:meth:`ClassGaussians.fit`). Alignment then trains the classifier head
alone on features sampled from those Gaussians: each epoch draws ``5 · batch_size`` samples
per seen class, shuffles them and takes one SGD step (``ca_lr``, momentum 0.9, weight decay
5e-4, cosine schedule with ``T_max = 5`` whatever the number of epochs [C]) per class-sized
slice, on ``CE(scale · cos)`` over every seen class.

The mean "decay" [C], on in the authors' long-sequence configs: class ``c``'s mean is scaled
by ``0.9 + 0.1 (t_id + 1) / (T + 1)`` with ``t_id = c // (known - total)``, ``T`` the current
task. ``known - total`` is minus the task size, so Python's floor division gives ``t_id = 0``
for class 0 and ``-ceil(c / inc)`` after it: multipliers from about 0.9 (oldest) down to about
0.8 (newest). Reproduced as written.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moelab.errors import InvalidValueError


class ClassGaussians:
    """Per-class feature means ``[D]`` and Cholesky factors of the covariances ``[D, D]``."""

    def __init__(self) -> None:
        self.means: dict[int, Tensor] = {}
        self.chols: dict[int, Tensor] = {}

    def fit(self, features: Tensor, labels: Tensor, classes: list[int]) -> None:
        """Store the mean and ``cov + 1e-4·I`` (``torch.cov``, unbiased) of each class.

        Raises:
            InvalidValueError: a class with fewer than 2 features.
        """
        for c in classes:
            f = features[labels == c].double()
            if f.shape[0] < 2:
                raise InvalidValueError(f"class {c}: needs >= 2 features for a covariance")
            cov = torch.cov(f.T) + 1e-4 * torch.eye(f.shape[1], dtype=f.dtype)
            self.means[c] = f.mean(0)
            self.chols[c] = torch.linalg.cholesky(cov)

    def sample(self, c: int, n: int, scale: float, generator: torch.Generator) -> Tensor:
        """``n`` draws ``[n, D]`` float32 of ``N(scale · mean_c, cov_c)``."""
        mean, chol = self.means[c], self.chols[c]
        z = torch.randn(n, mean.shape[0], generator=generator, dtype=torch.float64)
        return (mean * scale + z @ chol.T).float()

    def state(self) -> dict[str, Tensor]:
        out = {}
        for c in self.means:
            out[f"mean.{c}"] = self.means[c]
            out[f"chol.{c}"] = self.chols[c]
        return out

    def load(self, state: dict[str, Tensor]) -> None:
        self.means = {int(k[5:]): v for k, v in state.items() if k.startswith("mean.")}
        self.chols = {int(k[5:]): v for k, v in state.items() if k.startswith("chol.")}


def decay_factor(c: int, known: int, total: int, task: int) -> float:
    """The authors' mean multiplier ``0.9 + 0.1 (c // (known - total) + 1) / (task + 1)``."""
    t_id = c // (known - total)
    return 0.9 + (t_id + 1) / (task + 1) * 0.1


def align_classifier(
    head: nn.Module,
    gaussians: ClassGaussians,
    *,
    known: int,
    total: int,
    task: int,
    epochs: int,
    lr: float,
    scale: float,
    batch_size: int,
    decay: bool,
    generator: torch.Generator,
) -> None:
    """Train ``head`` (features ``[B, D]`` → cosines ``[B, total]``) on sampled features of
    classes ``0 .. total-1`` (procedure in the module docstring)."""
    params = [p for p in head.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5)
    per = batch_size * 5
    for _ in range(epochs):
        xs, ys = [], []
        for c in range(total):
            m = decay_factor(c, known, total, task) if decay else 1.0
            xs.append(gaussians.sample(c, per, m, generator))
            ys.append(torch.full((per,), c, dtype=torch.long))
        x, y = torch.cat(xs), torch.cat(ys)
        perm = torch.randperm(x.shape[0], generator=generator)
        x, y = x[perm], y[perm]
        for i in range(total):
            sl = slice(i * per, (i + 1) * per)
            loss = F.cross_entropy(scale * head(x[sl]), y[sl])
            opt.zero_grad()
            loss.backward()
            opt.step()
        sched.step()
