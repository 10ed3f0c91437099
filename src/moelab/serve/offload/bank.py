"""An expert bank whose weights live in a lossless store: the drop-in replacement for
:class:`moelab.core.experts.ExpertBank` inside each :class:`moelab.core.layer.MoELayer` of an
offloaded model.

The computation is the in-memory bank's, on bit-identical weights. Where the fused CPU kernel
runs (:mod:`moelab.core.experts.cpu_kernel`), each expert's rows go through it as one
single-expert call; the kernel computes a decode-sized fp32 expert (1-8 rows) independently of
the other experts, so decoding is bit-identical to the all-in-memory model. (A larger expert
goes to MKL, single-threaded inside the in-memory call and multi-threaded here, and may then
differ in the last bit.) Elsewhere the bank follows the PyTorch loop (``grouped_mm`` backend
``loop``) step for step, bit for bit: one ``torch.mm`` per expert block into a preallocated
``[N, 2F]`` buffer, the activation on the whole buffer, one ``torch.mm`` per block for the down
projection. Experts are multiplied as soon as their weights are ready, overlapping the matmuls
with the loads still in flight.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moelab.core.config import GATED_ACTIVATIONS, ExpertsConfig
from moelab.core.experts import cpu_kernel
from moelab.core.experts.bank import ExpertBank
from moelab.errors import InvalidValueError
from moelab.serve.offload.engine import OffloadEngine


class OffloadedExpertBank(nn.Module):
    """E experts of MoE layer ``layer`` served by ``engine`` (inference only; no parameters).

    Forward: ``x_ND [N, D]`` rows sorted by expert, ``counts [E]`` int64 → ``[N, D]``.

    Raises:
        ValueError: ``return_activations`` (training features need the in-memory bank).
    """

    def __init__(
        self, engine: OffloadEngine, layer: int, config: ExpertsConfig, num_experts: int
    ) -> None:
        super().__init__()
        self.engine = engine
        self.layer = layer
        self.config = config
        self.num_experts = num_experts
        gated = config.activation in GATED_ACTIVATIONS
        self.first = "w_gate_up" if gated else "w_up"
        self.width = 2 * config.ffn_hidden_size if gated else config.ffn_hidden_size

    def extra_repr(self) -> str:
        return f"layer={self.layer}, num_experts={self.num_experts}, offloaded"

    def forward(self, x_ND: Tensor, counts: Tensor, return_activations: bool = False) -> Tensor:
        if return_activations:
            raise InvalidValueError("return_activations: offloaded experts are inference-only")
        c = counts.tolist()
        starts = [0]
        for n in c:
            starts.append(starts[-1] + n)
        if cpu_kernel.supports(x_ND, self.config.activation):
            return self._fused(x_ND, c, starts)
        h = x_ND.new_empty(x_ND.shape[0], self.width)
        down: dict[int, Tensor] = {}
        for e, w in self.engine.fetch(self.layer, c):
            rows = slice(starts[e], starts[e + 1])
            w_in = w[self.first].to(x_ND.device)
            torch.mm(x_ND[rows], w_in, out=h[rows])
            down[e] = w["w_down"].to(x_ND.device)
        a = ExpertBank.activation(self, h)  # the in-memory bank's nonlinearity (reads .config)
        y = x_ND.new_empty(x_ND.shape[0], self.config.hidden_size)
        for e in sorted(down):
            rows = slice(starts[e], starts[e + 1])
            torch.mm(a[rows], down[e], out=y[rows])
        return y

    def _fused(self, x_ND: Tensor, c: list[int], starts: list[int]) -> Tensor:
        y = x_ND.new_empty(x_ND.shape[0], self.config.hidden_size)
        for e, w in self.engine.fetch(self.layer, c):
            rows = slice(starts[e], starts[e + 1])
            y[rows] = cpu_kernel.fused_experts(  # CPU only, like the store's weights
                x_ND[rows],
                w[self.first][None],
                w["w_down"][None],
                torch.tensor([c[e]]),
                self.config.activation,
            )
        return y
