"""Batch invariance: which routers make a served sequence depend on the sequences served with
it, and what the engines do about each (the one place that knows).

A sequence served in a batch must get exactly the tokens it gets alone. Routing that looks
only at the token itself, or at its own sequence's prefix, keeps that; routing whose
selection spans the rows of a forward pass does not. By router (``RouterConfig``):

- dropless token choice, Sinkhorn (plain top-k outside training), USMoE ``causal_prefix``
  (each row carries its own prefix state): per token or per sequence — served as they are;
- token choice or Sinkhorn with a ``capacity_factor``: the capacity ``ceil(T·k/E · c)`` is
  shared by all T tokens of the forward pass, every prompt of a batched prefill and every row
  of a decode step, so a neighbour's tokens can take a sequence's expert slots. **Served
  dropless** — every token keeps its top-k experts — as vLLM and SGLang serve such models
  (their fused-MoE layers have no capacity; GShard/Switch-style capacity is a training-time
  load bound). The engine routes these layers without the capacity only inside its own
  forward passes (:func:`serving_routing`); the model keeps its configuration, so
  ``moelab eval`` still scores full sequences with the capacity it was trained with;
- USMoE ``position``: one selection group per time column of the batch (budget ``B·k``, as
  the released code's ``[time, batch, D]`` tensors): the rows decide together, and no
  per-sequence form exists. **Served one sequence at a time** (``max_batch=1``); a larger
  batch is refused (:func:`check_batching`). Served alone, every token gets exactly k
  experts, while training ranked groups of ``batch_size`` tokens (the budget moved between
  the rows): a different model from the one trained, hence a
  :class:`BatchDependentRoutingWarning` (``docs/methods/usmoe.md``, "Batch dependence");
  ``causal_prefix`` is the scope whose served model equals the trained one;
- expert choice and USMoE ``sequence``/``batch``: they look at future tokens and cannot
  decode at all (refused by the KV-cache path, ``MoETransformer._check_cacheable``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator

from moelab.core.config import RouterConfig
from moelab.errors import InvalidValueError
from moelab.models import MoETransformer


class BatchDependentRoutingWarning(UserWarning):
    """A model whose routing depends on the batch (USMoE ``position`` scope) is run at a
    batch unlike its training batch, so it computes a different function from the one
    trained."""


SERVED_DROPLESS = "dropless"
SERVED_ALONE = "alone"


def batch_coupling(cfg: RouterConfig) -> str | None:
    """How serving with router ``cfg`` couples the rows of a forward pass (outside training):
    :data:`SERVED_DROPLESS` (a capacity factor; served without it), :data:`SERVED_ALONE`
    (USMoE ``position`` scope; one sequence at a time), or None (batch-invariant, or not
    decodable at all; see the module docstring)."""
    if cfg.kind in ("token_choice", "sinkhorn") and cfg.capacity_factor is not None:
        return SERVED_DROPLESS
    if cfg.kind == "usmoe" and cfg.selection_scope == "position":
        return SERVED_ALONE
    return None


@dataclasses.dataclass(frozen=True)
class BatchingPlan:
    """What an engine must do for ``model`` to be batch-invariant.

    Attributes:
        dropless: ``[(router, dropless config)]`` of the layers served without capacity.
        alone: block indices of the layers that need one sequence per forward.
    """

    dropless: list[tuple[object, RouterConfig]]
    alone: list[int]


def check_batching(model: MoETransformer, max_batch: int) -> BatchingPlan:
    """The :class:`BatchingPlan` of ``model`` served ``max_batch`` sequences at a time.

    Raises:
        ValueError: a layer needs one sequence at a time (USMoE ``position`` scope) and
            ``max_batch > 1``, naming the layer and the fixes.
    """
    dropless, alone = [], []
    for block in model.blocks:
        if not block.is_moe:
            continue
        router = block.ffn.router
        how = batch_coupling(router.config)
        if how == SERVED_DROPLESS:
            dropless.append((router, dataclasses.replace(router.config, capacity_factor=None)))
        elif how == SERVED_ALONE:
            alone.append(block.layer_idx)
    if alone and max_batch > 1:
        raise InvalidValueError(
            f"max_batch: layer {alone[0]} routes with USMoE selection_scope='position', one "
            "selection group across the sequences of a batch, so a served sequence would "
            f"depend on its neighbours; serve it with max_batch=1 (got {max_batch}), or swap "
            "in selection_scope='causal_prefix' (moelab.models.with_router)"
        )
    if alone:
        warnings.warn(
            BatchDependentRoutingWarning(
                f"layer {alone[0]} routes with USMoE selection_scope='position': training "
                "ranked each time column across the batch's sequences, one sequence at a time "
                "gives every token exactly top_k experts, a different model from the one "
                "trained (see docs/methods/usmoe.md, 'Batch dependence'); train with "
                "--usmoe-scope causal_prefix for a model that serves as trained"
            ),
            stacklevel=3,
        )
    return BatchingPlan(dropless, alone)


@contextlib.contextmanager
def serving_routing(plan: BatchingPlan) -> Iterator[None]:
    """Within the block, the plan's capacity-limited routers route dropless (their
    ``config`` is swapped and restored after, also on error). Not thread-safe against other
    forwards of the same model running meanwhile."""
    saved = [(router, router.config) for router, _ in plan.dropless]
    try:
        for router, cfg in plan.dropless:
            router.config = cfg
        yield
    finally:
        for router, cfg in saved:
            router.config = cfg
