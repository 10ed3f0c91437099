"""The fused CPU expert kernel: each expert's whole chain as one task, experts run concurrently.

On CPU the per-expert loop (:mod:`moelab.core.experts.grouped_mm`) runs one GEMM at a time
with every core splitting it. A fine-grained MoE's GEMMs are small (64 experts × 8 rows at a
64-token decode step), so that split costs more than it gains, and the gather, activation and
scatter between the GEMMs each make one more pass over memory. The kernel in
``csrc/experts_cpu.cpp`` instead hands whole work items (one expert's rows, or a tile of them
for very large experts, largest first, taken dynamically) to the intra-op threads. Each thread
runs its item's gather → input projection → activation → output projection → scatter with
single-threaded GEMMs while the rows are still in its cache. This is the CPU MoE design of
llama.cpp and of Intel's fused-MoE kernels. A decode-sized float32 expert (1-8 rows) skips
MKL, whose GEMM reads the weights at a fraction of the memory bandwidth at so few rows: the
kernel streams each weight once for all of the expert's rows, and splits the expert over its
hidden width into two items so that an odd number of busy experts still fills both threads.
The backward pass has the same structure, one task per expert, and recomputes the activation
from the saved input projection.

Measured by ``benchmarks/layer_speed.py``; the table is in docs/benchmarks/layer.md.

The kernel is compiled on first use with ``torch.utils.cpp_extension.load`` (C++ compiler and
ninja required, 30-40 s once per torch installation (and path to it); cached in ``<TORCH_EXTENSIONS_DIR or
torch's default>/moelab_experts_cpu-py<XY>-torch<version>-<hash>``; a build killed half-way is
redone by the next process). Where it cannot be built,
or with ``MOELAB_CPU_KERNEL=0``, :func:`kernel` returns None, and the experts run the PyTorch
loop, which gives the same values.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import warnings
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from moelab.core.autocast import autocast_off

ACTIVATIONS = {"swiglu": 0, "geglu": 1, "gelu": 2, "gelu_tanh": 3}
"""Activations the kernel implements (``ExpertsConfig.activation`` → the kernel's code)."""

_CSRC = Path(__file__).with_name("csrc")
# compiled (the headers beside them are included)
_SOURCES = (
    "experts_cpu.cpp",
    "quant_cpu.cpp",
    "quant_int8.cpp",
    "dense_rows.cpp",
    "decode_step.cpp",
)


def build_directory() -> Path:
    """Where the kernel is built: ``<TORCH_EXTENSIONS_DIR or torch's default root>/
    moelab_experts_cpu-py<XY>-torch<version>-<hash>``.

    The hash covers the sources' content (``csrc/``) and the torch installation's path, not the
    checkout's: checkouts sharing a virtual environment share one build. ninja rebuilds
    whenever the compile command changes, and the command names torch's include and library
    folders as torch's import path spells them (``os.path.abspath``, symlinks kept), so the
    key takes that spelling too: one environment reached through two paths (a symlinked
    ``.venv``) gets one build per path, each built once, instead of two spellings that
    rebuild over each other in turn.
    """
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    files = sorted(_CSRC.glob("*.cpp")) + sorted(_CSRC.glob("*.h"))
    key = b"".join(f.name.encode() + f.read_bytes() for f in files)
    key += os.path.dirname(os.path.abspath(torch.__file__)).encode()
    digest = hashlib.sha256(key).hexdigest()[:12]
    return Path(root) / f"moelab_experts_cpu-{py}-torch{torch.__version__}-{digest}"


@functools.cache
def kernel() -> ModuleType | None:
    """The compiled extension, or None when disabled (``MOELAB_CPU_KERNEL=0``) or not buildable
    (a warning says why, once)."""
    if os.environ.get("MOELAB_CPU_KERNEL", "1") == "0":
        return None
    try:
        import fcntl  # POSIX; elsewhere the ImportError falls back like a failed build

        from torch.utils.cpp_extension import load

        build = build_directory()
        build.mkdir(parents=True, exist_ok=True)
        with open(build / "moelab.lock", "w") as guard:
            # torch's own build lock is a plain file that a killed build leaves behind, and
            # then every later load waits on it forever. An flock dies with its holder: while
            # we hold it no other moelab process is building, so a leftover file is stale.
            fcntl.flock(guard, fcntl.LOCK_EX)
            (build / "lock").unlink(missing_ok=True)
            for src in sorted(_CSRC.glob("*.cpp")) + sorted(_CSRC.glob("*.h")):
                copy = build / src.name  # compiled from here: the same path for everyone
                if not copy.is_file():
                    tmp = copy.with_suffix(".tmp")
                    shutil.copyfile(src, tmp)
                    os.replace(tmp, copy)
            module = load(
                name="moelab_experts_cpu",
                sources=[str(build / name) for name in _SOURCES],
                extra_cflags=["-O3", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(build),
                verbose=False,
            )
        _register_fakes()
        return module
    except Exception as exc:  # no compiler, no ninja, no Python headers: fall back
        lines = str(exc).strip().splitlines() or [""]
        why = next((line for line in lines if "error" in line.lower()), lines[-1])
        warnings.warn(
            f"moelab: the fused CPU expert kernel could not be built ({type(exc).__name__}: "
            f"{why.strip()}); the experts run the PyTorch loop instead (same values, slower; "
            "MOELAB_CPU_KERNEL=0 skips the build)",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def supports(x: Tensor, activation: str, *weights: Tensor) -> bool:
    """True when :func:`fused_experts` and :func:`fused_moe` can run ``x`` with ``weights``:
    CPU, floating point, a known activation, plain tensors (the kernel's worker threads cannot
    run a tensor subclass's Python dispatch), and the kernel is available."""
    plain = all(type(t) in (Tensor, torch.nn.Parameter) for t in (x, *weights))
    return (
        plain
        and x.device.type == "cpu"
        and x.is_floating_point()
        and activation in ACTIVATIONS
        and available()
    )


@torch.compiler.assume_constant_result
def available() -> bool:
    """Whether :func:`kernel` is built (torch.compile takes the answer as a constant instead
    of tracing the build machinery)."""
    return kernel() is not None


def _forward(x, w_in, w_down, counts, act, src, dst, save):
    # max_rows 0: the kernel's own tiling of large experts
    return kernel().experts_forward(x, w_in, w_down, counts, act, src, dst, sum(counts), save, 0)


def _needs_save(*tensors: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _check_available() -> None:
    if not available():
        raise RuntimeError("the fused CPU expert kernel is not available")


class _SortedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_in, w_down, counts, act, save):
        y, h = _forward(x, w_in, w_down, counts, act, None, None, save)
        if save:
            ctx.save_for_backward(x, h, w_in, w_down)
        ctx.counts, ctx.act = counts, act
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        x, h, w_in, w_down = ctx.saved_tensors
        need_w = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        gx, gw_in, gw_down = kernel().experts_backward(
            grad_y.contiguous(), x, h, w_in, w_down, ctx.counts, ctx.act,
            None, None, None, ctx.needs_input_grad[0], need_w,
        )  # fmt: skip
        return gx, gw_in, gw_down, None, None, None


def _combine(y_pairs: Tensor, pair_weight: Tensor, T: int, k: int) -> Tensor:
    """``out[t] = Σ_j w[t·k + j] · y[t·k + j]``, summed in the weights' dtype (float32)."""
    w = pair_weight.view(T, 1, k)
    with autocast_off(y_pairs.device):
        return torch.bmm(w, y_pairs.to(w.dtype).view(T, k, y_pairs.shape[-1])).squeeze(1)


class _TokenMoE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_in, w_down, pair_weight, counts, act, token_idx, order, k, save):
        y_pairs, h = _forward(x, w_in, w_down, counts, act, token_idx, order, save)
        out = _combine(y_pairs, pair_weight, x.shape[0], k)
        if save:
            ctx.save_for_backward(x, h, w_in, w_down, pair_weight, y_pairs, token_idx, order)
        ctx.counts, ctx.act, ctx.k = counts, act, k
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, h, w_in, w_down, pair_weight, y_pairs, token_idx, order = ctx.saved_tensors
        grad = grad.contiguous()
        T, D = x.shape
        k = ctx.k
        need = ctx.needs_input_grad
        grad_pw = None
        if need[3]:  # d out[t] / d w[t, j] = y[t, j]
            y = y_pairs.to(grad.dtype).view(T, k, D)
            with autocast_off(grad.device):
                grad_pw = torch.bmm(y, grad.unsqueeze(-1)).view(T * k)
        gx, gw_in, gw_down = kernel().experts_backward(
            grad, x, h, w_in, w_down, ctx.counts, ctx.act,
            token_idx, order, pair_weight.detach(), need[0], need[1] or need[2],
        )  # fmt: skip
        if gx is not None:  # pair order: token t's k rows are adjacent
            gx = gx.view(T, k, D).sum(1)
        return gx, gw_in, gw_down, grad_pw, None, None, None, None, None, None


def fused_experts(
    x: Tensor, w_in: Tensor, w_down: Tensor, counts: Tensor, activation: str
) -> Tensor:
    """``y[r] = expert_e(x[r])`` for the rows r of expert e (rows sorted by expert).

    ``expert_e(z) = act(z·w_in[e])·w_down[e]``, with ``act(h) = f(h[:, :F]) ⊙ h[:, F:]`` for
    the gated activations (swiglu: f = silu; geglu: f = tanh-GELU) and ``f(h)`` otherwise
    (the definitions of :class:`moelab.core.experts.ExpertBank`).

    Args:
        x: ``[N, D]`` CPU rows sorted by expert.
        w_in: ``[E, D, W]`` (``W = 2F`` gated, ``F`` otherwise); w_down: ``[E, F, D]``; same
            dtype as x.
        counts: ``[E]`` int64 rows per expert (sums to N).
        activation: a key of :data:`ACTIVATIONS`.
    Returns:
        ``[N, D]``, differentiable w.r.t. x and both weights.
    Raises:
        RuntimeError: the kernel is unavailable (check :func:`supports` first).
    """
    _check_available()
    save = _needs_save(x, w_in, w_down)
    counts_list = counts.tolist()
    return _SortedExperts.apply(
        x.contiguous(), w_in, w_down, counts_list, ACTIVATIONS[activation], save
    )


def fused_moe(
    x: Tensor,
    w_in: Tensor,
    w_down: Tensor,
    activation: str,
    counts: Tensor,
    token_idx: Tensor,
    order: Tensor,
    pair_weight: Tensor,
    top_k: int,
) -> Tensor:
    """A uniform plan's whole expert computation and combine from the unsorted tokens:
    ``out[t] = Σ_j pair_weight[t·k + j] · expert_{e(t, j)}(x[t])``.

    The dispatch gather, the un-permutation back to pair order and, in the backward, the
    combine's per-pair gradient ``w · d out`` all happen inside the workers, so none of them
    makes a pass over ``[T·k, D]`` memory of its own.

    Args:
        x: ``[T, D]`` CPU tokens; w_in, w_down, activation as in :func:`fused_experts`.
        counts: ``[E]`` int64 pairs per expert.
        token_idx: ``[T·k]`` int64, the token of every pair in expert-sorted order.
        order: ``[T·k]`` int64, the pair index (``t·k + j``) of every sorted row.
        pair_weight: ``[T·k]`` float32 (float64 for float64 routers) combine weights in pair
            order.
        top_k: k.
    Returns:
        ``[T, D]`` in pair_weight's dtype (the weighted sum is taken in it), differentiable
        w.r.t. x, both weights and pair_weight.
    Raises:
        RuntimeError: the kernel is unavailable, or an index is out of range (checked before
            any row is copied).
    """
    _check_available()
    save = _needs_save(x, w_in, w_down, pair_weight)
    if not save:  # inference: one C++ operator, which torch.compile keeps in its graph
        y_pairs = torch.ops.moelab.fused_moe_pairs(
            x, w_in, w_down, counts, ACTIVATIONS[activation], token_idx, order
        )
        return _combine(y_pairs, pair_weight, x.shape[0], top_k)
    return _TokenMoE.apply(
        x.contiguous(),
        w_in,
        w_down,
        pair_weight,
        counts.tolist(),
        ACTIVATIONS[activation],
        token_idx.contiguous(),
        order.contiguous(),
        top_k,
        save,
    )


DENSE_MAX_ROWS = 8
"""Most rows a :func:`dense_rows` call takes (a decode step's batch); more go to MKL's GEMM."""


def dense_rows_apply(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """True when :func:`dense_rows` runs ``F.linear(x, weight, bias)``: inference (no gradient
    wanted), float32 CPU plain tensors, a contiguous weight, 1 to :data:`DENSE_MAX_ROWS` rows,
    no CPU autocast (which would run the projection in bfloat16), and the kernel available."""
    plain = all(type(t) in (Tensor, torch.nn.Parameter) for t in (x, weight))
    tensors = (x, weight) if bias is None else (x, weight, bias)
    return (
        plain
        and x.device.type == "cpu"
        and all(t.dtype == torch.float32 for t in tensors)
        and 0 < x.numel() <= DENSE_MAX_ROWS * x.shape[-1]
        and weight.is_contiguous()
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
        and not torch.is_autocast_enabled("cpu")
        and available()
    )


def dense_rows(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` for a decode step's few rows (``csrc/dense_rows.cpp``).

    MKL reads an ``[N, K]`` weight at a fraction of the memory bandwidth when it multiplies
    1-8 rows by it; the kernel streams each weight row once, in register tiles of 8 weight
    rows × 1-2 input rows or 4 × 3-4 (a tile's weights serve rows 5-8 from L1), over blocks
    of output features shared by the intra-op threads (the adaptive scheduler: a busy core is
    not waited for). The operator ``moelab::dense_rows`` is registered in C++, so neither an
    eager call nor a compiled graph goes through Python to reach it. Each output is summed in
    a fixed order that does not depend on the call's other rows, so a batched decode gives
    each row the values it gets alone; they differ from MKL's by float32 rounding.

    Args:
        x: ``[..., K]`` float32 CPU, at most :data:`DENSE_MAX_ROWS` rows.
        weight: ``[N, K]`` float32, contiguous (``nn.Linear`` layout).
        bias: ``[N]`` float32, or None.
    Returns:
        ``[..., N]`` float32, not differentiable (check :func:`dense_rows_apply` first).
    Raises:
        RuntimeError: the kernel is unavailable, or the shapes, dtypes or row count are not
            those above.
    """
    _check_available()
    return torch.ops.moelab.dense_rows(x, weight, bias)


def quant_rows(
    x: Tensor, counts: Tensor, codes: Tensor, scales: Tensor, zeros: Tensor | None,
    bits: int, out_features: int,
) -> Tensor:  # fmt: skip
    """Rows ``x [N, K]`` (float32, sorted by expert: ``counts [E]`` int64 rows of each expert
    in order, zeros allowed, at most 8 per call of the kernel: more run as several tiles,
    each reading the expert's codes again) times one quantized projection's weights
    ``[E, O, K]`` (``csrc/quant_cpu.cpp``): ``codes`` the packed uint8 codes of 4 or 8 bits,
    ``scales`` float16 ``[E, O, G]``, ``zeros`` unpacked uint8 ``[E, O, G]`` or None
    (symmetric). The rows are quantized to int8 per group first where
    :func:`int8_activations`. The operator ``moelab::quant_rows_mm``, registered in C++.

    Returns:
        ``[N, out_features]`` float32, not differentiable.
    Raises:
        RuntimeError: the kernel is unavailable, or a shape, dtype or count is not the above.
    """
    _check_available()
    return torch.ops.moelab.quant_rows_mm(
        x, counts, codes, scales, zeros, bits, out_features, int8_activations()
    )


def _register_fakes() -> None:
    """Output shapes of the C++ operators, for torch.compile's tracing."""
    torch.library.register_fake(
        "moelab::dense_rows",
        lambda x, weight, bias: x.new_empty(*x.shape[:-1], weight.shape[0]),
    )
    torch.library.register_fake(
        "moelab::fused_moe_pairs",
        lambda x, w_in, w_down, counts, act, token_idx, order: x.new_empty(
            order.shape[0], x.shape[1]
        ),
    )
    torch.library.register_fake(
        "moelab::quant_rows_mm",
        lambda x, counts, codes, scales, zeros, bits, out_features, int8: x.new_empty(
            x.shape[0], out_features
        ),
    )


@torch.compiler.assume_constant_result
def int8_activations() -> bool:
    """Whether quantized experts' decode-sized calls (``csrc/quant_cpu.cpp``) quantize their
    input rows to int8 and multiply with integer dot products (``csrc/quant_int8.cpp``): the
    kernel is available, the CPU has AVX-512 VNNI, and ``MOELAB_INT8_ACTIVATIONS`` is not
    ``0``. Only groups of a multiple of 64 columns take the integer path.

    Each row is quantized per weight group, step ``max|x|/127`` (llama.cpp's 8-bit activations
    for its quantized matmuls), so a row's outputs differ from the float32 path by that
    rounding (0.5-0.8 % of the largest output on random codes and inputs; no fixed bound).
    ``MOELAB_INT8_ACTIVATIONS=0`` keeps float32 activations (slower at decode, the values of
    the dequantized weights). A graph compiled by torch.compile keeps the answer it had when
    it was traced.
    """
    k = kernel()
    return (
        k is not None
        and os.environ.get("MOELAB_INT8_ACTIVATIONS", "1") != "0"
        and k.int8_dot_supported()
    )


def scheduler_stats() -> dict[str, int]:
    """The adaptive scheduler's state since the last :func:`reset_scheduler` (process-wide):
    ``parallel_calls`` and ``solo_calls`` (run on the calling thread alone) over all kernel
    calls, the moving averages of wall time per item it compares for the latest decode-sized
    call's shape (``parallel_ns_per_item``, ``solo_ns_per_item``; 0 until measured: each
    shape of call, by kernel and sizes, keeps its own) and ``forced_solo`` (forced solo calls
    still to come). See ``csrc/kernel_common.h``.

    Raises:
        RuntimeError: the kernel is unavailable.
    """
    _check_available()
    parallel, solo, par_cost, solo_cost, forced = kernel().scheduler_stats()
    return {
        "parallel_calls": parallel,
        "solo_calls": solo,
        "parallel_ns_per_item": par_cost,
        "solo_ns_per_item": solo_cost,
        "forced_solo": forced,
    }


def reset_scheduler(solo_calls: int = 0) -> None:
    """Forget the scheduler's measurements and counters (every call shape's, and the fused
    decode steps' modes), and make the next ``solo_calls`` kernel calls run on the calling
    thread alone (tests and benchmarks; the scheduler chooses by itself otherwise).

    Raises:
        RuntimeError: the kernel is unavailable, or ``solo_calls`` < 0.
    """
    _check_available()
    kernel().reset_scheduler(solo_calls)
