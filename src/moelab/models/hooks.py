"""Observe a model's layers during forward passes: every MoE layer (analysis, calibration,
pruning) or every block's output (representation analyses such as CKA, probes, adapters).

One place registers and removes the forward hooks, so analysis (:mod:`moelab.analysis.collect`)
and compression calibration (:mod:`moelab.compress.calibration`) share the same machinery.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch import Tensor, nn

from moelab.core.layer import MoELayer, MoEOutput
from moelab.errors import InvalidValueError

LayerObserver = Callable[[int, MoELayer, Tensor, MoEOutput], None]


def moe_layers(model: nn.Module) -> list[MoELayer]:
    """The model's MoE layers in depth order (``model.modules()`` order)."""
    return [m for m in model.modules() if isinstance(m, MoELayer)]


@contextmanager
def observe_moe_layers(model: nn.Module, fn: LayerObserver) -> Iterator[list[MoELayer]]:
    """Call ``fn(i, layer, x, out)`` after every forward of the i-th MoE layer (0-based among
    the MoE layers, depth order) while the context is open; the hooks are removed on exit,
    also when ``fn`` raises.

    ``x`` is the layer's input ``[..., D]`` as the layer received it (detached) and ``out``
    its :class:`~moelab.core.layer.MoEOutput` (hidden states ``[..., D]``, routing plan,
    record). Exceptions raised by ``fn`` propagate out of the model's forward, which lets a
    caller stop a pass early.

    Yields:
        The list of MoE layers (index ``i`` of ``fn`` indexes it).
    Raises:
        ValueError: the model has no MoE layer.
    """
    layers = moe_layers(model)
    if not layers:
        raise ValueError("model: has no MoE layer (a dense model)")

    def make(i: int):
        def hook(module: nn.Module, args: tuple, output: MoEOutput) -> None:
            fn(i, module, args[0].detach(), output)

        return hook

    handles = [layer.register_forward_hook(make(i)) for i, layer in enumerate(layers)]
    try:
        yield layers
    finally:
        for h in handles:
            h.remove()


BlockObserver = Callable[[int, nn.Module, Tensor], None]


def model_blocks(model: nn.Module) -> nn.ModuleList:
    """The model's stack of blocks: its ``blocks`` ``nn.ModuleList`` (the decoder blocks of
    :class:`~moelab.models.MoETransformer`, the encoder blocks of
    :class:`~moelab.models.encoder.BertEncoder`).

    Raises:
        ValueError: the model has no ``blocks`` ModuleList.
    """
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise InvalidValueError(
            f"model: {type(model).__name__} has no 'blocks' ModuleList whose outputs could be "
            "observed"
        )
    return blocks


@contextmanager
def observe_blocks(
    model: nn.Module, fn: BlockObserver, layers: list[int] | None = None
) -> Iterator[nn.ModuleList]:
    """Call ``fn(i, block, h)`` after every forward of block ``i`` while the context is open,
    with ``h`` the block's output hidden states ``[B, S, D]`` (the first item when the block
    returns a tuple, as decoder blocks do). ``h`` keeps its graph: detach it to store it.
    Hooks are removed on exit, also when ``fn`` raises.

    Args:
        layers: block indices to observe (default: all).
    Yields:
        The model's blocks.
    Raises:
        ValueError: the model has no blocks, or an index outside ``[0, n_blocks)``.
    """
    blocks = model_blocks(model)
    chosen = list(range(len(blocks))) if layers is None else list(layers)
    bad = [i for i in chosen if not isinstance(i, int) or not 0 <= i < len(blocks)]
    if bad:
        raise InvalidValueError(f"layers: {bad} not in [0, {len(blocks)})")

    def make(i: int):
        def hook(module: nn.Module, args: tuple, output) -> None:
            fn(i, module, output[0] if isinstance(output, tuple) else output)

        return hook

    handles = [blocks[i].register_forward_hook(make(i)) for i in chosen]
    try:
        yield blocks
    finally:
        for h in handles:
            h.remove()
