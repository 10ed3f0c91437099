"""The decode-sized dense projection (``cpu_kernel.dense_rows``) against a float64 reference,
its row- and thread-independence, and when ``models.linear.Linear`` takes it."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moelab.core.experts import cpu_kernel
from moelab.models import ModelConfig, MoETransformer
from moelab.models.linear import Linear

needs_kernel = pytest.mark.skipif(cpu_kernel.kernel() is None, reason="no C++ toolchain")


def weights(N, K, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) / K**0.5
    b = torch.randn(N, generator=g) if bias else None
    return w, b


@needs_kernel
@pytest.mark.parametrize("M", range(1, 9))
@pytest.mark.parametrize(("N", "K"), [(37, 83), (256, 576), (7, 16), (130, 31)])
def test_dense_rows_matches_float64_reference(M, N, K):
    # N not a multiple of the 4-row tile, K not of the 16 lanes: the remainder paths too
    w, b = weights(N, K, seed=M)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(100 + M))
    want = F.linear(x.double(), w.double(), b.double())
    got = cpu_kernel.dense_rows(x, w, b)
    assert got.dtype == torch.float32 and got.shape == (M, N)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    no_bias = cpu_kernel.dense_rows(x, w)
    torch.testing.assert_close(
        no_bias.double(), F.linear(x.double(), w.double()), rtol=1e-5, atol=1e-5
    )


@needs_kernel
def test_a_rows_values_do_not_depend_on_its_neighbours_or_the_threads():
    w, b = weights(1000, 576)
    x = torch.randn(8, 576, generator=torch.Generator().manual_seed(1))
    batched = cpu_kernel.dense_rows(x, w, b)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for m in range(8):
                alone = cpu_kernel.dense_rows(x[m : m + 1], w, b)
                assert torch.equal(alone[0], batched[m])
            # leading dimensions are kept: [2, 3, K] is six rows
            assert torch.equal(
                cpu_kernel.dense_rows(x[:6].view(2, 3, 576), w, b), batched[:6].view(2, 3, 1000)
            )
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_dense_rows_many_gives_each_weight_what_dense_rows_gives_it_alone():
    # several projections of one input in one parallel region (the fused decode step's q/k/v):
    # each output block computed as dense_rows computes it, bit for bit, with or without bias
    # K = 100: the 16-lane loop and its scalar tail; one and two threads: other block splits
    ws = [weights(n, 100, seed=n) for n in (40, 8, 13)]
    biases = [ws[0][1], None, ws[2][1]]
    many = cpu_kernel.kernel().dense_rows_many
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for M in (1, 3, 6, 8):
                x = torch.randn(M, 100, generator=torch.Generator().manual_seed(M))
                got = many(x, [w for w, _ in ws], biases)
                assert [g.shape for g in got] == [(M, 40), (M, 8), (M, 13)]
                for (w, _), b, g in zip(ws, biases, got, strict=True):
                    assert torch.equal(g, cpu_kernel.dense_rows(x, w, b))
                    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
                    torch.testing.assert_close(g.double(), ref, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(threads)
    x = torch.randn(1, 100)
    with pytest.raises(RuntimeError, match=r"w must be contiguous \[N, 100\]"):
        many(x, [ws[0][0], torch.randn(4, 95)], [None, None])
    with pytest.raises(RuntimeError, match="one bias"):
        many(x, [ws[0][0]], [None, None])
    with pytest.raises(RuntimeError, match="bias must be"):
        many(x, [ws[0][0]], [torch.randn(39)])


@needs_kernel
def test_dense_rows_refuses_what_it_cannot_run():
    w, _ = weights(16, 32, bias=False)
    with pytest.raises(RuntimeError, match="x must be contiguous"):
        cpu_kernel.dense_rows(torch.randn(9, 32), w)  # 9 rows
    with pytest.raises(RuntimeError, match="float32 only"):
        cpu_kernel.dense_rows(torch.randn(1, 32, dtype=torch.float64), w.double())
    with pytest.raises(RuntimeError, match=r"w must be contiguous \[N, 32\]"):
        cpu_kernel.dense_rows(torch.randn(1, 32), torch.randn(32, 16).t())
    with pytest.raises(RuntimeError, match="bias must be"):
        cpu_kernel.dense_rows(torch.randn(1, 32), w, torch.randn(15))


@needs_kernel
def test_dense_rows_apply_only_to_float32_inference_on_a_few_rows():
    w = nn.Parameter(torch.randn(16, 32))
    x = torch.randn(8, 32)
    with torch.no_grad():
        assert cpu_kernel.dense_rows_apply(x, w, None)
        assert not cpu_kernel.dense_rows_apply(torch.randn(9, 32), w, None)  # prefill: MKL
        assert not cpu_kernel.dense_rows_apply(x.double(), w.double(), None)
        assert not cpu_kernel.dense_rows_apply(x, w, torch.randn(16, dtype=torch.float64))
        assert not cpu_kernel.dense_rows_apply(x, w.t().contiguous().t(), None)  # strided
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not cpu_kernel.dense_rows_apply(x, w, None)
    assert not cpu_kernel.dense_rows_apply(x, w, None)  # the weight wants a gradient
    with torch.inference_mode():
        assert cpu_kernel.dense_rows_apply(x, w, None)


@needs_kernel
def test_linear_is_nn_linear_with_the_kernel_at_decode(monkeypatch):
    torch.manual_seed(0)
    ref = nn.Linear(40, 24)
    lin = Linear(40, 24)
    lin.load_state_dict(ref.state_dict())
    assert isinstance(lin, nn.Linear) and lin.state_dict().keys() == ref.state_dict().keys()
    calls = []
    real = cpu_kernel.dense_rows
    monkeypatch.setattr(cpu_kernel, "dense_rows", lambda *a: calls.append(a) or real(*a))
    x = torch.randn(3, 40)
    y = lin(x)  # training mode, gradients on: F.linear, bit for bit
    assert torch.equal(y, ref(x)) and y.requires_grad and not calls
    with torch.no_grad():
        got = lin(x)
        assert len(calls) == 1
        torch.testing.assert_close(got, ref(x), rtol=1e-5, atol=1e-6)
        lin(torch.randn(9, 40))  # more rows than a decode step: F.linear
        assert len(calls) == 1


@needs_kernel
def test_the_lm_runs_its_projections_through_the_kernel_at_decode(monkeypatch):
    torch.manual_seed(0)
    model = MoETransformer(ModelConfig.tiny(vocab_size=64, max_seq_len=32)).eval()
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "lm_head")
    projections = [m for n, m in model.named_modules() if n.endswith(names)]
    assert projections and all(type(m) is Linear for m in projections)
    ids = torch.randint(0, 64, (2, 12))
    calls = []
    real = cpu_kernel.dense_rows
    monkeypatch.setattr(cpu_kernel, "dense_rows", lambda *a: calls.append(a) or real(*a))
    with torch.inference_mode():
        full = model(ids).logits  # 24 rows: MKL
        assert not calls
        first = model(ids[:, :1]).logits  # 2 rows: the kernel, every projection
    assert len(calls) == len(projections)
    torch.testing.assert_close(first[:, 0], full[:, 0], rtol=1e-5, atol=1e-5)
