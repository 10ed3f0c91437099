"""Put adapters into any model by module name (PEFT style), and fold LoRA back out.

:func:`inject_adapters` replaces every module a pattern selects (rules in
:mod:`moelab.models.adapters.match`) by ``factory(name, module)``, in place, and returns the
replaced names; :func:`add_lora`, :func:`add_moe_lora` and :func:`add_parallel_adapters`
are its common uses. A model with adapters is an ordinary ``nn.Module``; its config no longer
describes it, so :func:`moelab.models.save_model` refuses it until :func:`merge_adapters`
(LoRA only) has folded the adapters into plain ``nn.Linear``s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from moelab.errors import InvalidTypeError, InvalidValueError
from moelab.models.adapters.lora import LoRALinear
from moelab.models.adapters.match import Pattern, check_patterns, describe, module_matches
from moelab.models.adapters.moe_lora import MoELoRALinear
from moelab.models.adapters.parallel import ParallelAdapter, ParallelAdapterWrapper

ADAPTER_TYPES = (LoRALinear, MoELoRALinear, ParallelAdapterWrapper)


def _type_name(t: type) -> str:
    return f"nn.{t.__name__}" if t.__module__.startswith("torch.nn") else t.__name__


def _available(model: nn.Module, module_type: type) -> str:
    names = [n for n, m in model.named_modules() if n and isinstance(m, module_type)]
    if not names:
        return f"the model has no {_type_name(module_type)} modules"
    more = f", ... ({len(names)} in all)" if len(names) > 4 else ""
    return f"{_type_name(module_type)} modules include {', '.join(names[:4])}{more}"


def select_modules(
    model: nn.Module, targets: Sequence[Pattern], module_type: type = nn.Linear
) -> list[str]:
    """Names of the modules ``targets`` select, in ``named_modules`` order.

    Raises:
        InvalidTypeError: bad ``targets`` (see :func:`check_patterns`).
        InvalidValueError: a pattern that selects nothing (the message lists a few modules
            of ``module_type``), or one that selects a module that is not a ``module_type``.
    """
    patterns = check_patterns(targets, "targets")
    modules = [(n, m) for n, m in model.named_modules() if n]
    chosen: list[str] = []
    for p in patterns:
        hits = [(n, m) for n, m in modules if module_matches(p, n)]
        if not hits:
            raise InvalidValueError(
                f"targets: {describe(p)} matches no module; {_available(model, module_type)}"
            )
        for n, m in hits:
            if not isinstance(m, module_type):
                raise InvalidValueError(
                    f"targets: {describe(p)} matches {n}, a {type(m).__name__}, where "
                    f"{_type_name(module_type)} modules are expected"
                )
        chosen += [n for n, _ in hits if n not in chosen]
    order = {n: i for i, (n, _) in enumerate(modules)}
    return sorted(chosen, key=order.__getitem__)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def inject_adapters(
    model: nn.Module,
    targets: Sequence[Pattern],
    factory: Callable[[str, nn.Module], nn.Module],
    module_type: type = nn.Linear,
) -> list[str]:
    """Replace every module ``targets`` select by ``factory(name, module)`` (in place).

    Every pattern is checked before anything is replaced. Nested matches (a selected module
    inside another selected one) are refused: the outer replacement would hide the inner.

    Args:
        model: any module.
        targets: names and compiled regexes (:mod:`moelab.models.adapters.match`).
        factory: builds the replacement from the dotted name and the module.
        module_type: what every selected module must be (``nn.Linear`` for LoRA;
            ``nn.Module`` for any).
    Returns:
        The replaced names, in ``named_modules`` order.
    Raises:
        InvalidTypeError: bad ``targets``.
        InvalidValueError: see :func:`select_modules`; nested matches.
    """
    names = select_modules(model, targets, module_type)
    for a in names:
        for b in names:
            if b.startswith(a + "."):
                raise InvalidValueError(f"targets: select both {a} and {b}, inside it")
    for n in names:
        _replace(model, n, factory(n, model.get_submodule(n)))
    return names


def add_lora(
    model: nn.Module, targets: Sequence[Pattern], rank: int, alpha: float, dropout: float = 0.0
) -> list[str]:
    """Wrap every selected ``nn.Linear`` in a :class:`LoRALinear` (base frozen, B = 0: the
    outputs are unchanged). Only the wrapped bases are frozen; use :func:`freeze_except`
    (e.g. ``["lora_A", "lora_B"]``) to train the adapters alone. Returns the wrapped names.

    Raises:
        InvalidValueError / InvalidTypeError: see :func:`inject_adapters`, :class:`LoRALinear`.
    """
    return inject_adapters(model, targets, lambda _, m: LoRALinear(m, rank, alpha, dropout))


def add_moe_lora(
    model: nn.Module,
    targets: Sequence[Pattern],
    num_experts: int,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    top_k: int | None = None,
) -> list[str]:
    """Wrap every selected ``nn.Linear`` in a :class:`MoELoRALinear`; returns the names.

    Raises:
        InvalidValueError / InvalidTypeError: see :func:`inject_adapters`,
            :class:`MoELoRALinear`.
    """
    return inject_adapters(
        model,
        targets,
        lambda _, m: MoELoRALinear(m, num_experts, rank, alpha, dropout, top_k),
    )


def add_parallel_adapters(
    model: nn.Module,
    targets: Sequence[Pattern],
    dim: int,
    bottleneck: int,
    *,
    source: str = "input",
    scale: float = 0.1,
    learnable_scale: str | None = None,
    layer_norm: bool = False,
    dropout: float = 0.0,
) -> list[str]:
    """Wrap every selected module (any type) in a :class:`ParallelAdapterWrapper` with a
    fresh :class:`ParallelAdapter` of width ``dim`` (the primary output's last dimension,
    and the input's with ``source="input"``) on the wrapped module's device and dtype.
    Returns the wrapped names.

    Raises:
        InvalidValueError / InvalidTypeError: see :func:`inject_adapters`,
            :class:`ParallelAdapter`, :class:`ParallelAdapterWrapper`.
    """

    def wrap(_: str, m: nn.Module) -> nn.Module:
        a = ParallelAdapter(dim, bottleneck, scale, learnable_scale, layer_norm, dropout)
        ref = next(m.parameters(), None)
        if ref is not None:
            a = a.to(device=ref.device, dtype=ref.dtype)
        return ParallelAdapterWrapper(m, a, source)

    return inject_adapters(model, targets, wrap, module_type=nn.Module)


def merge_adapters(model: nn.Module) -> list[str]:
    """Replace every :class:`LoRALinear` by its merged ``nn.Linear`` (in place; outputs equal
    up to float rounding). Returns the merged names.

    Raises:
        InvalidValueError: the model has no LoRALinear, or holds an adapter that cannot be
            merged (MoE-LoRA weights depend on the input; a bottleneck adapter is nonlinear);
            nothing is changed then.
    """
    if not isinstance(model, nn.Module):
        raise InvalidTypeError(f"model: expected nn.Module, got {type(model).__name__}")
    for n, m in model.named_modules():
        if isinstance(m, (MoELoRALinear, ParallelAdapterWrapper)):
            raise InvalidValueError(
                f"model: {n} is a {type(m).__name__}, which cannot be merged into a plain layer"
            )
    names = [n for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    if not names:
        raise InvalidValueError("model: has no LoRALinear adapters to merge")
    if names[0] == "":
        raise InvalidValueError("model: is itself a LoRALinear; call its merge()")
    for n in names:
        _replace(model, n, model.get_submodule(n).merge())
    return names
