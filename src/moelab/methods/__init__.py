"""Recipes: methods that are whole training setups rather than one seam of the MoE core.

Continual learning, knowledge editing, safety alignment, RL, GUI agents, multimodal EEG,
forecasting and flow matching are not a router, an expert kind or a loss: each is a way of
training or using a model on some task. Each such method is a **recipe** in its own domain
package, ``methods/<domain>/`` (``continual/``, ``editing/``, ``rl/``, ...), added by the work
that brings its first method; this package holds only what every recipe shares.

A recipe is a small package built on the same core:

* a config dataclass (typed fields with defaults);
* its data, from loaders in :mod:`moelab.data` (e.g. :mod:`moelab.data.labelled`);
* the loop and its metrics: ``run(config, seed) -> {metric: value}``
  (:class:`~moelab.methods.runner.Recipe`);
* one runner, :func:`~moelab.methods.runner.run_seeds`, shared by the recipe's CLI command and
  its benchmark: it runs every seed of every arm (the method and its baselines, as config
  variants) and returns a :class:`~moelab.utils.results.BenchmarkResult`, the one JSON result
  format (config, seeds, commit, per-seed metrics, paired differences with t-intervals) from
  which the docs' tables are rendered.

What recipes need from the core (a router input separate from the expert input, forced
routing, per-expert freezing, growable expert banks, new expert kinds) goes into ``core/`` and
``models/``, never into a recipe. Recipes import the core, models, train, data, analysis and
utils, never each other's internals: a piece two recipes share (e.g. continual-learning
streams and metrics) lives in their domain package or moves down a layer. Nothing but the CLI
imports ``moelab.methods`` (``tests/test_layering.py``).

Each method's module docstring names its paper (title, venue, arXiv id) and says which parts
follow the paper exactly and which are this project's reading of it.
"""
