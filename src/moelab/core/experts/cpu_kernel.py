"""The fused CPU expert kernel: each expert's whole chain as one task, experts run concurrently.

On CPU the per-expert loop (:mod:`moelab.core.experts.grouped_mm`) runs one GEMM at a time
with every core splitting it. A fine-grained MoE's GEMMs are small (64 experts × 8 rows at a
64-token decode step), so that split costs more than it gains, and the gather, activation and
scatter between the GEMMs each make one more pass over memory. The kernel in
``csrc/experts_cpu.cpp`` instead hands whole work items (one expert's rows, or a tile of them
for very large experts, largest first, taken dynamically) to the intra-op threads. Each thread
runs its item's gather → input projection → activation → output projection → scatter with
single-threaded GEMMs while the rows are still in its cache. This is the CPU MoE design of
llama.cpp and of Intel's fused-MoE kernels. The backward pass has the same structure, one task
per expert, and recomputes the activation from the saved input projection.

Measured by ``benchmarks/layer_speed.py``; the README has the table.

The kernel is compiled on first use with ``torch.utils.cpp_extension.load`` (C++ compiler and
ninja required, ~30 s once; cached in ``<TORCH_EXTENSIONS_DIR>/moelab_experts_cpu-<torch
version>``; a build killed half-way is redone by the next process). Where it cannot be built,
or with ``MOELAB_CPU_KERNEL=0``, :func:`kernel` returns None, and the experts run the PyTorch
loop, which gives the same values.
"""

from __future__ import annotations

import fcntl
import functools
import math
import os
import warnings
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

ACTIVATIONS = {"swiglu": 0, "geglu": 1, "gelu": 2, "gelu_tanh": 3}
"""Activations the kernel implements (``ExpertsConfig.activation`` → the kernel's code)."""

_SOURCE = Path(__file__).with_name("csrc") / "experts_cpu.cpp"
_ITEMS_PER_THREAD = 4  # tile very large experts so every thread gets work in a skewed plan
_MIN_TILE_ROWS = 256


@functools.cache
def kernel() -> ModuleType | None:
    """The compiled extension, or None when disabled (``MOELAB_CPU_KERNEL=0``) or not buildable
    (a warning says why, once)."""
    if os.environ.get("MOELAB_CPU_KERNEL", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import get_default_build_root, load

        build = Path(get_default_build_root()) / f"moelab_experts_cpu-{torch.__version__}"
        build.mkdir(parents=True, exist_ok=True)
        with open(build / "moelab.lock", "w") as guard:
            # torch's own build lock is a plain file that a killed build leaves behind, and
            # then every later load waits on it forever. An flock dies with its holder: while
            # we hold it no other moelab process is building, so a leftover file is stale.
            fcntl.flock(guard, fcntl.LOCK_EX)
            (build / "lock").unlink(missing_ok=True)
            return load(
                name="moelab_experts_cpu",
                sources=[str(_SOURCE)],
                extra_cflags=["-O3", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(build),
                verbose=False,
            )
    except Exception as exc:  # no compiler, no ninja, no Python headers: fall back
        warnings.warn(
            f"moelab: the fused CPU expert kernel could not be built ({type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}); the experts "
            "run the PyTorch loop instead (same values, slower)",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def supports(x: Tensor, activation: str) -> bool:
    """True when :func:`fused_experts` can run ``x`` (CPU, floating point, a known activation)
    and the kernel is available."""
    return (
        x.device.type == "cpu"
        and x.is_floating_point()
        and activation in ACTIVATIONS
        and kernel() is not None
    )


def _max_tile_rows(num_rows: int) -> int:
    per_item = math.ceil(num_rows / (_ITEMS_PER_THREAD * torch.get_num_threads()))
    return max(_MIN_TILE_ROWS, per_item)


class _FusedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_in, w_down, counts, act, src, dst, n_out, save, k):
        y, h = kernel().experts_forward(
            x, w_in, w_down, counts, act, src, dst, n_out, save, _max_tile_rows(sum(counts))
        )
        if save:
            ctx.save_for_backward(x, h, w_in, w_down, src, dst)
        ctx.counts, ctx.act, ctx.k = counts, act, k
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, h, w_in, w_down, src, dst = ctx.saved_tensors
        need_x = ctx.needs_input_grad[0]
        need_w = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        k = ctx.k
        gx, gw_in, gw_down = kernel().experts_backward(
            grad_y.contiguous(),
            x,
            h,
            w_in,
            w_down,
            ctx.counts,
            ctx.act,
            src,
            dst,
            need_x,
            need_w,
            k is not None,
        )
        if need_x and k is not None:  # pair order: token t's k rows are adjacent
            gx = gx.view(x.shape[0], k, x.shape[1]).sum(1)
        elif need_x and src is not None:  # rows sharing a source row (sequential on CPU)
            gx = torch.zeros_like(x).index_add_(0, src, gx)
        return gx, gw_in, gw_down, None, None, None, None, None, None, None


def fused_experts(
    x: Tensor,
    w_in: Tensor,
    w_down: Tensor,
    counts: Tensor,
    activation: str,
    src: Tensor | None = None,
    dst: Tensor | None = None,
    num_out: int | None = None,
    top_k: int | None = None,
) -> Tensor:
    """``y[dst[r]] = expert_e(x[src[r]])`` for every sorted row r of expert e.

    ``expert_e(z) = act(z·w_in[e])·w_down[e]``, with ``act(h) = f(h[:, :F]) ⊙ h[:, F:]`` for
    the gated activations (swiglu: f = silu; geglu: f = tanh-GELU) and ``f(h)`` otherwise
    (the definitions of :class:`moelab.core.experts.ExpertBank`).

    Args:
        x: ``[M, D]`` CPU rows, contiguous (the sorted rows themselves when ``src`` is None).
        w_in: ``[E, D, W]`` (``W = 2F`` gated, ``F`` otherwise); w_down: ``[E, F, D]``; same
            dtype as x.
        counts: ``[E]`` int64 rows per expert, in sorted order.
        activation: a key of :data:`ACTIVATIONS`.
        src: ``[N]`` int64, the row of x of every sorted row (fuses the dispatch gather).
        dst: ``[N]`` int64 distinct, the output row of every sorted row (fuses the
            un-permutation); requires ``num_out``.
        num_out: output rows when ``dst`` is given.
        top_k: promises ``dst`` is pair order of a uniform plan (``src = dst // top_k``):
            the input gradient is then summed over each token's k adjacent rows, without a
            scatter.
    Returns:
        ``[num_out or N, D]``, differentiable w.r.t. x and both weights (the gradient of a row
        of x that several sorted rows read is their sum, taken with a sequential
        ``index_add_``). With ``dst``, output rows no sorted row maps to are uninitialised.
    Raises:
        RuntimeError: the kernel is unavailable (check :func:`supports` first).
    """
    if kernel() is None:
        raise RuntimeError("the fused CPU expert kernel is not available")
    count_list = counts.tolist()
    n = sum(count_list)
    n_out = n if dst is None else int(num_out)
    save = torch.is_grad_enabled() and (
        x.requires_grad or w_in.requires_grad or w_down.requires_grad
    )
    return _FusedExperts.apply(
        x.contiguous(),
        w_in,
        w_down,
        count_list,
        ACTIVATIONS[activation],
        src,
        dst,
        n_out,
        save,
        top_k if src is not None and dst is not None else None,
    )
