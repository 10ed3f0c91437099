"""The compiled decode step of ``Engine(compile=True)``: one ``torch.compile`` of a model per
model object and module structure, with guards on the model's tensors and inputs only.

Before each call of a compiled function, torch.compile evaluates its guards: checks that what
the graph was traced from is unchanged. For a whole ``MoETransformer`` these include one guard
per module attribute the forward reads; on SmolLM2-MoE (30 layers) evaluating them took
1.1 ms of a 26 ms float32 decode step, and 2.0 ms of a 17 ms 8-bit one, where the quantized
projections add their codes and scales (torch profiler, 2 threads). A served model's modules
do not change between its decode steps, so where torch supports it (``guard_filter_fn`` and
``isolate_recompiles`` of :func:`torch.compile`, torch >= 2.13) the guards on modules are
dropped (``torch.compiler.skip_guard_on_all_nn_modules_unsafe``), which cut the 8-bit step
from 17.1 to 14.6 ms. What the guards protected is then taken care of here:

- each compiled function belongs to one model object and records its compiled graphs
  apart from every other ``torch.compile`` of ``MoETransformer.forward``
  (``isolate_recompiles``), so no other model reaches its graphs, and each model has its
  own recompile budget;
- it is reused only while the model keeps the structure it had (:func:`structure`: every
  module's type and training flag, every parameter's and buffer's identity, shape and
  dtype, and the identity of every module's ``config``/``cfg`` object): replacing a module
  (quantizing in place, swapping a router), a parameter or a configuration, or calling
  ``train()``, gives the next engine a new compile. Values written into the same tensors
  (``load_state_dict``) are read at every call and need none.

Changing any other plain attribute of a module after its first compiled decode is not seen by
the compiled graphs: build a new model instead. Older torch versions compile with all guards.

Inductor's run-time checks of each external operator's output size, stride and alignment
(``size_asserts``, ``alignment_asserts``; 698 calls a step on SmolLM2-MoE) are switched off:
the operators return the shapes of their registered fakes, and the compiled decoding tests
compare the compiled tokens with eager ones. On the 8-bit batch-1 step that was about 3 %
(1.031 [0.987, 1.053], 9 interleaved repeats of two engines in one process, 2 threads: within
this host's noise).

The step is traced without duck sizing (``use_duck_shape``, torch's private shape config):
with it, every dynamic size equal to another at the first trace shares one symbol, so a
serving cache whose first capacity equals the head size (64 positions of 64-wide heads,
SmolLM2's shape) had its capacity fused with the static head size, and the first growth of
the cache recompiled the step in the middle of a generation (2-3 s on SmolLM2-MoE).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Hashable

import torch
from torch._inductor import config as inductor_config

from moelab.models import MoETransformer

try:
    from torch.fx.experimental import _config as _shape_config
except ImportError:  # pragma: no cover - the module exists in every supported torch
    _shape_config = None
if not hasattr(_shape_config, "use_duck_shape"):  # pragma: no cover
    _shape_config = None

_SKIP_MODULE_GUARDS = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)
_ISOLATES = "isolate_recompiles" in inspect.signature(torch.compile).parameters
# inductor's per-operator output checks, off where this torch has them (module docstring)
_NO_ASSERTS = {
    k: False for k in ("size_asserts", "alignment_asserts") if hasattr(inductor_config, k)
}
_compiled: weakref.WeakKeyDictionary[MoETransformer, tuple[Hashable, Callable]] = (
    weakref.WeakKeyDictionary()
)


def structure(model: MoETransformer) -> Hashable:
    """What a compiled decode of ``model`` without module guards relies on staying the same:
    every module's name, type and training flag and the identity of its ``config`` or
    ``cfg`` attribute, and every parameter's and buffer's name, identity, shape and dtype."""
    modules = tuple(
        (name, type(m), m.training, id(getattr(m, "config", None)), id(getattr(m, "cfg", None)))
        for name, m in model.named_modules()
    )
    tensors = tuple(
        (name, id(t), tuple(t.shape), t.dtype)
        for name, t in (*model.named_parameters(), *model.named_buffers())
    )
    return modules, tensors


def compiled_decode(model: MoETransformer) -> Callable:
    """``model``'s forward through ``torch.compile(..., dynamic=True)``, without guards on its
    modules where torch supports it (module docstring), shared by every engine of ``model``
    while :func:`structure` of ``model`` stays the same; a fresh compile otherwise. The
    compiled function is the class's forward, which holds no reference to ``model``, so
    the cache entry goes with the model. The returned step calls it without duck sizing
    (module docstring); its ``compiled`` attribute is the shared compiled function."""
    key = structure(model)
    cached = _compiled.get(model)
    if cached is None or cached[0] != key:
        forward = type(model).forward
        if _SKIP_MODULE_GUARDS is not None and _ISOLATES:
            fn = torch.compile(
                forward,
                dynamic=True,
                isolate_recompiles=True,
                options={"guard_filter_fn": _SKIP_MODULE_GUARDS, **_NO_ASSERTS},
            )
        else:
            fn = torch.compile(forward, dynamic=True, options=dict(_NO_ASSERTS))
        cached = _compiled[model] = (key, fn)
    fn = cached[1]

    def step(*args, **kwargs):
        if _shape_config is None:
            return fn(model, *args, **kwargs)
        # set and restored directly: patch() costs 14 us a step, this 3
        before = _shape_config.use_duck_shape
        _shape_config.use_duck_shape = False
        try:
            return fn(model, *args, **kwargs)
        finally:
            _shape_config.use_duck_shape = before

    step.compiled = fn
    return step
