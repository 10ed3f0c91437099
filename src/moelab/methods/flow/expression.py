"""Train and evaluate one arm on slides of cells (``task="expression"``).

:func:`train_expression` builds the slides (:func:`moelab.data.singlecell.build_slides`),
trains the VAE (stage 1, frozen) and the arm: a :class:`~moelab.methods.flow.model.LatentFlow`
around the MoE, dense or attention velocity field, or the SimpleMLP regressor (no VAE, no
flow). :func:`predict` samples a slide set; :func:`evaluate_expression` gives the metrics.

Randomness, all derived from ``seed`` so that arms of one seed are paired: the slide split
and rotations (NumPy), the VAE (its own generator and init seed: every flow arm of a seed gets
the same VAE), the training batches and flow noise (one generator; every flow arm draws the
same), the model init and dropout (``torch.manual_seed``), and the sampling noise at
evaluation (one generator, reset for every guidance scale).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from moelab.data.expression import ExpressionTable, load_expression
from moelab.data.singlecell import SlideData, Slides, build_slides, load_pbmc68k_reduced
from moelab.methods.flow.config import FlowConfig
from moelab.methods.flow.loop import train_flow_steps
from moelab.methods.flow.metrics import majority_share, routing_purity, slide_pearson
from moelab.methods.flow.model import LatentFlow
from moelab.methods.flow.simplemlp import SimpleMLP, condition_features
from moelab.methods.flow.vae import GeneVAE, train_vae
from moelab.methods.flow.velocity import (
    AttentionVelocity,
    DenseVelocity,
    MoEVelocity,
    matched_ffn_size,
)

# offsets of the per-purpose seeds (any distinct constants)
_VAE, _FLOW, _SAMPLE, _INIT = 1, 2, 3, 4


def _generator(seed: int, purpose: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 16 + purpose)


@dataclass
class ExpressionRun:
    """A trained arm: its config and seed, its slides, the VAE (None for SimpleMLP) and the
    model (a :class:`LatentFlow` or a :class:`SimpleMLP`)."""

    config: FlowConfig
    seed: int
    data: SlideData
    vae: GeneVAE | None
    model: nn.Module


def load_table(config: FlowConfig) -> ExpressionTable:
    """The configured expression table (``data_path``, or scanpy's ``pbmc68k_reduced``)."""
    if config.data_path is None:
        return load_pbmc68k_reduced()
    return load_expression(config.data_path, use_raw=config.use_raw)


def make_slides(table: ExpressionTable, config: FlowConfig, seed: int) -> SlideData:
    """The slides of ``config`` (same split for both variants of one seed)."""
    return build_slides(
        table,
        tissue_key=config.tissue_key,
        slide_key=config.slide_key,
        view_key=config.view_key,
        n_genes=config.n_genes,
        view_size=config.view_size,
        slide_size=config.slide_size,
        test_fraction=config.test_fraction,
        conflict=config.variant == "conflict",
        seed=seed,
    )


def fit_vae(data: SlideData, config: FlowConfig, seed: int) -> GeneVAE:
    """Stage 1 on the training slides' cells."""
    genes = torch.from_numpy(data.train.genes.reshape(-1, data.train.genes.shape[-1]))
    with torch.random.fork_rng():
        torch.manual_seed(seed * 16 + _VAE)
        return train_vae(
            genes,
            hidden=config.vae_hidden,
            latent=config.latent_size,
            steps=config.vae_steps,
            batch=config.vae_batch,
            lr=config.lr,
            weight_decay=config.weight_decay,
            kl_weight=config.vae_kl,
            mask_prob=config.vae_mask,
            generator=_generator(seed, _VAE),
        )


def build_field(config: FlowConfig, in_size: int, out_size: int) -> nn.Module:
    """The velocity field of ``config.velocity`` (not ``"simplemlp"``)."""
    H, Fh, p = config.model_size, config.ffn_size, config.dropout
    if config.velocity == "moe":
        return MoEVelocity(
            in_size,
            out_size,
            num_experts=config.num_experts,
            top_k=config.top_k,
            model_size=H,
            ffn_size=Fh,
            dropout=p,
            logit_noise_std=config.logit_noise_std,
            aux_loss_coeff=config.aux_loss_coeff,
        )
    if config.velocity == "dense":
        ffn = matched_ffn_size(in_size, H, Fh, config.num_experts, config.top_k)
        return DenseVelocity(in_size, out_size, model_size=H, ffn_size=ffn, dropout=p)
    return AttentionVelocity(
        in_size, out_size, model_size=H, heads=config.attention_heads, dropout=p
    )


def build_model(config: FlowConfig, data: SlideData, vae: GeneVAE | None) -> nn.Module:
    """The untrained arm for ``data``'s shapes: a :class:`SimpleMLP`, or a
    :class:`LatentFlow` around ``vae`` (required then) and the configured velocity field."""
    K, G, V = len(data.tissues), data.train.genes.shape[-1], data.train.view.shape[-1]
    if config.velocity == "simplemlp":
        return SimpleMLP(V + K, config.mlp_size, G)
    L = config.latent_size
    return LatentFlow(
        build_field(config, LatentFlow.in_size(L, V, K), L),
        latent_size=L,
        view_size=V,
        num_tissues=K,
        vae=vae,
        cfg_dropout=config.cfg_dropout,
        gene_loss_weight=config.gene_loss_weight,
    )


def _tensors(slides: Slides, rows: torch.Tensor | slice) -> tuple[torch.Tensor, ...]:
    genes = torch.from_numpy(slides.genes)[rows]
    view = torch.from_numpy(slides.view)[rows]
    tissue = torch.from_numpy(slides.tissue)[rows]
    return genes, view, tissue


def train_expression(
    config: FlowConfig,
    seed: int,
    *,
    table: ExpressionTable | None = None,
    data: SlideData | None = None,
    vae: GeneVAE | None = None,
) -> ExpressionRun:
    """Train one arm; ``table``, ``data`` and ``vae`` may be passed in to reuse them (they
    must be what ``config`` and ``seed`` would make).

    Raises:
        CorpusNotInstalledError, MissingDependencyError, CorpusError: the data cannot be read.
        InvalidValueError: the data cannot make slides with these settings.
        TrainingDivergedError: a NaN/Inf loss.
    """
    if data is None:
        data = make_slides(table if table is not None else load_table(config), config, seed)
    K, S = len(data.tissues), data.train.num_slides
    gen = _generator(seed, _FLOW)
    torch.manual_seed(seed * 16 + _INIT)

    def batch() -> tuple[torch.Tensor, ...]:
        return _tensors(data.train, torch.randint(0, S, (config.batch_slides,), generator=gen))

    if config.velocity != "simplemlp" and vae is None:
        vae = fit_vae(data, config, seed)
    model = build_model(config, data, vae)
    if isinstance(model, SimpleMLP):

        def loss(_: int) -> torch.Tensor:
            genes, view, tissue = batch()
            return F.mse_loss(model(condition_features(view, tissue, K)), genes)

    else:

        def loss(_: int) -> torch.Tensor:
            genes, view, tissue = batch()
            return model.loss(genes, view, tissue, gen)[0]

    train_flow_steps(model, loss, config)
    return ExpressionRun(config, seed, data, vae, model)


@torch.no_grad()
def predict(
    run: ExpressionRun, slides: Slides, *, guidance: float | None = None
) -> tuple[np.ndarray, list]:
    """Predicted expression ``[S, P, G]`` float32 of ``slides`` and the routing records of the
    sampling (MoE arms; empty otherwise). Flow arms sample ``config.euler_steps`` Euler steps
    with CFG scale ``guidance`` (default ``config.guidance``) from noise drawn with the run's
    sampling generator (the same for every arm and scale of one seed)."""
    _, view, tissue = _tensors(slides, slice(None))
    K = len(run.data.tissues)
    run.model.eval()
    if isinstance(run.model, SimpleMLP):
        return run.model(condition_features(view, tissue, K)).numpy(), []
    w = run.config.guidance if guidance is None else guidance
    sample, records = run.model.sample(
        view,
        tissue,
        steps=run.config.euler_steps,
        guidance=w,
        generator=_generator(run.seed, _SAMPLE),
    )
    return run.model.decode(sample.x).numpy(), records


def _metric_name(text: str) -> str:
    return re.sub(r"[^0-9A-Za-z]+", "_", text).strip("_")


def _pearsons(pred: np.ndarray, slides: Slides) -> np.ndarray:
    return np.array([slide_pearson(pred[s], slides.genes[s]) for s in range(slides.num_slides)])


def evaluate_expression(run: ExpressionRun) -> dict[str, float]:
    """Metrics on the held-out slides.

    Returns:
        ``pearson`` (mean per-gene Pearson over the slides), ``pearson/tissue/<name>``,
        ``pearson/slide/<i>`` (paired per-slide values), for flow arms ``pearson_w<w>`` for
        every scale of ``guidance_sweep``, and for MoE arms ``routing_purity`` (top-1 expert
        against tissue over every conditional evaluation), ``routing_purity_chance`` and
        ``load_imbalance`` (max/mean expert load, mean over the evaluations).
    """
    test = run.data.test
    pred, records = predict(run, test)
    per_slide = _pearsons(pred, test)
    out = {"pearson": float(per_slide.mean())}
    for k, name in enumerate(run.data.tissues):
        mask = test.tissue == k
        if mask.any():
            out[f"pearson/tissue/{_metric_name(name)}"] = float(per_slide[mask].mean())
    for s, r in enumerate(per_slide):
        out[f"pearson/slide/{s:02d}"] = float(r)
    if run.vae is not None:
        for w in run.config.guidance_sweep:
            out[f"pearson_w{w:g}"] = float(
                _pearsons(predict(run, test, guidance=w)[0], test).mean()
            )
    if records:
        labels = np.repeat(test.tissue, test.genes.shape[1])
        experts = np.concatenate([r.top1.numpy() for r in records])
        out["routing_purity"] = routing_purity(experts, np.tile(labels, len(records)))
        out["routing_purity_chance"] = majority_share(labels)
        out["load_imbalance"] = float(np.mean([r.load_imbalance for r in records]))
    return out
