"""Forward passes that recomputation may repeat accumulate nothing, and the default forward
reads no tensor value on the host (no device sync). Both fail on the code before issue 9."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from moelab.core.config import ExpertsConfig, LossConfig, MoEConfig, RouterConfig
from moelab.core.experts.grouped_mm import _HAS_TORCH_GROUPED_MM
from moelab.core.layer import MoELayer
from moelab.core.losses import switch_balance_loss
from moelab.models import ModelConfig, MoETransformer


def _global_layer(seed=0):
    torch.manual_seed(seed)
    return MoELayer(
        MoEConfig(
            router=RouterConfig(num_experts=4, top_k=2),
            experts=ExpertsConfig(hidden_size=6, ffn_hidden_size=8, init_std=0.5),
            losses=LossConfig(load_balance="global", aux_loss_coeff=1.0, z_loss_coeff=0.0),
        )
    )


def _step(layer, micro_batches, use_checkpoint):
    """Two micro-batches of one optimizer step; returns each micro-batch's balance loss."""
    losses = []
    for x in micro_batches:
        if use_checkpoint:
            y, lb = checkpoint(
                lambda t: (lambda o: (o.hidden_states, o.aux_losses["load_balance"]))(layer(t)),
                x,
                use_reentrant=False,
            )
        else:
            out = layer(x)
            y, lb = out.hidden_states, out.aux_losses["load_balance"]
        (y.sum() + lb).backward()
        losses.append(lb.item())
        getattr(layer, "end_micro_batch", lambda: None)()
    layer.reset_loss_state()
    return losses


def test_global_balance_loss_counts_each_token_once_under_activation_checkpointing():
    torch.manual_seed(1)
    mbs = [torch.randn(9, 6), torch.randn(7, 6)]
    plain = _step(_global_layer(), mbs, use_checkpoint=False)
    ckpt = _step(_global_layer(), mbs, use_checkpoint=True)
    # reference: f of micro-batch 2 from the counts of both micro-batches, P local
    layer = _global_layer()
    with torch.no_grad():
        layer.eval()
        plans = [layer.router(x) for x in mbs]
    counts = plans[0].counts() + plans[1].counts()
    mask = torch.ones(7, dtype=torch.bool)
    want = switch_balance_loss(plans[1].probs, counts, mask).item()
    assert plain[1] == pytest.approx(want, rel=1e-6)
    assert ckpt == pytest.approx(plain, rel=1e-6)


class _NoHostReads(TorchDispatchMode):
    """Records every op that copies a tensor value to the host (``.item()``, ``int()``,
    ``bool()``, ``if tensor``): ``aten._local_scalar_dense``."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads.append(func)
        return func(*args, **(kwargs or {}))


needs_grouped_mm = pytest.mark.skipif(
    not _HAS_TORCH_GROUPED_MM, reason="needs torch.nn.functional.grouped_mm"
)


@needs_grouped_mm
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_dropless_forward_and_backward_do_not_sync(score_func):
    cfg = ModelConfig.tiny(vocab_size=32, n_layers=2, d_model=32, ffn_hidden_size=32)
    cfg.moe.router.score_func = score_func
    model = MoETransformer(cfg)
    for block in model.blocks:
        block.ffn.experts.backend = "torch"  # the accelerator backend (the CPU loop reads counts)
    ids = torch.randint(0, 32, (2, 8))
    with _NoHostReads() as mode:
        out = model.loss(ids, ids)
        out.loss.backward()
    assert mode.reads == []
    with torch.no_grad(), _NoHostReads() as mode:
        model(ids)
    assert mode.reads == []
