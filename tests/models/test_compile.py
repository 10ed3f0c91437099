"""``torch.compile(model)`` for inference and training. The dropless forward and the loss
trace into one graph (``fullgraph=True``) when the experts use the ``torch`` grouped-matmul
backend (the accelerator path; on CPU its meta kernel needs bfloat16); the CPU ``loop``
backend reads the per-expert counts on the host and compiles with graph breaks."""

from __future__ import annotations

import pytest
import torch

from moelab.models import ModelConfig, MoETransformer


def _model(dtype, backend):
    torch.manual_seed(0)
    model = MoETransformer(ModelConfig.tiny(vocab_size=40, n_layers=2)).to(dtype)
    for block in model.blocks:
        block.ffn.experts.backend = backend
    return model


@pytest.mark.slow
def test_fullgraph_compile_matches_eager_forward_and_gradients():
    torch._dynamo.reset()
    model = _model(torch.bfloat16, "torch")
    ids = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        assert torch.equal(compiled(ids).logits, model(ids).logits)
    loss_fn = torch.compile(lambda a, b: model.loss(a, b).loss, fullgraph=True, backend="aot_eager")
    loss = loss_fn(ids, ids.roll(-1, 1))
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    want_loss = model.loss(ids, ids.roll(-1, 1)).loss
    want_loss.backward()
    assert loss.item() == pytest.approx(want_loss.item(), rel=1e-2)
    for n, p in model.named_parameters():
        assert torch.allclose(got[n].float(), p.grad.float(), atol=2e-2, rtol=5e-2), n


@pytest.mark.slow
def test_compile_with_graph_breaks_on_the_cpu_loop_backend():
    torch._dynamo.reset()
    model = _model(torch.float32, "loop")
    ids = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(2))
    compiled = torch.compile(model, backend="aot_eager")
    out = compiled(ids)
    assert torch.allclose(out.logits, model(ids).logits, atol=1e-5)
    out.logits.sum().backward()
    assert model.blocks[0].ffn.router.weight.grad.abs().sum() > 0
