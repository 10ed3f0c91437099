"""Speculative exploration for hot tokens (TEAM's SEH): branches in one batched forward.

As the authors' ``block_diffusion_generate`` (PKU-SEC-Lab/TEAM-MoE-dLLM): from the previous
step's predictions take the two most confident still-masked positions p1, p2 and build
B0 = the block, B1 = B0 with p1 filled, B2 = B0 with p2 filled, B3 = both filled; the
branches are concatenated into one input with shared positions and an attention mask that lets
each branch see the cached prefix and itself only. Acceptance (step 5-6 of the note):

    a1  = B0 transfers p1 and B0's prediction at p1 equals B1's fill
    a2  = B0 transfers p2 and B0's prediction at p2 equals B2's fill
    a12 = B1 transfers p2 and B1's prediction at p2 equals B2's fill
    a21 = B2 transfers p1 and B2's prediction at p1 equals B1's fill
    choose B3 if (a1∧a2) ∨ (a1∧a12) ∨ (a2∧a21); else B1 if a1; else B2 if a2; else B0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moelab.models import MoETransformer
from moelab.models.block_diffusion import MoEHook, PrefixKV, diffusion_forward


def build_branches(block: Tensor, p1: int, p2: int, fill1: int, fill2: int) -> Tensor:
    """``block [b]`` → ``[4, b]``: B0, B1 (p1 filled), B2 (p2 filled), B3 (both)."""
    br = block.unsqueeze(0).repeat(4, 1)
    br[1, p1] = fill1
    br[2, p2] = fill2
    br[3, p1], br[3, p2] = fill1, fill2
    return br


def branch_mask(num_branches: int, block_size: int, prefix_len: int, device=None) -> Tensor:
    """Bool ``[n·b, P + n·b]``: every row sees the prefix; row of branch i sees branch i."""
    n, b = num_branches, block_size
    br = torch.arange(n * b, device=device) // b
    own = br[:, None] == br[None, :]
    pre = torch.ones(n * b, prefix_len, dtype=torch.bool, device=device)
    return torch.cat([pre, own], dim=1)


def branch_forward(
    model: MoETransformer,
    branches: Tensor,
    start: int,
    prefix: PrefixKV | None,
    moe_hook: MoEHook | None = None,
) -> Tensor:
    """Logits ``[n, b, V]`` of ``branches [n, b]`` (one block at absolute ``start``), all in
    one forward of ``n·b`` rows."""
    n, b = branches.shape
    P = prefix.length if prefix is not None else 0
    pos = torch.arange(start, start + b, device=branches.device).repeat(n)
    out = diffusion_forward(
        model,
        branches.reshape(1, n * b),
        pos,
        branch_mask(n, b, P, branches.device),
        prefix=prefix,
        moe_hook=moe_hook,
    )
    return out.logits.view(n, b, -1)


def choose_branch(transfer: Tensor, pred: Tensor, p1: int, p2: int, fill1: int, fill2: int) -> int:
    """The authors' acceptance rule. ``transfer [4, b]`` bool (each branch's own transfer
    set), ``pred [4, b]`` argmax tokens. Returns the branch index 0-3."""
    a1 = bool(transfer[0, p1]) and int(pred[0, p1]) == fill1
    a2 = bool(transfer[0, p2]) and int(pred[0, p2]) == fill2
    a12 = bool(transfer[1, p2]) and int(pred[1, p2]) == fill2
    a21 = bool(transfer[2, p1]) and int(pred[2, p1]) == fill1
    if (a1 and a2) or (a1 and a12) or (a2 and a21):
        return 3
    if a1:
        return 1
    if a2:
        return 2
    return 0
