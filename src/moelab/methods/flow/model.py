"""MoLF's stage 2: conditional flow matching in the frozen VAE's latent space.

As the authors' ``LatentFlow_CFG.forward`` runs (``wave3-science.md`` §3.2, §3.4):

1. ``z1 = μ + σ·ε`` from the frozen VAE (or the data itself, for the toy); noise ``z0`` scaled
   per slide by the standard deviation of that slide's ``z1`` (the toy: ``N(0, I)``);
   one ``t ~ U(0, 1)`` per slide; ``x_t = (1 − t)·z0 + t·z1`` plus N(0, 0.001²) noise
   (:mod:`moelab.methods.flow.path`).
2. Classifier-free-guidance dropout: with probability ``cfg_dropout`` a slide's whole view
   is replaced by a learned unconditional embedding; the tissue code is always kept.
3. The velocity field sees ``LN([x_t, t, view, tissue one-hot])`` per cell.
4. Loss: ``MSE(v, z1 − z0)`` + the MoE's balance loss + ``gene_loss_weight`` × the one-step
   reconstruction ``MSE(decode(x_t + (1 − t)·v), genes)`` (the toy: ``MSE(x_t + (1 − t)·v,
   z1)``), where ``x_t`` is taken before the small noise, as in the authors' code.

Sampling integrates from ``N(0, I)`` with :func:`~moelab.methods.flow.sampler.euler_sample`
and CFG, then decodes. This project's differences: the tissue code is concatenated to the view
rather than fused by the authors' cross-attention (a query of one image token attending to one
oncotree token), and there is no spatial Transformer over patch order (pseudo-slides have no
order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moelab.core.telemetry import RoutingRecord
from moelab.methods.flow.path import ot_path, slide_scaled_noise
from moelab.methods.flow.sampler import Sample, euler_sample
from moelab.methods.flow.vae import GeneVAE
from moelab.methods.flow.velocity import FieldOutput

PATH_NOISE_STD = 1e-3  # the authors' ``noise_std`` on x_t


class LatentFlow(nn.Module):
    """A conditional latent flow model around a velocity field.

    Args:
        field: ``h [B, P, D] → FieldOutput`` with ``D = in_size(...)``.
        latent_size: L.
        view_size: V, the condition's width.
        num_tissues: K, the tissue codes (0: none, as in the toy).
        vae: the frozen stage-1 VAE (None: the flow models the data directly).
        cfg_dropout: probability of dropping a slide's view in training.
        scale_noise: scale each slide's training noise by its latents' std.
        gene_loss_weight: weight of the one-step reconstruction loss.
    """

    def __init__(
        self,
        field: nn.Module,
        *,
        latent_size: int,
        view_size: int,
        num_tissues: int,
        vae: GeneVAE | None = None,
        cfg_dropout: float = 0.1,
        scale_noise: bool = True,
        gene_loss_weight: float = 1.0,
    ) -> None:
        super().__init__()
        self.field = field
        self.vae = vae
        self.latent_size = latent_size
        self.num_tissues = num_tissues
        self.cfg_dropout = cfg_dropout
        self.scale_noise = scale_noise
        self.gene_loss_weight = gene_loss_weight
        self.unconditional = nn.Parameter(torch.randn(view_size))  # the authors' init
        self.input_norm = nn.LayerNorm(self.in_size(latent_size, view_size, num_tissues))

    @staticmethod
    def in_size(latent_size: int, view_size: int, num_tissues: int) -> int:
        """D, the velocity field's input width: ``L + 1 + V + K``."""
        return latent_size + 1 + view_size + num_tissues

    def predict(
        self, z_t: Tensor, t: Tensor, view: Tensor, tissue: Tensor | None, keep_view: Tensor
    ) -> FieldOutput:
        """The velocity at ``z_t [B, P, L]``, times ``t [B]``, condition ``view [B, P, V]``
        and ``tissue [B]`` int64 (None when K = 0); slides with ``keep_view [B]`` False get
        the unconditional embedding instead of their view."""
        B, P, _ = z_t.shape
        view = torch.where(keep_view.reshape(B, 1, 1), view, self.unconditional.expand_as(view))
        parts = [z_t, t.reshape(B, 1, 1).expand(B, P, 1).to(z_t.dtype), view]
        if self.num_tissues:
            code = F.one_hot(tissue, self.num_tissues).to(z_t.dtype)
            parts.append(code[:, None, :].expand(B, P, self.num_tissues))
        return self.field(self.input_norm(torch.cat(parts, dim=-1)))

    def loss(
        self, x1: Tensor, view: Tensor, tissue: Tensor | None, generator: torch.Generator
    ) -> tuple[Tensor, dict[str, float]]:
        """Training loss of slides ``x1 [B, P, G]`` (genes; the toy: points ``[B, P, L]``).

        Returns:
            ``(total, parts)`` with parts ``flow``, ``recon`` and the field's aux losses.
        """
        B = x1.shape[0]
        z1 = x1 if self.vae is None else self.vae.sample_latent(x1, generator)
        if self.scale_noise:
            z0 = slide_scaled_noise(z1, generator)
        else:
            z0 = torch.randn(z1.shape, generator=generator)
        t = torch.rand(B, generator=generator)
        x_t, u = ot_path(z0, z1, t)
        noisy = x_t + PATH_NOISE_STD * torch.randn(x_t.shape, generator=generator)
        keep = torch.rand(B, generator=generator) >= self.cfg_dropout
        out = self.predict(noisy, t, view, tissue, keep)
        flow = F.mse_loss(out.velocity, u)
        z1_hat = x_t + (1 - t).reshape(B, 1, 1) * out.velocity
        if self.vae is None:
            recon = F.mse_loss(z1_hat, z1)
        else:
            recon = F.mse_loss(self.vae.decode(z1_hat), x1)
        total = flow + self.gene_loss_weight * recon
        parts = {"flow": flow.item(), "recon": recon.item()}
        for name, value in out.aux_losses.items():
            total = total + value
            parts[name] = value.item()
        return total, parts

    @torch.no_grad()
    def sample(
        self,
        view: Tensor,
        tissue: Tensor | None,
        *,
        steps: int,
        guidance: float,
        generator: torch.Generator,
    ) -> tuple[Sample, list[RoutingRecord]]:
        """Latents of slides ``view [B, P, V]``: Euler with CFG from ``N(0, I)`` (drawn with
        ``generator``), in eval mode.

        Returns:
            ``(sample, records)``: ``sample.x`` ``[B, P, L]``; the routing records of the
            conditional evaluations (MoE fields; empty otherwise).
        """
        self.eval()
        B, P, _ = view.shape
        x0 = torch.randn(B, P, self.latent_size, generator=generator)
        records: list[RoutingRecord] = []
        keep = torch.ones(B, dtype=torch.bool)

        def velocity(x: Tensor, t: float, conditional: bool) -> Tensor:
            out = self.predict(x, torch.full((B,), t), view, tissue, keep if conditional else ~keep)
            if conditional and out.record is not None:
                records.append(out.record)
            return out.velocity

        return euler_sample(velocity, x0, steps, guidance), records

    def decode(self, z: Tensor) -> Tensor:
        """Expression of latents (identity without a VAE)."""
        return z if self.vae is None else self.vae.decode(z)
