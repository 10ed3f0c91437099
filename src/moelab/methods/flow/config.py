"""The MoLF recipe's settings: one dataclass for the data, the model arms and the training."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moelab.errors import require
from moelab.utils.fields import check_fields

Task = Literal["expression", "toy"]
Variant = Literal["shared", "conflict"]
Velocity = Literal["moe", "dense", "attention", "simplemlp"]


@dataclass(frozen=True)
class FlowConfig:
    """One MoLF run (defaults: this project's CPU-sized MoLF-lite, ``wave3-science.md`` §3.4;
    the authors' values are in the comments).

    Data (``task="expression"``):
        data_path: a user ``.h5ad``/``.csv`` file (None: scanpy's ``pbmc68k_reduced``).
        tissue_key: ``obs`` column of the tissue (``"lineage"``: the 4 PBMC lineage groups).
        slide_key: ``obs`` column of real slide ids (None: pseudo-slides per tissue).
        view_key: ``obsm`` matrix used as the condition (None: PCA of the non-target genes).
        use_raw: read ``raw.X`` of an ``.h5ad`` file (pbmc68k_reduced: always).
        variant: ``"shared"`` view, or ``"conflict"`` (a tissue-specific rotation of it).
        n_genes, view_size, slide_size, test_fraction: see
            :func:`moelab.data.singlecell.build_slides`.

    Model:
        velocity: the arm: ``"moe"`` (MoLF), ``"dense"`` (matched active parameters),
            ``"attention"`` (the authors' attention-across-cells head) or ``"simplemlp"``
            (the authors' regression baseline, no flow).
        num_experts, top_k: 6 and 2 (authors).
        aux_loss_coeff: Switch balance-loss weight, transformers' convention (authors: 1.0;
            0 = the "no balance loss" arm).
        logit_noise_std: router logit noise in training (authors: 0.01).
        model_size, ffn_size: expert block width H and feed-forward width F (authors: 256,
            2048).
        attention_heads: heads of the attention head (authors: 4).
        dropout: in the expert blocks and the attention head (authors: 0.1).
        mlp_size: hidden width of SimpleMLP's two layers.
        latent_size, vae_hidden: VAE latent (authors: 128) and width (authors: 512).

    Training:
        vae_steps, vae_batch, vae_kl, vae_mask: VAE stage (authors: KL 1e-7, 15 % masking).
        flow_steps, batch_slides: stage 2 optimizer steps and slides per step (authors: 1).
        lr, router_lr: AdamW learning rates (authors: 5e-5 and 1e-5 for the gate).
        weight_decay, warmup_fraction, grad_clip: 0.01, 0.05 (linear warm-up, then linear
            decay to 0), 1.0 (authors).
        cfg_dropout: probability of replacing a slide's view by the learned unconditional
            embedding (authors: 0.1).
        gene_loss_weight: one-step gene reconstruction loss (authors: 1.0).
        guidance: CFG scale w at sampling; ``guidance_sweep`` other scales to report.
        euler_steps: sampling steps (the authors' released default: 2).

    Toy (``task="toy"``):
        toy_batch, toy_samples, toy_eval_steps: points per step, samples evaluated, Euler
            step counts evaluated (``flow_steps`` steps of training).

    Raises (construction):
        InvalidValueError: a field of the wrong type or out of range (named).
    """

    task: Task = "expression"
    data_path: str | None = None
    tissue_key: str = "lineage"
    slide_key: str | None = None
    view_key: str | None = None
    use_raw: bool = False
    variant: Variant = "shared"
    n_genes: int = 50
    view_size: int = 32
    slide_size: int = 20
    test_fraction: float = 0.25
    velocity: Velocity = "moe"
    num_experts: int = 6
    top_k: int = 2
    aux_loss_coeff: float = 1.0
    logit_noise_std: float = 0.01
    model_size: int = 64
    ffn_size: int = 512
    attention_heads: int = 4
    dropout: float = 0.1
    mlp_size: int = 256
    latent_size: int = 8
    vae_hidden: int = 64
    vae_steps: int = 1500
    vae_batch: int = 64
    vae_kl: float = 1e-7
    vae_mask: float = 0.15
    flow_steps: int = 3000
    batch_slides: int = 4
    lr: float = 1e-3
    router_lr: float = 2e-4
    weight_decay: float = 0.01
    warmup_fraction: float = 0.05
    grad_clip: float = 1.0
    cfg_dropout: float = 0.1
    gene_loss_weight: float = 1.0
    guidance: float = 2.0
    guidance_sweep: tuple[float, ...] = (1.0, 3.0)
    euler_steps: int = 2
    toy_batch: int = 256
    toy_samples: int = 2000
    toy_eval_steps: tuple[int, ...] = (2, 8)

    def __post_init__(self) -> None:
        check_fields(self)
        for name in (
            "n_genes",
            "view_size",
            "num_experts",
            "model_size",
            "ffn_size",
            "attention_heads",
            "mlp_size",
            "latent_size",
            "vae_hidden",
            "vae_batch",
            "batch_slides",
            "euler_steps",
            "toy_batch",
            "toy_samples",
        ):
            require(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("vae_steps", "flow_steps"):
            require(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        require(
            1 <= self.top_k <= self.num_experts,
            "top_k",
            f"must be in [1, num_experts={self.num_experts}], got {self.top_k}",
        )
        require(
            self.model_size % self.attention_heads == 0,
            "attention_heads",
            f"must divide model_size={self.model_size}, got {self.attention_heads}",
        )
        for name in ("dropout", "cfg_dropout", "vae_mask", "warmup_fraction"):
            v = getattr(self, name)
            require(0.0 <= v < 1.0, name, f"must be in [0, 1), got {v}")
        for name in (
            "aux_loss_coeff",
            "logit_noise_std",
            "vae_kl",
            "weight_decay",
            "gene_loss_weight",
            "guidance",
        ):
            require(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        for name in ("lr", "router_lr", "grad_clip"):
            require(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        require(
            all(isinstance(w, (int, float)) and w >= 0 for w in self.guidance_sweep),
            "guidance_sweep",
            f"must be numbers >= 0, got {self.guidance_sweep!r}",
        )
        require(
            len(self.toy_eval_steps) > 0
            and all(isinstance(s, int) and s >= 1 for s in self.toy_eval_steps),
            "toy_eval_steps",
            f"must be ints >= 1, got {self.toy_eval_steps!r}",
        )
        require(
            self.task != "toy" or self.velocity in ("moe", "dense"),
            "velocity",
            f"the toy runs the 'moe' and 'dense' arms, got {self.velocity!r}",
        )
