"""The routed expert bank: E feed-forward experts stored as stacked weights.

SwiGLU experts (Shazeer 2020, as Mixtral/Qwen/DeepSeek): ``y = (silu(x·W_g) ⊙ x·W_u)·W_d`` with
the gate and up projections fused into ``w_gate_up [E, D, 2F]`` (gate block first, then up —
the transformers v5 ``gate_up_proj`` order); GELU-MLP experts: ``y = gelu(x·W_u)·W_d``.
Weights are stored input-major (``[E, in, out]``) so each expert's matmul reads contiguous memory.

Backends (``backend``): ``"auto"`` runs the fused CPU kernel (:mod:`moelab.core.experts.cpu_kernel`:
whole expert chains as concurrent tasks, with the dispatch gather and un-permutation fused in)
for plain experts on CPU when it is available, and otherwise :func:`grouped_mm`'s own
``"auto"`` choice; ``"fused"`` requires the kernel; ``"loop"`` and ``"torch"`` force that
grouped matmul.

Other activations (``ExpertsConfig.activation``):

- ``"gelu_tanh"``: ``gelu`` with the tanh approximation (HF ``gelu_pytorch_tanh``).
- ``"geglu"``: ``(gelu_tanh(x·W_g) ⊙ x·W_u)·W_d`` (GeGLU, Shazeer 2020, with the tanh GELU
  used by HF ``hidden_act="gelu_pytorch_tanh"`` gated MLPs).
- ``"swiglu_clamped"``: GPT-OSS's expert (transformers ``GptOssExperts``):
  ``g = min(x·W_g + b_g, limit)``, ``u = clamp(x·W_u + b_u, −limit, limit)``,
  ``y = ((u + 1) ⊙ g·sigmoid(α·g))·W_d + b_d`` with limit 7, α 1.702. GPT-OSS stores gate and
  up interleaved (``gate_up[..., ::2]`` / ``[..., 1::2]``); moelab keeps its gate-block-first
  layout, so an importer de-interleaves.

With ``ExpertsConfig.bias`` each expert's projections have biases (GPT-OSS); the bias of the
expert of each sorted row is gathered by ``repeat_interleave`` with a known output size (no
host sync).

With ``ExpertsConfig.lora_rank = r`` both stacked weights carry LoRA adapters (Hu et al.,
arXiv 2106.09685, applied per expert): ``x·W_e + (α/r)·(x·A_e)·B_e`` with ``A [E, in, r]``
(PEFT's default init, Kaiming-uniform with a = √5) and ``B [E, r, out]`` zeros, so adding
adapters does not change the output. Both low-rank products run as grouped matmuls on the
same sorted rows. :mod:`moelab.models.lora` adds, freezes around and merges them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moelab.core.autocast import autocast_inputs
from moelab.core.config import GATED_ACTIVATIONS, ExpertsConfig
from moelab.core.experts import cpu_kernel
from moelab.core.experts.grouped_mm import grouped_mm
from moelab.core.experts.select import take_experts


class ExpertBank(nn.Module):
    """E experts computed on rows sorted by expert.

    Parameters:
        w_gate_up: ``[E, D, 2F]`` (gated: swiglu, geglu, swiglu_clamped) or w_up ``[E, D, F]``
            (gelu, gelu_tanh).
        w_down: ``[E, F, D]``.
        b_gate_up / b_up: ``[E, 2F]`` / ``[E, F]``, b_down: ``[E, D]`` (only with
            ``config.bias``; zeros at init).
    """

    def __init__(self, config: ExpertsConfig, num_experts: int, backend: str = "auto") -> None:
        super().__init__()
        self.config = config
        self.num_experts = num_experts
        self.backend = backend
        E, D, Fh = num_experts, config.hidden_size, config.ffn_hidden_size
        gated = config.activation in GATED_ACTIVATIONS
        width = 2 * Fh if gated else Fh
        self._in_name = "w_gate_up" if gated else "w_up"
        self.register_parameter(self._in_name, nn.Parameter(torch.empty(E, D, width)))
        self.w_down = nn.Parameter(torch.empty(E, Fh, D))
        nn.init.normal_(self.w_in, std=config.init_std)
        nn.init.normal_(self.w_down, std=config.init_std)
        if config.bias:
            self.register_parameter("b" + self._in_name[1:], nn.Parameter(torch.zeros(E, width)))
            self.b_down = nn.Parameter(torch.zeros(E, D))
        if config.lora_rank:
            r = config.lora_rank
            self.lora_A_in = nn.Parameter(torch.empty(E, D, r))
            self.lora_B_in = nn.Parameter(torch.zeros(E, r, width))
            self.lora_A_down = nn.Parameter(torch.empty(E, Fh, r))
            self.lora_B_down = nn.Parameter(torch.zeros(E, r, D))
            self.reset_lora()

    @torch.no_grad()
    def reset_lora(self) -> None:
        """PEFT's init: A ~ Kaiming-uniform (a = √5, fan-in = the input width), B = 0."""
        for a in (self.lora_A_in, self.lora_A_down):
            bound = 1.0 / math.sqrt(a.shape[1])  # kaiming_uniform_(a=√5) on fan_in
            a.uniform_(-bound, bound)
        self.lora_B_in.zero_()
        self.lora_B_down.zero_()

    def select_experts(self, index: Tensor) -> ExpertBank:
        """A copy holding only the experts ``index`` (``[n]`` int64, in that order): every
        per-expert tensor (weights, biases, LoRA adapters) cut along dim 0, each parameter's
        ``requires_grad`` and attributes kept (:func:`moelab.core.experts.select.take_experts`)."""

        def build(n: int) -> ExpertBank:
            return ExpertBank(self.config, n, self.backend)

        return take_experts(self, index, self.num_experts, build)

    @property
    def lora_scale(self) -> float:
        """``α / r`` (0 without adapters)."""
        r = self.config.lora_rank
        return self.config.lora_alpha / r if r else 0.0

    def fuses(self, x: Tensor) -> bool:
        """True when the fused CPU kernel computes these experts on ``x`` (plain experts: no
        bias, no LoRA; backend ``auto`` or ``fused``).

        Raises:
            RuntimeError: backend ``"fused"`` and the kernel cannot run ``x``.
        """
        if self.backend not in ("auto", "fused"):
            return False
        plain = not self.config.bias and not self.config.lora_rank
        ok = plain and cpu_kernel.supports(x, self.config.activation, self.w_in, self.w_down)
        if self.backend == "fused" and not ok:
            raise RuntimeError(
                "backend 'fused' needs plain CPU experts with activation in "
                f"{sorted(cpu_kernel.ACTIVATIONS)} and a built kernel "
                "(see moelab.core.experts.cpu_kernel)"
            )
        return ok

    def forward_tokens(self, x_TD: Tensor, d) -> Tensor:
        """Experts and combine of a uniform plan from the unsorted tokens (the fused path,
        when :meth:`fuses`; :func:`moelab.core.experts.cpu_kernel.fused_moe`).

        Args:
            x_TD: ``[T, D]`` tokens.
            d: the plan's :class:`~moelab.core.dispatch.Dispatched`, gathered or not.
        Returns:
            ``[T, D]`` in the combine weights' dtype (float32).
        """
        x_TD, w_in, w_down = autocast_inputs(x_TD, self.w_in, self.w_down)
        return cpu_kernel.fused_moe(
            x_TD,
            w_in,
            w_down,
            self.config.activation,
            d.counts,
            d.token_idx,
            d.order,
            d.pair_weight,
            d.top_k,
        )

    def _project(self, x: Tensor, w: Tensor, counts: Tensor, which: str) -> Tensor:
        # the kernel runs whole chains; when activations are wanted the chain is split here
        backend = "auto" if self.backend == "fused" else self.backend
        y = grouped_mm(x, w, counts, backend)
        if self.config.lora_rank:
            _, a, b = autocast_inputs(
                x, getattr(self, f"lora_A_{which}"), getattr(self, f"lora_B_{which}")
            )
            low = grouped_mm(grouped_mm(x, a, counts, backend), b, counts, backend)
            y = y + self.lora_scale * low
        return y

    def merged_weight(self, which: str) -> Tensor:
        """``W + (α/r)·A@B`` of ``"in"`` or ``"down"`` (the weight itself without adapters)."""
        w = self.w_in if which == "in" else self.w_down
        if not self.config.lora_rank:
            return w
        a, b = getattr(self, f"lora_A_{which}"), getattr(self, f"lora_B_{which}")
        return w + self.lora_scale * torch.bmm(a, b)

    @property
    def w_in(self) -> nn.Parameter:
        """The input projection (``w_gate_up`` or ``w_up``)."""
        return getattr(self, self._in_name)

    @property
    def b_in(self) -> nn.Parameter | None:
        """The input projection's bias ``[E, width]`` (None without ``config.bias``)."""
        return getattr(self, "b" + self._in_name[1:]) if self.config.bias else None

    def activation(self, h: Tensor) -> Tensor:
        """The expert nonlinearity on the input projection ``h`` (``[.., 2F]`` for gated
        activations, gate block first; ``[.., F]`` otherwise); see the module docstring."""
        act = self.config.activation
        if act == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            return F.silu(gate) * up
        if act == "geglu":
            gate, up = h.chunk(2, dim=-1)
            return F.gelu(gate, approximate="tanh") * up
        if act == "swiglu_clamped":
            limit, alpha = self.config.swiglu_limit, self.config.swiglu_alpha
            gate, up = h.chunk(2, dim=-1)
            gate = gate.clamp(max=limit)
            up = up.clamp(min=-limit, max=limit)
            return (up + 1) * (gate * torch.sigmoid(alpha * gate))
        if act == "gelu_tanh":
            return F.gelu(h, approximate="tanh")
        return F.gelu(h)

    def forward(
        self, x_ND: Tensor, counts: Tensor, return_activations: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Apply expert e to its block of rows.

        Args:
            x_ND: ``[N, D]`` rows sorted by expert, in the weights' dtype.
            counts: ``[E]`` int64 rows per expert (sums to N).
            return_activations: also return the intermediate activations ``[N, F]``
                (``silu(gate) ⊙ up`` for swiglu, ``gelu(up)`` for gelu), row-aligned with
                ``x_ND`` (the specialization loss reads them; no extra compute).
        Returns:
            ``[N, D]`` expert outputs in the same order, or ``(outputs, activations)``.
        """
        fuse = not return_activations and self.fuses(x_ND)
        x_ND, w_in, w_down, b_in, b_down = autocast_inputs(
            x_ND, self.w_in, self.w_down, self.b_in, getattr(self, "b_down", None)
        )
        if fuse:
            return cpu_kernel.fused_experts(x_ND, w_in, w_down, counts, self.config.activation)
        h = self._project(x_ND, w_in, counts, "in")
        expert_of_row = None
        if self.config.bias:
            E = self.num_experts
            expert_of_row = torch.repeat_interleave(
                torch.arange(E, device=x_ND.device), counts, output_size=x_ND.shape[0]
            )
            h = h + b_in[expert_of_row]
        a = self.activation(h)
        y = self._project(a, w_down, counts, "down")
        if expert_of_row is not None:
            y = y + b_down[expert_of_row]
        return (y, a) if return_activations else y

    def expert_output(self, x_TD: Tensor, expert: int) -> Tensor:
        """Output of one expert on all tokens ``[T, D]`` (analysis: expert redundancy)."""
        h = x_TD @ self.merged_weight("in")[expert]
        if self.config.bias:
            h = h + self.b_in[expert]
        y = self.activation(h) @ self.merged_weight("down")[expert]
        return y + self.b_down[expert] if self.config.bias else y


class SharedExpert(nn.Module):
    """An always-on dense SwiGLU expert (DeepSeekMoE; Qwen2-MoE adds a sigmoid gate).

    ``y = g(x) · (silu(x·W_g) ⊙ x·W_u)·W_d`` with ``g(x) = sigmoid(x·w_gate)`` when gated, else 1.
    """

    def __init__(
        self, hidden_size: int, ffn_hidden_size: int, gated: bool, init_std: float
    ) -> None:
        super().__init__()
        self.w_gate_up = nn.Parameter(torch.empty(hidden_size, 2 * ffn_hidden_size))
        self.w_down = nn.Parameter(torch.empty(ffn_hidden_size, hidden_size))
        self.gate = nn.Parameter(torch.empty(1, hidden_size)) if gated else None
        for p in self.parameters():
            nn.init.normal_(p, std=init_std)

    def forward(self, x_TD: Tensor) -> Tensor:
        gate, up = (x_TD @ self.w_gate_up).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ self.w_down
        if self.gate is not None:
            y = torch.sigmoid(F.linear(x_TD, self.gate)) * y
        return y
