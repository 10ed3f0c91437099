"""Observe every MoE layer of a model during forward passes (analysis, calibration, pruning).

One place registers and removes the forward hooks, so analysis (:mod:`moelab.analysis.collect`)
and compression calibration (:mod:`moelab.compress.calibration`) share the same machinery.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch import Tensor, nn

from moelab.core.layer import MoELayer, MoEOutput

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
