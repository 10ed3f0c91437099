"""The MoLF recipe end to end on a small synthetic table: arms through run_seeds (paired, one
VAE per seed), the toy, the flow model's loss parts, and ``moelab flow train|sample``."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from moelab.cli import app
from moelab.data.expression import ExpressionTable
from moelab.data.singlecell import build_slides
from moelab.methods.flow import FlowConfig, LatentFlow, MoLFRecipe
from moelab.methods.flow.metrics import slide_pearson
from moelab.methods.flow.vae import GeneVAE
from moelab.methods.flow.velocity import MoEVelocity
from moelab.methods.runner import run_seeds

TINY = dict(
    n_genes=6,
    view_size=4,
    slide_size=5,
    model_size=8,
    ffn_size=16,
    mlp_size=16,
    latent_size=3,
    vae_hidden=8,
    vae_steps=10,
    flow_steps=10,
    batch_slides=2,
    toy_batch=16,
    toy_samples=50,
    euler_steps=2,
)


def _table(n_per_tissue=40, genes=14, seed=0) -> ExpressionTable:
    rng = np.random.default_rng(seed)
    tissue = np.repeat(["t0", "t1"], n_per_tissue).astype(object)
    base = rng.normal(size=(2 * n_per_tissue, 3))
    X = np.abs(
        base @ rng.normal(size=(3, genes)) + 0.1 * rng.normal(size=(2 * n_per_tissue, genes))
    )
    return ExpressionTable(
        X.astype(np.float32), tuple(f"g{i}" for i in range(genes)), {"t": tissue}
    )


def test_arms_are_paired_and_share_one_vae_per_seed():
    recipe = MoLFRecipe(_table())
    base = FlowConfig(tissue_key="t", **TINY)
    arms = {
        "moe": {"velocity": "moe"},
        "dense": {"velocity": "dense"},
        "conflict_attention": {"velocity": "attention", "variant": "conflict"},
        "simplemlp": {"velocity": "simplemlp"},
        "toy_moe": {"task": "toy"},
    }
    result = run_seeds(recipe, base, [0, 1], arms=arms, pairs=[("moe", "dense")])
    m = result.metrics
    assert len(recipe._vaes) == 1  # the last seed's, shared by its three flow arms
    slides = [k for k in m["moe"][0] if k.startswith("pearson/slide/")]
    assert len(slides) == 4  # 8 slides per tissue, 2 held out each
    for arm in ("dense", "conflict_attention", "simplemlp"):
        assert [k for k in m[arm][0] if k.startswith("pearson/slide/")] == slides
    assert {"routing_purity", "routing_purity_chance", "load_imbalance"} <= set(m["moe"][0])
    assert "routing_purity" not in m["dense"][0] and "pearson_w3" not in m["simplemlp"][0]
    assert m["moe"][0]["routing_purity_chance"] == 0.5  # two tissues, equal slides
    assert set(m["toy_moe"][0]) == {"precision_2", "precision_8", "distance_2", "distance_8"}
    for arm in m:
        for value in m[arm][0].values():
            assert np.isfinite(value)
    assert m["moe"][0]["pearson"] == pytest.approx(np.mean([m["moe"][0][k] for k in slides]))


def test_loss_parts_and_cfg_dropout_of_the_view():
    torch.manual_seed(0)
    data = build_slides(_table(), tissue_key="t", n_genes=6, view_size=4, slide_size=5)
    vae = GeneVAE(6, 8, 3).requires_grad_(False)
    field = MoEVelocity(
        LatentFlow.in_size(3, 4, 2),
        3,
        num_experts=3,
        model_size=8,
        ffn_size=16,
        logit_noise_std=0.0,
    )
    model = LatentFlow(field, latent_size=3, view_size=4, num_tissues=2, vae=vae, cfg_dropout=1.0)
    genes = torch.from_numpy(data.train.genes[:2])
    view = torch.from_numpy(data.train.view[:2])
    tissue = torch.from_numpy(data.train.tissue[:2])
    model.train()
    total, parts = model.loss(genes, view, tissue, torch.Generator().manual_seed(0))
    assert set(parts) == {"flow", "recon", "load_balance"}
    assert total.item() == pytest.approx(sum(parts.values()), rel=1e-5)
    # cfg_dropout = 1: every slide's view is replaced, so the view does not matter
    _, again = model.loss(genes, 5 * view + 1, tissue, torch.Generator().manual_seed(0))
    assert again == parts
    model.eval()
    t, z = torch.full((2,), 0.3), torch.randn(2, 5, 3)
    keep = torch.zeros(2, dtype=torch.bool)
    a = model.predict(z, t, view, tissue, keep).velocity
    b = model.predict(z, t, 5 * view + 1, tissue, keep).velocity
    torch.testing.assert_close(a, b)


def test_cli_train_then_sample_reproduces_the_held_out_pearson(tmp_path):
    table = _table()
    path = tmp_path / "cells.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["tissue", *table.genes])
        for t, row in zip(table.obs["t"], table.X, strict=True):
            w.writerow([t, *row.tolist()])
    out = tmp_path / "run"
    args = [
        "flow",
        "train",
        "--data",
        str(path),
        "--tissue-key",
        "tissue",
        "--n-genes",
        "6",
        "--view-size",
        "4",
        "--slide-size",
        "5",
        "--vae-steps",
        "10",
        "--flow-steps",
        "10",
        "--out",
        str(out),
        "--json",
    ]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    metrics = json.loads((out / "flow.json").read_text())["metrics"]
    pred_csv = tmp_path / "pred.csv"
    r = CliRunner().invoke(app, ["flow", "sample", str(out), "--out", str(pred_csv)])
    assert r.exit_code == 0, r.output
    with pred_csv.open() as f:
        rows = list(csv.DictReader(f))
    genes = [k for k in rows[0] if k not in ("slide", "cell", "tissue")]
    scores = []
    for s in sorted({int(r["slide"]) for r in rows}):
        mine = [r for r in rows if int(r["slide"]) == s]
        pred = np.array([[float(r[g]) for g in genes] for r in mine])
        true = table.X[[int(r["cell"]) for r in mine]][:, [table.genes.index(g) for g in genes]]
        assert {r["tissue"] for r in mine} == {table.obs["t"][int(mine[0]["cell"])]}
        scores.append(slide_pearson(pred, true))
    assert np.mean(scores) == pytest.approx(metrics["pearson"], abs=1e-4)


def test_cli_user_errors_are_one_line(tmp_path):
    r = CliRunner().invoke(
        app, ["flow", "train", "--velocity", "gru", "--out", str(tmp_path / "x")]
    )
    assert r.exit_code == 2 and "velocity" in r.output
    r = CliRunner().invoke(app, ["flow", "sample", str(tmp_path), "--out", str(tmp_path / "p.csv")])
    assert r.exit_code == 2 and "flow.json" in r.output
