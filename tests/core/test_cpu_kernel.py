"""The fused CPU expert kernel against a per-expert float64 reference, and its fallback."""

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moelab.core.config import ExpertsConfig, LossConfig, MoEConfig, RouterConfig
from moelab.core.experts import cpu_kernel
from moelab.core.layer import MoELayer

needs_kernel = pytest.mark.skipif(cpu_kernel.kernel() is None, reason="no C++ toolchain")


def expert_rows(rows, w_in, w_down, counts, activation):
    """Slow reference: one expert at a time on rows sorted by expert."""
    Fh = w_down.shape[1]
    outs, start = [], 0
    for e, c in enumerate(counts.tolist()):
        h = rows[start : start + c] @ w_in[e]
        if activation == "swiglu":
            a = F.silu(h[:, :Fh]) * h[:, Fh:]
        elif activation == "geglu":
            a = F.gelu(h[:, :Fh], approximate="tanh") * h[:, Fh:]
        elif activation == "gelu":
            a = F.gelu(h)
        else:
            a = F.gelu(h, approximate="tanh")
        outs.append(a @ w_down[e])
        start += c
    return torch.cat(outs)


def token_reference(x, w_in, w_down, counts, activation, order, pair_weight, k):
    """out[t] = Σ_j w[t·k + j] · expert(x[t]) by plain gather, scatter and sum."""
    y = expert_rows(x[order // k], w_in, w_down, counts, activation)
    y_pairs = torch.zeros_like(y).index_copy(0, order, y)
    return (pair_weight.unsqueeze(1) * y_pairs).view(x.shape[0], k, -1).sum(1)


def problem(activation, T=13, k=3, E=5, D=6, Fh=4, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = 2 * Fh if activation in ("swiglu", "geglu") else Fh
    x = torch.randn(T, D, generator=g, dtype=dtype, requires_grad=True)
    w_in = torch.randn(E, D, W, generator=g, dtype=dtype, requires_grad=True)
    w_down = torch.randn(E, Fh, D, generator=g, dtype=dtype, requires_grad=True)
    pair_weight = torch.rand(T * k, generator=g, dtype=dtype, requires_grad=True)
    expert_idx = torch.randint(0, E - 1, (T * k,), generator=g)  # expert E-1 gets no rows
    order = torch.argsort(expert_idx, stable=True)
    counts = torch.bincount(expert_idx, minlength=E)
    return x, w_in, w_down, pair_weight, counts, order, k


@contextlib.contextmanager
def intra_op_threads(n):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def check_against(fn, ref, inputs):
    y, want = fn(*inputs), ref(*inputs)
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(want)
    got = torch.autograd.grad(y, inputs, g)
    exp = torch.autograd.grad(want, inputs, g)
    for a, b in zip(got, exp, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(fn, tuple(t.detach().requires_grad_() for t in inputs))
    return got


@needs_kernel
@pytest.mark.parametrize("activation", sorted(cpu_kernel.ACTIVATIONS))
def test_sorted_rows_equal_the_reference_forward_and_backward(activation):
    x, w_in, w_down, _, counts, order, k = problem(activation)
    rows = x[order // k].detach().requires_grad_()
    got = check_against(
        lambda *t: cpu_kernel.fused_experts(*t, counts, activation),
        lambda *t: expert_rows(*t, counts, activation),
        (rows, w_in, w_down),
    )
    assert torch.count_nonzero(got[1][-1]) == 0 and torch.count_nonzero(got[2][-1]) == 0


@needs_kernel
@pytest.mark.parametrize("activation", sorted(cpu_kernel.ACTIVATIONS))
def test_token_path_equals_gather_experts_scatter_and_combine(activation):
    x, w_in, w_down, pair_weight, counts, order, k = problem(activation)
    token_idx = order // k
    got = check_against(
        lambda x, a, b, w: cpu_kernel.fused_moe(
            x, a, b, activation, counts, token_idx, order, w, k
        ),
        lambda x, a, b, w: token_reference(x, a, b, counts, activation, order, w, k),
        (x, w_in, w_down, pair_weight),
    )
    assert torch.count_nonzero(got[1][-1]) == 0 and torch.count_nonzero(got[2][-1]) == 0


@needs_kernel
def test_tiled_experts_and_thread_counts_give_the_same_values():
    x, w_in, w_down, pw, counts, order, k = problem("swiglu", T=64, k=2, E=3, dtype=torch.float32)
    args = (x, w_in, w_down, "swiglu", counts, order // k, order, pw, k)
    base = cpu_kernel.fused_moe(*args)
    act, n = cpu_kernel.ACTIVATIONS["swiglu"], int(counts.sum())
    pairs = [
        cpu_kernel.kernel().experts_forward(
            x, w_in, w_down, counts.tolist(), act, order // k, order, n, False, max_rows
        )[0]
        for max_rows in (0, 5)  # the kernel's own tiles; every expert split into tiles of 5
    ]
    with intra_op_threads(1):
        single = cpu_kernel.fused_moe(*args)
    torch.testing.assert_close(pairs[1], pairs[0], rtol=1e-6, atol=1e-6)
    combined = (pw.view(-1, 1, k) @ pairs[1].view(-1, k, x.shape[1])).squeeze(1)
    torch.testing.assert_close(combined, base, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(single, base, rtol=1e-6, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("activation", sorted(cpu_kernel.ACTIVATIONS))
@pytest.mark.parametrize("E", [13, 12])
def test_decode_sized_float32_rows_equal_the_float64_reference(activation, E):
    """Experts with 1-8 rows take the kernel's own streaming projections, in parts over F,
    more rows MKL's GEMM: counts 0..E-1 cross that line. On 2 threads the 8 decode-sized
    experts of E = 13 are whole work items, the 7 of E = 12 one item per part. D = 37 leaves
    a tail of the 4-row unrolling, F = 531 (W = 1062 gated) tails of the 1024- and 4096-column
    accumulator blocks and an uneven split, and 9 and 10 rows (GEMM) a tail of the GEMM tiles.
    The gradients run through the projections the items saved."""
    g = torch.Generator().manual_seed(3)
    D, Fh = 37, 531
    W = 2 * Fh if activation in ("swiglu", "geglu") else Fh
    counts = torch.arange(E)
    x = torch.randn(int(counts.sum()), D, generator=g, requires_grad=True)
    w_in = (torch.randn(E, D, W, generator=g) / D**0.5).requires_grad_()
    w_down = (torch.randn(E, Fh, D, generator=g) / Fh**0.5).requires_grad_()
    with intra_op_threads(2):
        got = cpu_kernel.fused_experts(x, w_in, w_down, counts, activation)
    ref_in = [t.detach().double().requires_grad_() for t in (x, w_in, w_down)]
    want = expert_rows(*ref_in, counts, activation)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    dy = torch.randn(got.shape, generator=g)
    grads = torch.autograd.grad(got, (x, w_in, w_down), dy)
    ref_grads = torch.autograd.grad(want, ref_in, dy.double())
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("activation", sorted(cpu_kernel.ACTIVATIONS))
def test_a_decode_rows_value_does_not_depend_on_the_rows_beside_it(activation):
    """Up to 8 rows each row's sums and activation run in one fixed order, so a batched greedy
    decode gives bit-identical rows to decoding each sequence alone."""
    g = torch.Generator().manual_seed(4)
    D, Fh = 24, 40
    W = 2 * Fh if activation in ("swiglu", "geglu") else Fh
    w_in = torch.randn(1, D, W, generator=g)
    w_down = torch.randn(1, Fh, D, generator=g)
    x = torch.randn(8, D, generator=g)
    with torch.inference_mode():
        together = cpu_kernel.fused_experts(x, w_in, w_down, torch.tensor([8]), activation)
        for r in range(8):
            alone = cpu_kernel.fused_experts(
                x[r : r + 1], w_in, w_down, torch.tensor([1]), activation
            )
            assert torch.equal(alone[0], together[r])


@needs_kernel
@pytest.mark.parametrize("activation", sorted(cpu_kernel.ACTIVATIONS))
@pytest.mark.parametrize("Fh", [40, 531])
def test_whole_expert_and_per_part_items_give_the_same_bits(activation, Fh):
    """Decode-sized experts are whole work items when they divide evenly among the threads
    and one item per part of F otherwise; either way every row gets the same sums in the
    same order. Two experts on 2 threads are whole items, a third expert splits all three;
    one thread runs every expert whole."""
    g = torch.Generator().manual_seed(5)
    D = 24
    W = 2 * Fh if activation in ("swiglu", "geglu") else Fh
    w_in = torch.randn(3, D, W, generator=g)
    w_down = torch.randn(3, Fh, D, generator=g)
    x = torch.randn(9, D, generator=g)
    with torch.inference_mode():
        with intra_op_threads(2):
            whole = cpu_kernel.fused_experts(
                x[:6], w_in, w_down, torch.tensor([3, 3, 0]), activation
            )
            parts = cpu_kernel.fused_experts(x, w_in, w_down, torch.tensor([3, 3, 3]), activation)
        with intra_op_threads(1):
            single = cpu_kernel.fused_experts(x, w_in, w_down, torch.tensor([3, 3, 3]), activation)
    assert torch.equal(whole, parts[:6])
    assert torch.equal(single, parts)


@needs_kernel
def test_solo_calls_give_the_parallel_calls_values_bit_for_bit():
    """A solo call (the scheduler's choice on a busy machine) runs every item on the
    calling thread: decode-sized experts (the kernel's own projections) give the same bits as
    the parallel run, forward and backward; larger ones (MKL, which may thread a GEMM called
    outside a parallel region) the same values to rounding. The counters say which ran how."""
    with intra_op_threads(2):
        try:
            for T in (1, 3, 64):
                x, w_in, w_down, pw, counts, order, k = problem(
                    "swiglu", T=T, k=2, E=4, dtype=torch.float32
                )
                args = (x, w_in, w_down, "swiglu", counts, order // k, order, pw, k)
                cpu_kernel.reset_scheduler(0)
                parallel = cpu_kernel.fused_moe(*args)
                grads = torch.autograd.grad(parallel.sum(), (x, w_in, w_down))
                stats = cpu_kernel.scheduler_stats()
                assert stats["parallel_calls"] + stats["solo_calls"] == 2  # forward, backward
                cpu_kernel.reset_scheduler(2)
                solo = cpu_kernel.fused_moe(*args)
                solo_grads = torch.autograd.grad(solo.sum(), (x, w_in, w_down))
                stats = cpu_kernel.scheduler_stats()
                assert (stats["parallel_calls"], stats["solo_calls"], stats["forced_solo"]) == (
                    0,
                    2,
                    0,
                )
                same = torch.equal if T <= 3 else torch.allclose  # T <= 3: <= 6 rows per expert
                assert same(solo, parallel)
                for a, b in zip(solo_grads, grads, strict=True):
                    assert same(a, b)
        finally:
            cpu_kernel.reset_scheduler(0)
    with pytest.raises(RuntimeError, match="solo_calls"):
        cpu_kernel.reset_scheduler(-1)


@needs_kernel
def test_the_scheduler_measures_both_modes_on_decode_calls_only():
    """Decode-sized inference calls are timed in both modes (a run of parallel calls, then a
    run of solo ones) before the cheaper one is chosen; a training call (saved projections)
    or a prefill-sized expert leaves the measurements alone."""
    with intra_op_threads(2):
        try:
            x, w_in, w_down, pw, counts, order, k = problem(
                "swiglu", T=3, k=2, E=4, dtype=torch.float32
            )
            args = (x, w_in, w_down, "swiglu", counts, order // k, order, pw, k)
            plain = [a.detach() if torch.is_tensor(a) else a for a in args]
            cpu_kernel.reset_scheduler(0)
            cpu_kernel.fused_moe(*args)  # x requires grad: a training call
            assert cpu_kernel.scheduler_stats()["parallel_ns_per_item"] == 0
            seen = []
            with torch.no_grad():
                for _ in range(4):
                    cpu_kernel.fused_moe(*plain)
                    seen.append(cpu_kernel.scheduler_stats())
                big = problem("swiglu", T=64, k=1, E=2, dtype=torch.float32)
                cpu_kernel.fused_moe(
                    *(a.detach() for a in big[:3]), "swiglu", big[4], big[5], big[5],
                    big[3].detach(), 1,
                )  # fmt: skip
                after = cpu_kernel.scheduler_stats()
            assert [s["solo_calls"] for s in seen] == [0, 0, 1, 2]  # 2 parallel, then 2 solo
            assert seen[1]["parallel_ns_per_item"] > 0 and seen[1]["solo_ns_per_item"] == 0
            assert seen[3]["solo_ns_per_item"] > 0
            assert (after["parallel_ns_per_item"], after["solo_ns_per_item"]) == (
                seen[3]["parallel_ns_per_item"], seen[3]["solo_ns_per_item"],
            )  # fmt: skip
        finally:
            cpu_kernel.reset_scheduler(0)


@needs_kernel
def test_each_call_shape_keeps_its_own_scheduler_measurements():
    """A decode step mixes calls whose items cost very differently, so the scheduler compares
    the modes per shape of call: after a shape's warm-up (2 parallel, 2 solo calls) the first
    call of another shape starts that shape's own warm-up (parallel; its solo average
    unmeasured) instead of reading the first shape's averages. The widths differ by 64, which
    a slot hash keeping only the low bits of its product would not tell apart."""
    with intra_op_threads(2), torch.no_grad():
        try:
            shapes = [problem("swiglu", T=3, k=2, E=4, D=D, dtype=torch.float32) for D in (6, 70)]
            calls = [
                (x.detach(), w_in.detach(), w_down.detach(), "swiglu", counts, order // k,
                 order, pw.detach(), k)
                for x, w_in, w_down, pw, counts, order, k in shapes
            ]  # fmt: skip
            cpu_kernel.reset_scheduler(0)
            for _ in range(4):
                cpu_kernel.fused_moe(*calls[0])
            first = cpu_kernel.scheduler_stats()
            assert (first["solo_calls"], first["parallel_calls"]) == (2, 2)
            assert first["solo_ns_per_item"] > 0
            cpu_kernel.fused_moe(*calls[1])
            other = cpu_kernel.scheduler_stats()
            assert (other["solo_calls"], other["parallel_calls"]) == (2, 3)
            assert other["parallel_ns_per_item"] > 0 and other["solo_ns_per_item"] == 0
        finally:
            cpu_kernel.reset_scheduler(0)


@needs_kernel
def test_bad_indices_and_shapes_are_refused_before_any_copy():
    x, w_in, w_down, pw, counts, order, k = problem("gelu")
    x, w_in, w_down, pw = (t.detach() for t in (x, w_in, w_down, pw))
    bad = (order // k).clone()
    bad[3] = x.shape[0]
    with pytest.raises(RuntimeError, match=r"src\[3\]"):
        cpu_kernel.fused_moe(x, w_in, w_down, "gelu", counts, bad, order, pw, k)
    with pytest.raises(RuntimeError, match="int64"):
        cpu_kernel.fused_moe(x, w_in, w_down, "gelu", counts, bad.int(), order, pw, k)
    twice = order.clone()
    twice[1] = twice[0]
    with pytest.raises(RuntimeError, match="appears twice"):
        cpu_kernel.fused_moe(x, w_in, w_down, "gelu", counts, order // k, twice, pw, k)
    with pytest.raises(RuntimeError, match="width"):  # a gated activation needs w_in [E, D, 2F]
        cpu_kernel.fused_moe(x, w_in, w_down, "swiglu", counts, order // k, order, pw, k)
    with pytest.raises(RuntimeError, match="entries"):
        cpu_kernel.fused_moe(x, w_in, w_down, "gelu", counts[:-1], order // k, order, pw, k)


@needs_kernel
def test_double_backward_refuses_instead_of_returning_partial_gradients():
    x, w_in, w_down, pw, counts, order, k = problem("swiglu")
    out = cpu_kernel.fused_moe(x, w_in, w_down, "swiglu", counts, order // k, order, pw, k)
    (g,) = torch.autograd.grad(out.square().sum(), pw, create_graph=True)
    with pytest.raises(RuntimeError, match=r"differentiate twice|not have been used in the graph"):
        torch.autograd.grad(g.sum(), x)


def layer(activation="swiglu", bias=False, E=8, k=2, D=16, Fh=24):
    cfg = MoEConfig(
        router=RouterConfig(num_experts=E, top_k=k),
        experts=ExpertsConfig(hidden_size=D, ffn_hidden_size=Fh, activation=activation, bias=bias),
    )
    torch.manual_seed(0)
    return MoELayer(cfg)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_fused_path_equals_the_loop_backend(dtype):
    fused = layer().to(dtype)
    loop = layer().to(dtype)
    loop.experts.backend = "loop"
    x = torch.randn(4, 9, 16, dtype=dtype)
    assert fused._fuses_dispatch(x.reshape(-1, 16), fused.router(x.reshape(-1, 16)))
    outs = []
    for m in (fused, loop):
        xi = x.clone().requires_grad_()
        out = m(xi)
        loss = out.hidden_states.float().square().sum() + sum(out.aux_losses.values())
        loss.backward()
        outs.append((out.hidden_states, xi.grad, m.experts.w_in.grad, m.router.weight.grad))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


@needs_kernel
def test_backend_fused_with_the_specialization_loss_uses_the_split_chain():
    cfg = MoEConfig(
        router=RouterConfig(num_experts=4, top_k=2),
        experts=ExpertsConfig(hidden_size=16, ffn_hidden_size=8),
        losses=LossConfig(specialization=True),
    )
    torch.manual_seed(0)
    m = MoELayer(cfg)
    m.experts.backend = "fused"
    out = m(torch.randn(6, 16))
    assert "specialization" in out.aux_losses and torch.isfinite(out.hidden_states).all()


def test_tensor_subclass_weights_stay_off_the_kernel():
    class Tagged(torch.Tensor):
        pass

    x = torch.randn(3, 4)
    w = torch.randn(2, 4, 6).as_subclass(Tagged)
    assert not cpu_kernel.supports(x, "swiglu", w)


def test_without_the_kernel_the_layer_falls_back_to_the_loop(monkeypatch):
    x = torch.randn(10, 16)
    want = layer()
    want.experts.backend = "loop"
    expected = want(x).hidden_states
    monkeypatch.setattr(cpu_kernel, "kernel", lambda: None)
    got = layer()
    assert not got.experts.fuses(x)
    torch.testing.assert_close(got(x).hidden_states, expected, rtol=1e-5, atol=1e-6)
    got.experts.backend = "fused"
    with pytest.raises(RuntimeError, match="backend 'fused'"):
        got(x)


def test_experts_the_kernel_does_not_cover_use_the_loop():
    m = layer(bias=True)
    x = torch.randn(5, 16)
    assert not m.experts.fuses(x)
    m.experts.backend = "fused"
    with pytest.raises(RuntimeError, match="plain CPU experts"):
        m(x)


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("MOELAB_CPU_KERNEL", "0")
    cpu_kernel.kernel.cache_clear()
    try:
        assert cpu_kernel.kernel() is None
    finally:
        monkeypatch.delenv("MOELAB_CPU_KERNEL")
        cpu_kernel.kernel.cache_clear()


@needs_kernel
def test_a_build_lock_left_by_a_killed_build_does_not_hang_the_next_load():
    build = cpu_kernel.build_directory()
    (build / "lock").touch()  # what a build killed half-way leaves behind
    code = "from moelab.core.experts import cpu_kernel; assert cpu_kernel.kernel() is not None"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=240)
    assert not (build / "lock").exists()


def test_the_build_is_keyed_by_the_source_content_not_its_path(tmp_path, monkeypatch):
    """Two checkouts of the same sources share one build (ninja would rebuild for a new
    path); an edited source or header gets its own."""
    here = cpu_kernel.build_directory()
    copy = tmp_path / "elsewhere"
    shutil.copytree(cpu_kernel._CSRC, copy)
    monkeypatch.setattr(cpu_kernel, "_CSRC", copy)
    assert cpu_kernel.build_directory() == here
    header = copy / "kernel_common.h"
    header.write_bytes(header.read_bytes() + b"\n// edited\n")
    assert cpu_kernel.build_directory() != here


def test_the_build_is_keyed_by_the_torch_path_the_compile_command_names(tmp_path, monkeypatch):
    """A venv reached through a symlink: torch names its include folders by the path as
    reached, so each spelling keeps its own build (sharing one, they would rebuild in turn)."""
    from torch.utils import cpp_extension

    here = cpu_kernel.build_directory()
    assert os.path.dirname(os.path.abspath(torch.__file__)) == cpp_extension._TORCH_PATH
    link = tmp_path / "venv-link"
    link.symlink_to(Path(torch.__file__).parent, target_is_directory=True)
    monkeypatch.setattr(torch, "__file__", str(link / "__init__.py"))
    there = cpu_kernel.build_directory()
    assert there != here and there == cpu_kernel.build_directory()


@needs_kernel
def test_the_kernel_compiles_its_own_copy_of_the_sources():
    build = cpu_kernel.build_directory()
    for name in cpu_kernel._SOURCES:
        source = build / name
        assert source.read_bytes() == (cpu_kernel._CSRC / name).read_bytes()
        assert str(source) in (build / "build.ninja").read_text()
    assert (build / "kernel_common.h").read_bytes() == (
        cpu_kernel._CSRC / "kernel_common.h"
    ).read_bytes()


@needs_kernel
@pytest.mark.parametrize(
    ("bits", "group_size", "symmetric"),
    [(8, 24, True), (8, 12, False), (4, 8, False), (4, 24, True)],
)
def test_quantized_decode_kernel_equals_dequantized_float64(
    bits, group_size, symmetric, monkeypatch
):
    """Decode-sized rows of a 4/8-bit bank run the packed-code kernel; they equal the rows of
    the dequantized weights computed in float64, also with more than 8 rows of an expert (tiles
    of 8), and the batch path (more than KERNEL_MAX_ROWS rows of an expert: dequantize +
    grouped matmul) agrees with it."""
    from moelab.core.experts.quantized import (
        KERNEL_MAX_ROWS,
        QuantizedExpertBank,
        QuantizedProjection,
        QuantSpec,
    )

    E, D, Fh = 5, 48, 24
    cfg = ExpertsConfig(hidden_size=D, ffn_hidden_size=Fh)
    spec = QuantSpec(method="rtn", bits=bits, group_size=group_size, symmetric=symmetric,
                     act_order=False, lowrank="none", rank=0)  # fmt: skip
    g = torch.Generator().manual_seed(bits + group_size)

    def proj(d_out, d_in):
        G = d_in // group_size
        codes = torch.randint(0, 1 << bits, (E, d_out, d_in), generator=g)
        zeros = None if symmetric else torch.randint(0, 1 << bits, (E, d_out, G), generator=g)
        scales = (torch.rand(E, d_out, G, generator=g) + 0.5) / (1 << bits)
        return QuantizedProjection.from_codes(spec, codes, scales, zeros, None, None)

    projs = {"gate": proj(Fh, D), "up": proj(Fh, D), "down": proj(D, Fh)}
    bank = QuantizedExpertBank.from_projections(cfg, E, spec, projs)
    w = {n: p.dequantize(torch.float64) for n, p in projs.items()}

    def reference(x, counts):
        out, start = [], 0
        for e, c in enumerate(counts.tolist()):
            r = x[start : start + c].double()
            a = F.silu(r @ w["gate"][e].T) * (r @ w["up"][e].T)
            out.append(a @ w["down"][e].T)
            start += c
        return torch.cat(out)

    calls = []
    quant_rows = cpu_kernel.quant_rows
    monkeypatch.setattr(cpu_kernel, "quant_rows", lambda *a: calls.append(1) or quant_rows(*a))
    # 12 rows of one expert: tiles of 8 + 4; above KERNEL_MAX_ROWS rows: the batch path
    big = KERNEL_MAX_ROWS + 1
    cases = (
        ([2, 0, 8, 1, 3], 3),
        ([1, 1, 1, 1, 1], 3),
        ([0, 0, 12, 0, 3], 3),
        ([0, big, 0, 0, 3], 0),
    )
    for counts, kernel_calls in cases:
        counts = torch.tensor(counts)
        x = torch.randn(int(counts.sum()), D, generator=g)
        calls.clear()
        with torch.no_grad():
            got = bank(x, counts)
        assert len(calls) == kernel_calls  # gate, up, down
        ref = reference(x, counts)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5)
