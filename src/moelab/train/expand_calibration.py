"""The ``random`` expansion ablation's fitted RMS scale: every matrix's output RMS on a
calibration batch, and the factor ``c`` that restores it after the expansion (the paper's
random-random ablation uses the analytic Eq. 14 instead; we fit it [I]). The paper's own
``sparkling`` init needs none of this (:mod:`moelab.train.expand`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moelab.core.config import GATED_ACTIVATIONS
from moelab.core.experts.bank import SharedExpert
from moelab.core.layer import MoELayer
from moelab.core.routers.base import Router
from moelab.models import MoETransformer


def _rms(y: Tensor, per_expert: bool = False) -> Tensor:
    y = y.double()
    if per_expert:
        return y.pow(2).flatten(1).mean(1).sqrt()
    return y.pow(2).mean().sqrt()


def _ratio(ref: Tensor, now: Tensor) -> Tensor:
    return torch.where(now > 0, ref / now.clamp_min(1e-300), torch.ones_like(now))


@torch.no_grad()
def matrix_output_rms(
    model: MoETransformer,
    input_ids: Tensor,
    refs: dict[str, Tensor] | None = None,
    rescale: frozenset[str] = frozenset(),
) -> dict[str, Tensor]:
    """RMS of every matrix's output on ``input_ids`` ``[B, S]``, in one forward pass.

    Keys are parameter names (``"blocks.0.attn.q_proj.weight"``, ``"...experts.w_down"``);
    values float64 scalars, ``[E]`` per expert for expert banks (every expert applied to every
    token, so the value does not depend on the routing). ``"lm_head.weight"`` is reported
    also with tied embeddings.

    With ``refs``, each matrix named in ``rescale`` is multiplied (with its bias) by
    ``c = refs[name] / rms`` *before* the module runs, so later matrices see the rescaled
    activations; the returned dict then holds the ``c`` of those matrices (SPARKLING's
    RMS-scale consistency, fitted on this calibration batch).
    """
    out: dict[str, Tensor] = {}
    hooks = []

    def fit(key: str, y: Tensor, params: list[Tensor | None], per_expert=False) -> Tensor:
        rms = _rms(y, per_expert)
        if refs is None or key not in rescale:
            if refs is None:
                out.setdefault(key, rms)
            return torch.ones_like(rms)
        c = _ratio(refs[key], rms)
        out[key] = c
        for p in params:
            if p is not None:
                p.mul_(
                    c.reshape(-1, *([1] * (p.dim() - 1))).to(p.dtype)
                    if per_expert
                    else c.to(p.dtype)
                )
        return c

    def linear_hook(name):
        def hook(mod, args):
            x = args[0]
            key = f"{name}.weight"
            target = [mod.weight, mod.bias]
            if name == "lm_head" and model.cfg.tie_embeddings:
                target = [model.norm.weight]
            fit(key, F.linear(x, mod.weight, mod.bias), target)

        return hook

    def router_hook(name):
        def hook(mod, args):
            x = args[0].to(torch.promote_types(args[0].dtype, torch.float32))
            fit(f"{name}.weight", F.linear(x, mod.weight.to(x.dtype)), [mod.weight])

        return hook

    def moe_hook(name):
        def hook(mod, args):
            bank = mod.experts
            x = args[0].reshape(-1, args[0].shape[-1])
            b_in, b_down = bank.b_in, getattr(bank, "b_down", None)
            h = torch.einsum("td,edf->etf", x, bank.w_in)
            h = h if b_in is None else h + b_in[:, None, :]
            in_name = "w_gate_up" if bank.config.activation in GATED_ACTIVATIONS else "w_up"
            c = fit(f"{name}.experts.{in_name}", h, [bank.w_in, b_in], per_expert=True)
            a = bank.activation(h * c.reshape(-1, 1, 1).to(h.dtype))
            y = torch.einsum("etf,efd->etd", a, bank.w_down)
            y = y if b_down is None else y + b_down[:, None, :]
            fit(f"{name}.experts.w_down", y, [bank.w_down, b_down], per_expert=True)

        return hook

    def shared_hook(name):
        def hook(mod, args):
            x = args[0]
            h = x @ mod.w_gate_up
            c = fit(f"{name}.w_gate_up", h, [mod.w_gate_up])
            gate, up = (h * c.to(h.dtype)).chunk(2, dim=-1)
            fit(f"{name}.w_down", (F.silu(gate) * up) @ mod.w_down, [mod.w_down])
            if mod.gate is not None:
                fit(f"{name}.gate", F.linear(x, mod.gate), [mod.gate])

        return hook

    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            hooks.append(mod.register_forward_pre_hook(linear_hook(name)))
        elif isinstance(mod, Router):
            hooks.append(mod.register_forward_pre_hook(router_hook(name)))
        elif isinstance(mod, MoELayer):
            hooks.append(mod.register_forward_pre_hook(moe_hook(name)))
        elif isinstance(mod, SharedExpert):
            hooks.append(mod.register_forward_pre_hook(shared_hook(name)))
    was_training = model.training
    model.eval()
    try:
        model(input_ids)
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    return out
