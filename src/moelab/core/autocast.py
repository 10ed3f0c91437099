"""The MoE core under mixed precision (``torch.autocast``).

The experts' GEMMs run in the autocast dtype, as a dense FFN's ``nn.Linear`` does; but their
backends (the per-expert loop's ``torch.mm(out=...)``, the fused CPU kernel) are calls that
autocast does not see, so the bank casts its inputs itself (:func:`autocast_inputs`). The
router runs in float32, as Megatron-Core's ``moe_router_dtype=fp32`` and DeepSeek-V3's gate
do: top-k selection on bf16 logits flips near-ties between experts, and the load-balancing
and z-losses are sums over many small probabilities.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch import Tensor


def autocast_off(device: torch.device) -> AbstractContextManager:
    """``torch.autocast(device.type, enabled=False)``; a no-op context on devices without
    autocast (e.g. ``meta``)."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return nullcontext()


def autocast_inputs(*tensors: Tensor | None) -> tuple[Tensor | None, ...]:
    """The tensors as a GEMM under the first one's device autocast would take them: float32
    ones cast to the autocast dtype (a differentiable cast, whose backward returns float32
    gradients), the rest as they are; all unchanged when autocast is off. None passes through.
    """
    device = tensors[0].device.type
    if not (torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if t is not None and t.dtype == torch.float32 else t for t in tensors)
