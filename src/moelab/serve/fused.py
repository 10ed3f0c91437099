"""The fused decode step of ``Engine(fused=True)``: every block of a decode step in one C++
call (``csrc/decode_step.cpp``).

A decode step reads each active weight once, and at batch 1 on a CPU that is all the work
there is: SmolLM2-MoE in 8 bits reads 214 MB a token. Run as PyTorch modules, a step also
makes ~20 operator calls per block, each passing through Python and the dispatcher; compiled
by torch.compile they still run from a Python wrapper, and on that model at batch 1 the main
thread spent about half of a 12 ms step outside the kernels (perf, 2 threads: interpreter,
dispatcher, allocator). llama.cpp runs its graph from C. The fused step does too: the model's
weights are handed once to a C++ executor (the same tensors, so values written into them
later are read), which runs RMSNorm, the q/k/v projections, RoPE, the cache write, attention
over the cache, the output projection, the router and the experts of every block, the final
norm and the LM head, on the kernels the modules use (``dense_rows``, ``quant_rows_mm``'s
integer kernel, the fused expert kernel). The maths is the modules'; the float32 sums run in
other orders, so logits match the PyTorch path to rounding (a greedy near-tie may resolve
differently).

What it runs (:func:`unsupported` says why a model is refused): a causal float32
:class:`~moelab.models.MoETransformer` on the CPU whose blocks are pre-norm attention (GQA,
RoPE, optional q/k/v biases and q/k norms) plus a dense SwiGLU FFN or an MoE layer with a
token-choice router (softmax or sigmoid scores, softmax before or after top-k, normalised
top-k weights, routed scaling factor, expert bias; no group limits, shared expert or replay;
a capacity factor only as the engine serves it, dropless) over a local dispatcher and
float32 experts of a kernel activation, or symmetric 4/8-bit quantized experts with SwiGLU;
dense projections float32 ``Linear`` or symmetric 4/8-bit
:class:`~moelab.models.QuantizedLinear`, no low-rank corrections, and no hooks. Modules
swapped after the engine is built are not seen (build a new engine).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from moelab.core.dispatch import LocalDispatcher
from moelab.core.experts import cpu_kernel
from moelab.core.experts.bank import ExpertBank
from moelab.core.experts.quantized import (
    QuantizedExpertBank,
    QuantizedProjection,
    kernel_unreadable,
)
from moelab.core.layer import MoELayer
from moelab.core.routers.token_choice import TopKRouter
from moelab.errors import InvalidValueError
from moelab.models import MoETransformer
from moelab.models.attention import Attention, KVCache
from moelab.models.block import DecoderBlock
from moelab.models.ffn import SwiGLUFFN
from moelab.models.linear import Linear
from moelab.models.norm import RMSNorm
from moelab.models.quantized_linear import QuantizedLinear
from moelab.serve.batching import check_batching, serving_routing

_QK_NORMS = {"none": 0, "head": 1, "full": 2}
_SCORE_FUNCS = {"softmax": 0, "sigmoid": 1}


@dataclass(frozen=True)
class DecodeRecord:
    """One MoE block's routing in a fused decode step: the part of a
    :class:`~moelab.core.telemetry.RoutingRecord` the engine reads.

    Attributes:
        expert_idx: ``[n, k]`` int64, each row's experts in descending selection order.
        num_experts: E.
    """

    expert_idx: Tensor
    num_experts: int

    @property
    def counts(self) -> Tensor:
        """``[E]`` int64 pairs per expert."""
        return torch.bincount(self.expert_idx.reshape(-1), minlength=self.num_experts)

    @property
    def all_token_idx(self) -> Tensor:
        """``[n·k]`` int64, the row of every pair (row-major)."""
        n, k = self.expert_idx.shape
        return torch.arange(n).repeat_interleave(k)

    @property
    def all_expert_idx(self) -> Tensor:
        """``[n·k]`` int64, the expert of every pair."""
        return self.expert_idx.reshape(-1)


@dataclass(frozen=True)
class DecodeOutput:
    """A fused decode step's result: ``logits [n, 1, V]`` float32 and, per block, a
    :class:`DecodeRecord` (None for dense blocks), as ``LMOutput.records``."""

    logits: Tensor
    records: list[DecodeRecord | None]


def _float_weight(t: Tensor) -> bool:
    return type(t) in (Tensor, nn.Parameter) and t.dtype == torch.float32 and t.is_contiguous()


def _proj_problem(p: QuantizedProjection) -> str | None:
    why = kernel_unreadable(p.spec)
    if why is not None:
        return why
    if p.zeros is not None:
        return "asymmetric codes (zero points)"
    if p.lowrank is not None:
        return "a low-rank correction"
    return None


def _linear_problem(m: nn.Module) -> str | None:
    if type(m) is Linear:
        ok = _float_weight(m.weight) and (m.bias is None or _float_weight(m.bias))
        return None if ok else "weights that are not contiguous float32"
    if type(m) is QuantizedLinear:
        return _proj_problem(m.proj)
    return f"a {type(m).__name__} projection"


def _moe_problem(ffn: MoELayer) -> str | None:
    router = ffn.router
    rc = router.config  # what the router routes by (a swapped config included)
    if type(router) is not TopKRouter or rc.kind != "token_choice":
        return f"a {rc.kind!r} router"
    if rc.score_func not in _SCORE_FUNCS:
        return f"router scores {rc.score_func!r}"
    for name, bad in (
        ("group-limited routing", rc.n_group is not None),
        ("a capacity factor", rc.capacity_factor is not None),
        ("forced uniform routing", rc.force_uniform),
        ("a separate router input", rc.input_size is not None),
        ("router replay", router.replay is not None),
        ("a shared expert", ffn.shared_expert is not None),
        ("a distributed or offloaded dispatcher", type(ffn.dispatcher) is not LocalDispatcher),
        ("a router weight that is not contiguous float32", not _float_weight(router.weight)),
    ):
        if bad:
            return name
    ex = ffn.experts
    if type(ex) is ExpertBank:
        cfg = ex.config
        if cfg.lora_rank or cfg.bias or cfg.activation not in cpu_kernel.ACTIVATIONS:
            return "experts with LoRA adapters, biases or a non-kernel activation"
        if not (_float_weight(ex.w_in) and _float_weight(ex.w_down)):
            return "expert weights that are not contiguous float32"
        return None
    if type(ex) is QuantizedExpertBank:
        if ex.config.activation != "swiglu" or ex.b_in is not None:
            return "quantized experts without SwiGLU or with biases"
        for p in ex.projections.values():
            why = _proj_problem(p)
            if why is not None:
                return f"quantized experts with {why}"
        return None
    return f"{type(ex).__name__} experts"


def _block_problem(block: nn.Module) -> str | None:
    if type(block) is not DecoderBlock:
        return f"a {type(block).__name__}"
    attn = block.attn
    if type(attn) is not Attention:
        return f"a {type(attn).__name__} attention"
    norms = [block.attn_norm, block.ffn_norm, attn.q_norm, attn.k_norm]
    if any(m is not None and type(m) is not RMSNorm for m in norms):
        return "a norm that is not RMSNorm"
    if any(m is not None and not _float_weight(m.weight) for m in norms):
        return "a norm weight that is not contiguous float32"
    if len({m.eps for m in norms if m is not None}) != 1:
        return "norms of different eps"
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        why = _linear_problem(getattr(attn, name))
        if why is not None:
            return f"{name} with {why}"
    ffn = block.ffn
    if type(ffn) is SwiGLUFFN:
        for name in ("w_gate", "w_up", "w_down"):
            why = _linear_problem(getattr(ffn, name))
            if why is not None:
                return f"{name} with {why}"
        return None
    if type(ffn) is MoELayer:
        return _moe_problem(ffn)
    return f"a {type(ffn).__name__} feed-forward layer"


def unsupported(model: MoETransformer) -> str | None:
    """Why the fused decode step cannot run ``model`` (module docstring), or None."""
    if not cpu_kernel.available():
        return "the C++ kernel is not built (cpu_kernel.kernel())"
    if model.cfg.objective != "causal":
        return f"a {model.cfg.objective} model"
    w = model.embed.weight
    if w.device.type != "cpu" or not _float_weight(w):
        return "the model is not float32 on the CPU"
    training = [name for name, m in model.named_modules() if m.training]
    if training:
        return f"module {training[0] or 'model'} is in training mode"
    hooked = [name for name, m in model.named_modules() if m._forward_hooks or m._forward_pre_hooks]
    if hooked:
        return f"module {hooked[0] or 'model'} has forward hooks"
    if getattr(nn.modules.module, "_global_forward_hooks", None) or getattr(
        nn.modules.module, "_global_forward_pre_hooks", None
    ):
        return "global forward hooks are registered (torch.nn.modules.module)"
    ropes = {id(b.attn.rope) for b in model.blocks if isinstance(b, DecoderBlock)}
    if len(ropes) > 1:
        return "blocks with their own rotary embeddings"
    for i, block in enumerate(model.blocks):
        why = _block_problem(block)
        if why is None and block.attn.layer_idx != i:
            why = f"the KV-cache layer index {block.attn.layer_idx}"
        if why is not None:
            return f"block {i} has {why}"
    if type(model.norm) is not RMSNorm or not _float_weight(model.norm.weight):
        return "a final norm that is not a float32 RMSNorm"
    why = _linear_problem(model.lm_head)
    return None if why is None else f"the LM head has {why}"


def check_fusable(model: MoETransformer, served: bool = False) -> None:
    """Raise :class:`~moelab.errors.InvalidValueError` naming why the fused decode step
    cannot run ``model`` (:func:`unsupported`); return when it can. ``served``: as an
    :class:`~moelab.serve.engine.Engine` serves it, its capacity-limited layers dropless
    (:mod:`moelab.serve.batching`)."""
    if served:
        with warnings.catch_warnings():  # check_batching's advice is the engine's to give
            warnings.simplefilter("ignore")
            plan = check_batching(model, 1)
        with serving_routing(plan):
            why = unsupported(model)
    else:
        why = unsupported(model)
    if why is not None:
        raise InvalidValueError(f"fused: the fused decode step cannot run this model: {why}")


def _proj(k, m: nn.Module):
    """A ``Linear``/``QuantizedLinear``/one quantized projection as the kernel's DecodeProj."""
    p = k.DecodeProj()
    if isinstance(m, QuantizedProjection):
        p.codes, p.scales = m.codes, m.scale_values
        p.bits, p.out_features = m.spec.bits, m.shape[1]
        return p
    if type(m) is QuantizedLinear:
        q = _proj(k, m.proj)
        q.bias = m.bias
        return q
    p.weight, p.bias = m.weight, m.bias
    return p


