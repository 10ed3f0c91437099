"""MoLF's stage 1: a gene VAE whose latent space the flow is trained in, then frozen.

As the authors' code runs it (``GeneTransformerAutoencoder`` and ``gene_autoencoder_train.py``,
``wave3-science.md`` §3.2): the latent mean goes through a LayerNorm; the decoder is
``Linear → LN → GELU → Linear(2×) → LN → GELU → Linear → GELU``; training adds N(0, 0.1²)
noise to the sampled latent, zeroes 15 % of the input genes at random (denoising), and
minimises ``MSE(recon, genes) + β·KL`` with β = 1e-7; AdamW, linear warm-up (5 %) and decay,
gradient clipping at 1.0. This project's difference: the encoder is an MLP over one cell
(``Linear → LN → GELU → Linear``) instead of a Transformer over a slide's patches with
positional encoding over patch order (cells of a pseudo-slide have no order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moelab.methods.flow.loop import train_steps

_TRAIN_LATENT_NOISE = 0.1  # the authors' GeneTransformerAutoencoder.forward


class GeneVAE(nn.Module):
    """Cells' expression ``[..., G]`` ↔ latents ``[..., L]``.

    Args:
        n_genes: G.
        hidden: encoder width H (the decoder's widths are H and 2H).
        latent: L.
    """

    def __init__(self, n_genes: int, hidden: int, latent: int) -> None:
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Linear(n_genes, hidden),
            nn.LayerNorm(hidden),
            nn.GELU(),
            nn.Linear(hidden, 2 * latent),
        )
        self.mean_norm = nn.LayerNorm(latent)
        self.decoder = nn.Sequential(
            nn.Linear(latent, hidden),
            nn.LayerNorm(hidden),
            nn.GELU(),
            nn.Linear(hidden, 2 * hidden),
            nn.LayerNorm(2 * hidden),
            nn.GELU(),
            nn.Linear(2 * hidden, n_genes),
            nn.GELU(),
        )
        self.latent_size = latent

    def encode(self, genes: Tensor) -> tuple[Tensor, Tensor]:
        """``(mean, log-variance)``, each ``[..., L]``."""
        mean, logvar = self.encoder(genes).chunk(2, dim=-1)
        return self.mean_norm(mean), logvar

    def decode(self, z: Tensor) -> Tensor:
        """``[..., G]`` expression of latents ``z [..., L]``."""
        return self.decoder(z)

    def sample_latent(self, genes: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """``mean + σ·ε`` (the reparameterised latent the flow is trained to reach)."""
        mean, logvar = self.encode(genes)
        eps = torch.randn(mean.shape, generator=generator, dtype=mean.dtype, device=mean.device)
        return mean + torch.exp(0.5 * logvar) * eps


def kl_to_standard_normal(mean: Tensor, logvar: Tensor) -> Tensor:
    """``KL(N(mean, e^logvar) || N(0, I))`` summed over the latent, averaged over the rest:
    ``−½ Σ (1 + logvar − mean² − e^logvar)`` (Kingma & Welling, arXiv 1312.6114, App. B)."""
    return (-0.5 * (1 + logvar - mean.pow(2) - logvar.exp()).sum(-1)).mean()


def vae_loss(
    vae: GeneVAE, genes: Tensor, *, kl_weight: float, mask_prob: float, generator: torch.Generator
) -> Tensor:
    """One training loss: genes masked with probability ``mask_prob`` (set to 0), a latent
    sampled with extra N(0, 0.1²) noise, ``MSE(decode, unmasked genes) + kl_weight · KL``."""
    keep = torch.rand(genes.shape, generator=generator) >= mask_prob
    mean, logvar = vae.encode(genes * keep)
    eps = torch.randn(mean.shape, generator=generator)
    z = mean + torch.exp(0.5 * logvar) * eps
    z = z + _TRAIN_LATENT_NOISE * torch.randn(z.shape, generator=generator)
    return F.mse_loss(vae.decode(z), genes) + kl_weight * kl_to_standard_normal(mean, logvar)


def train_vae(
    genes: Tensor,
    *,
    hidden: int,
    latent: int,
    steps: int,
    batch: int,
    lr: float,
    weight_decay: float,
    kl_weight: float,
    mask_prob: float,
    generator: torch.Generator,
) -> GeneVAE:
    """Train a :class:`GeneVAE` on cells ``genes [N, G]`` (minibatches of ``batch`` cells drawn
    with ``generator``) and return it frozen (``requires_grad=False``, eval mode)."""
    vae = GeneVAE(genes.shape[1], hidden, latent)
    n = genes.shape[0]

    def loss(_: int) -> Tensor:
        rows = torch.randint(0, n, (min(batch, n),), generator=generator)
        return vae_loss(
            vae, genes[rows], kl_weight=kl_weight, mask_prob=mask_prob, generator=generator
        )

    train_steps(vae, loss, steps=steps, lr=lr, weight_decay=weight_decay)
    vae.requires_grad_(False)
    return vae.eval()
