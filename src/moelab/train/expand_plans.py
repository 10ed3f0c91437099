"""SPARKLING expansion plans: which axis of every parameter grows and how
(:class:`~moelab.train.expand_axes.ParamPlan` per parameter name; rules in
:mod:`moelab.train.expand`)."""

from __future__ import annotations

from moelab.core.config import GATED_ACTIVATIONS
from moelab.errors import InvalidValueError
from moelab.models import ModelConfig, MoETransformer
from moelab.train.expand_axes import Axis, ParamPlan


def param_plans(old: ModelConfig, new: ModelConfig) -> dict[str, ParamPlan]:
    """One :class:`ParamPlan` per parameter name of a model with config ``old``.

    Raises:
        InvalidValueError: the model has a parameter this module does not know how to grow.
    """
    if (old.n_heads, old.n_kv_heads, old.head_dim) != (new.n_heads, new.n_kv_heads, new.head_dim):
        raise InvalidValueError(
            "expand: the attention heads must stay as they are (n_heads, n_kv_heads, head_dim)"
        )
    D = Axis(old.d_model, new.d_model)
    Q = K = None  # heads and head_dim are kept (SPARKLING §3.3): q/k/v/o never grow there
    Fd = Axis(old.dense_ffn_size, new.dense_ffn_size, role="inner")
    plans: dict[str, ParamPlan] = {}

    def add(name, axes, in_dims=(), kind="matrix", per_expert=False, scale_with=None):
        plans[name] = ParamPlan(name, tuple(axes), tuple(in_dims), kind, per_expert, scale_with)

    add("embed.weight", (None, D), kind="embedding")
    if not old.tie_embeddings:
        add("lm_head.weight", (None, D), (1,))
    add("norm.weight", (D,), kind="norm")
    for i in range(old.n_layers):
        b = f"blocks.{i}"
        add(f"{b}.attn_norm.weight", (D,), kind="norm")
        add(f"{b}.ffn_norm.weight", (D,), kind="norm")
        for proj, out_axis in (("q_proj", Q), ("k_proj", K), ("v_proj", K)):
            add(f"{b}.attn.{proj}.weight", (out_axis, D), (1,))
            add(
                f"{b}.attn.{proj}.bias",
                (out_axis,),
                kind="bias",
                scale_with=f"{b}.attn.{proj}.weight",
            )
        add(f"{b}.attn.o_proj.weight", (D, Q), (1,))
        if old.qk_norm != "none":  # over head_dim or the heads' width: neither grows
            add(f"{b}.attn.q_norm.weight", (None,), kind="norm")
            add(f"{b}.attn.k_norm.weight", (None,), kind="norm")
        if not old.is_moe_layer(i):
            add(f"{b}.ffn.w_gate.weight", (Fd, D), (1,))
            add(f"{b}.ffn.w_up.weight", (Fd, D), (1,))
            add(f"{b}.ffn.w_down.weight", (D, Fd), (1,))
            continue
        ex_o, ex_n = old.moe.experts, new.moe.experts
        Fe = Axis(ex_o.ffn_hidden_size, ex_n.ffn_hidden_size, role="inner")
        m = f"{b}.ffn"
        add(f"{m}.router.weight", (None, D), (1,))
        gated = ex_o.activation in GATED_ACTIVATIONS
        Fin = Axis(2 * Fe.old, 2 * Fe.new, blocks=2, role="inner") if gated else Fe
        w_in = "w_gate_up" if gated else "w_up"
        add(f"{m}.experts.{w_in}", (None, D, Fin), (1,), per_expert=True)
        add(f"{m}.experts.w_down", (None, Fe, D), (1,), per_expert=True)
        if ex_o.bias:  # like q/k/v's biases: copied unscaled, or 0 when new (random) [I]
            for b, axis, w in (("b" + w_in[1:], Fin, w_in), ("b_down", D, "w_down")):
                add(f"{m}.experts.{b}", (None, axis), kind="bias", per_expert=True,
                    scale_with=f"{m}.experts.{w}")  # fmt: skip
        if ex_o.shared_expert_size:
            Fs = Axis(ex_o.shared_expert_size, ex_n.shared_expert_size, role="inner")
            Fs2 = Axis(2 * Fs.old, 2 * Fs.new, blocks=2, role="inner")
            add(f"{m}.shared_expert.w_gate_up", (D, Fs2), (0,))
            add(f"{m}.shared_expert.w_down", (Fs, D), (0,))
            if ex_o.shared_expert_gate:
                add(f"{m}.shared_expert.gate", (None, D), (1,))
    return plans


def model_plans(model: MoETransformer, new: ModelConfig) -> dict[str, ParamPlan]:
    """:func:`param_plans` for exactly the parameters ``model`` has.

    Raises:
        InvalidValueError: a parameter this module does not know how to grow.
    """
    plans = param_plans(model.cfg, new)
    out = {}
    for name, p in model.named_parameters():
        plan = plans.get(name)
        if plan is None or len(plan.axes) != p.dim():
            raise InvalidValueError(f"expand: cannot grow parameter {name} {tuple(p.shape)}")
        out[name] = plan
    return out