def _block(k, block: DecoderBlock):
    b = k.DecodeBlock()
    attn = block.attn
    b.attn_norm, b.ffn_norm = block.attn_norm.weight, block.ffn_norm.weight
    b.norm_eps = block.attn_norm.eps  # every norm of the block (unsupported() checks)
    b.q, b.k, b.v, b.o = (
        _proj(k, getattr(attn, n)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")
    )
    b.n_heads, b.n_kv_heads, b.head_dim = attn.n_heads, attn.n_kv_heads, attn.head_dim
    b.qk_norm = _QK_NORMS[attn.qk_norm]
    if attn.q_norm is not None:
        b.q_norm, b.k_norm = attn.q_norm.weight, attn.k_norm.weight
    ffn = block.ffn
    if type(ffn) is SwiGLUFFN:
        b.gate, b.up, b.down = (_proj(k, getattr(ffn, n)) for n in ("w_gate", "w_up", "w_down"))
        return b
    rc = ffn.router.config
    b.kind = 1
    b.router = ffn.router.weight
    if ffn.router.expert_bias is not None:
        b.expert_bias = ffn.router.expert_bias
    b.top_k, b.score_func = rc.top_k, _SCORE_FUNCS[rc.score_func]
    b.softmax_before_topk, b.norm_topk_prob = rc.softmax_before_topk, rc.norm_topk_prob
    b.routed_scaling_factor = rc.routed_scaling_factor
    ex = ffn.experts
    if type(ex) is ExpertBank:
        b.w_in, b.w_down, b.act = ex.w_in, ex.w_down, cpu_kernel.ACTIVATIONS[ex.config.activation]
    else:
        b.gate, b.up, b.down = (_proj(k, ex.projections[n]) for n in ("gate", "up", "down"))
    return b


class FusedDecode:
    """``model``'s decode step as one C++ call (module docstring), called like the model.

    Raises:
        InvalidValueError: the model is not one the fused step runs (:func:`unsupported`
            names the first part that is not).
    """

    def __init__(self, model: MoETransformer) -> None:
        check_fusable(model)
        k = cpu_kernel.kernel()
        # 8-bit activations or not (MOELAB_INT8_ACTIVATIONS) as set now, for this object's life
        self._executor = ex = k.DecodeExecutor(cpu_kernel.int8_activations())
        head = _proj(k, model.lm_head)
        ex.set_head(model.embed.weight, model.norm.weight, model.norm.eps, head,
                    float(model.cfg.logit_scale))  # fmt: skip
        for block in model.blocks:
            ex.add_block(_block(k, block))
        self._rope = model.blocks[0].attn.rope
        self._vocab = model.cfg.vocab_size
        self._experts = [
            b.ffn.router.config.num_experts if b.is_moe else None for b in model.blocks
        ]

    def __call__(
        self, input_ids: Tensor, *, kv_cache: KVCache, start_pos: int | Tensor
    ) -> DecodeOutput:
        """One decode step: ``input_ids [n, 1]`` at ``start_pos`` (an int, or int64 ``[n]``
        per-row positions with a :class:`~moelab.serve.SlotKVCache`), written into
        ``kv_cache`` like the model's forward.

        Raises:
            ValueError: more than one new position per row, ids that are not integers in
                ``[0, vocab_size)``, or the cache's own checks (rows that do not continue at
                their lengths, positions beyond its size); the cache is left unchanged.
        """
        n, s = input_ids.shape
        if s != 1:
            raise InvalidValueError(f"input_ids: a decode step takes one position, got {s}")
        ids = input_ids[:, 0].tolist()
        # checked before the cache records the new positions: a refused step changes nothing
        if input_ids.is_floating_point() or not all(0 <= i < self._vocab for i in ids):
            raise InvalidValueError(
                f"input_ids: integer ids in [0, vocab_size={self._vocab}) expected, got {ids}"
            )
        kv_cache.check(n, start_pos, 1)
        kv_cache.advance(start_pos, None, 1)
        pos = [start_pos] * n if isinstance(start_pos, int) else start_pos.tolist()
        cos, sin = self._rope.cos_sin(input_ids.device)
        row0 = getattr(kv_cache, "window", (0, n))[0]
        logits, chosen = self._executor.step(
            ids, pos, kv_cache.k, kv_cache.v, kv_cache.key_mask, row0, cos, sin
        )
        it = iter(chosen)
        records = [None if e is None else DecodeRecord(next(it), e) for e in self._experts]
        return DecodeOutput(logits=logits[:, None], records=records)

    def mode_steps(self) -> dict[str, int]:
        """This object's steps so far with their kernels' work shared by the intra-op
        threads (``"parallel"``) and on the calling thread alone (``"solo"``). A step runs all
        its kernel calls in one mode, chosen as each kernel call chooses its own
        (``csrc/kernel_common.h``: the cheaper mode by moving averages of the steps' wall time
        per row, with probes of the other), per model shape and row count and process-wide
        (:func:`moelab.core.experts.cpu_kernel.reset_scheduler` forgets it): two parallel
        steps, two solo ones, then the cheaper. On one thread every step is solo."""
        parallel, solo = self._executor.mode_steps()
        return {"parallel": parallel, "solo": solo}
