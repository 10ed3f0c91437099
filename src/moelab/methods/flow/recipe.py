"""The MoLF recipe for :func:`moelab.methods.runner.run_seeds`: one arm, one seed, metrics.

Arms are :class:`~moelab.methods.flow.config.FlowConfig` variants (``velocity``, ``variant``,
``aux_loss_coeff``, ``task``). The recipe keeps the expression table, the slides and the
stage-1 VAE of the current seed, so every flow arm of a seed shares one VAE (as MoLF trains
the VAE once and freezes it) and the shared and conflict variants one slide split.
"""

from __future__ import annotations

import dataclasses

from moelab.data.expression import ExpressionTable
from moelab.data.singlecell import SlideData
from moelab.methods.flow.config import FlowConfig
from moelab.methods.flow.expression import (
    evaluate_expression,
    fit_vae,
    load_table,
    make_slides,
    train_expression,
)
from moelab.methods.flow.toy import evaluate_toy, train_toy
from moelab.methods.flow.vae import GeneVAE

# the fields each cached piece depends on (besides the seed)
_TABLE_FIELDS = ("data_path", "use_raw")
_SLIDE_FIELDS = (
    *_TABLE_FIELDS,
    "tissue_key",
    "slide_key",
    "view_key",
    "n_genes",
    "view_size",
    "slide_size",
    "test_fraction",
    "variant",
)
_VAE_FIELDS = (
    *_SLIDE_FIELDS,
    "latent_size",
    "vae_hidden",
    "vae_steps",
    "vae_batch",
    "vae_kl",
    "vae_mask",
    "lr",
    "weight_decay",
)


def _key(config: FlowConfig, fields: tuple[str, ...], *extra: object) -> tuple:
    return (*extra, *(getattr(config, f) for f in fields))


class MoLFRecipe:
    """``run(config, seed) -> metrics`` (see :func:`evaluate_expression` and
    :func:`~moelab.methods.flow.toy.evaluate_toy` for the names).

    Args:
        table: an expression table to use instead of reading ``config.data_path`` (tests).
    """

    name = "molf"

    def __init__(self, table: ExpressionTable | None = None) -> None:
        self._given = table
        self._tables: dict[tuple, ExpressionTable] = {}
        self._slides: dict[tuple, SlideData] = {}
        self._vaes: dict[tuple, GeneVAE] = {}

    def _table(self, config: FlowConfig) -> ExpressionTable:
        if self._given is not None:
            return self._given
        key = _key(config, _TABLE_FIELDS)
        if key not in self._tables:
            self._tables = {key: load_table(config)}
        return self._tables[key]

    def run(self, config: FlowConfig, seed: int) -> dict[str, float]:
        if config.task == "toy":
            return evaluate_toy(train_toy(config, seed), config, seed)
        # a variant's VAE sees the same genes: key the VAE on the shared variant's slides
        base = dataclasses.replace(config, variant="shared")
        slide_key = _key(config, _SLIDE_FIELDS, seed)
        if slide_key not in self._slides:
            self._slides = {k: v for k, v in self._slides.items() if k[0] == seed}
            self._slides[slide_key] = make_slides(self._table(config), config, seed)
        data = self._slides[slide_key]
        vae = None
        if config.velocity != "simplemlp":
            vae_key = _key(base, _VAE_FIELDS, seed)
            if vae_key not in self._vaes:
                self._vaes = {k: v for k, v in self._vaes.items() if k[0] == seed}
                self._vaes[vae_key] = fit_vae(data, config, seed)
            vae = self._vaes[vae_key]
        return evaluate_expression(train_expression(config, seed, data=data, vae=vae))
