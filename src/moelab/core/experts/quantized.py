"""A quantized expert bank: the Experts seam computed from bit-packed integer codes.

Each projection (gate, up, down for SwiGLU; up, down for GELU) of all E experts is one
:class:`QuantizedProjection`: packed codes, group-wise float16 scales, optional zero points and
act-order group indices (format in :mod:`moelab.core.experts.qformat`) — or, for GPTVQ,
packed centroid indices and int8 codebooks (:mod:`moelab.core.experts.vqformat`) — plus an optional
:class:`~moelab.core.experts.lowrank.LowRankFactors` correction of the quantization error.
The bank dequantizes on the fly (every forward; nothing dense is kept) and adds the
low-rank corrections with TileQ's single pass (:mod:`moelab.core.experts.lowrank`): per row
for gate/up (the activation follows them; shared column factors project each token once when
the layer passes its tokens), and for the down projection either per row
(:meth:`QuantizedExpertBank.forward`, the plain Experts interface, and the per-expert /
shared-1d schemes) or, for the TileQ schemes, accumulated per token with the routing weights
(:meth:`QuantizedExpertBank.forward_combined`, what :class:`~moelab.core.layer.MoELayer`
calls).

The bank's tensors are buffers named ``{proj}.codes``, ``{proj}.scales``, ``{proj}.zeros``,
``{proj}.g_idx``, ``{proj}.codebook`` and ``{proj}.lowrank.{U,V,S,in_scale,row_of,col_of}``, so a model holding it saves and
loads with its ordinary state dict; :meth:`QuantizedExpertBank.empty` builds the buffers of
the right shapes from a :class:`QuantSpec` for loading.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from moelab.core.config import GATED_ACTIVATIONS, ExpertsConfig
from moelab.core.experts import cpu_kernel
from moelab.core.experts.bank import ExpertBank
from moelab.core.experts.grouped_mm import grouped_mm
from moelab.core.experts.lowrank import SCHEMES, LowRankFactors, expert_of_rows
from moelab.core.experts.qformat import (
    check_bits,
    dequantize,
    pack_codes,
    packed_size,
    unpack_codes,
)
from moelab.core.experts.rotation import check_rotation, unrotate
from moelab.core.experts.vqformat import check_vq_format, num_centroids, vq_dequantize
from moelab.errors import InvalidValueError

LOWRANK_CHOICES = ("none", *SCHEMES)
QUANT_METHODS = ("rtn", "gptq", "gptvq")
TILEQ_SCHEMES = ("tileq", "tileq-core")
FLOAT_BYTES = 2  # scales and low-rank factors are stored as float16


def as_stored(t: Tensor, what: str) -> Tensor:
    """``t`` rounded to float16, as the bank stores scales and low-rank factors, back in
    ``t``'s dtype.

    Raises:
        ValueError: naming ``what``, when an entry is not finite or lies beyond float16's range
            (±65504): stored, it would be inf and every output NaN.
    """
    r = t.detach().to(torch.float16)
    if not torch.isfinite(r).all():
        big = float(t.detach().abs().nan_to_num(float("inf")).max())
        raise InvalidValueError(
            f"{what}: reaches {big:.3g}, outside float16's range (±65504) in which it is "
            "stored; the calibration statistics are degenerate for it (more or other "
            "calibration text, or another low-rank weighting, avoids this)"
        )
    return r.to(t.dtype)


@dataclass(frozen=True)
class QuantSpec:
    """How the experts of a model were quantized (stored in the folder's config).

    Attributes:
        method: ``"rtn"`` or ``"gptq"`` (scalar codes, the same format) or ``"gptvq"``
            (vector quantization: centroid indices and codebooks,
            :mod:`moelab.core.experts.vqformat`).
        bits: 2, 3, 4 or 8 (gptvq: bits per dimension, 2 to 4, ``bits·vq_dim <= 8``).
        group_size: input columns per scale (gptvq: per codebook; a multiple of ``vq_dim``);
            must divide every projection's input width.
        symmetric: implicit zero point ``2^(bits−1)`` (no zeros stored) when True; gptvq
            stores no zero points and refuses it.
        act_order: GPTQ act-order groups (a ``g_idx`` per expert is stored).
        lowrank: ``"none"``, ``"per-expert"``, ``"shared-1d"``, ``"tileq"`` (TileQ as the
            authors' code does it) or ``"tileq-core"`` (moelab's variant with r × r cores).
        rank: r of the low-rank correction (0 with ``lowrank="none"``).
        rotate_block: 0 (off) or the Walsh block ``b`` of the partial block-Hadamard rotation
            with column permutation applied before GPTQ (the authors' rotated GPTQ,
            :mod:`moelab.core.experts.rotation`); GPTQ without act-order only; a per-expert
            permutation ``perm`` ``[E, I]`` is stored.
        grid: ``(M, N)`` TileQ grid. ``tileq``: the code's orientation [K] — M grid rows, each
            sharing one *input-side* factor, N columns each sharing one output-side factor,
            ``M·N >= E`` (empty cells allowed); ``tileq-core``: M row (output-side) factors,
            N column (input-side) factors, ``M·N = E``.
        vq_dim: gptvq's vector length ``d`` (1, 2 or 4); 0 for the scalar methods.
        vq_rows: gptvq's output rows per codebook (must divide every projection's output
            width, and a codebook must cover at least ``K = 2^(bits·d)`` vectors); 0 for the
            scalar methods.
    Raises:
        ValueError: any field out of range, naming it.
    """

    method: str = "gptq"
    bits: int = 4
    group_size: int = 64
    symmetric: bool = False
    act_order: bool = False
    lowrank: str = "none"
    rank: int = 0
    grid: tuple[int, int] | None = None
    rotate_block: int = 0
    vq_dim: int = 0
    vq_rows: int = 0

    def __post_init__(self) -> None:
        check_bits(self.bits)
        if not isinstance(self.rotate_block, int) or self.rotate_block < 0:
            raise InvalidValueError(f"rotate_block: must be an int >= 0, got {self.rotate_block!r}")
        if self.rotate_block and (self.method == "rtn" or self.act_order):
            raise InvalidValueError(
                "rotate_block: the rotation orders the columns itself; it needs GPTQ or GPTVQ "
                "without act-order"
            )
        if self.method not in QUANT_METHODS:
            raise InvalidValueError(f"method: must be one of {QUANT_METHODS}, got {self.method!r}")
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise InvalidValueError(f"group_size: must be an int >= 1, got {self.group_size!r}")
        self._check_vq()
        if self.lowrank not in LOWRANK_CHOICES:
            raise InvalidValueError(
                f"lowrank: must be one of {LOWRANK_CHOICES}, got {self.lowrank!r}"
            )
        if self.lowrank == "none":
            if self.rank != 0:
                raise InvalidValueError(
                    f"rank: must be 0 without low-rank compensation, got {self.rank}"
                )
        elif not isinstance(self.rank, int) or self.rank < 1:
            raise InvalidValueError(f"rank: must be an int >= 1, got {self.rank!r}")
        if (self.lowrank in TILEQ_SCHEMES) != (self.grid is not None):
            raise InvalidValueError("grid: set exactly when lowrank is 'tileq' or 'tileq-core'")
        if self.grid is not None:
            g = tuple(self.grid)
            if len(g) != 2 or any(not isinstance(v, int) or v < 1 for v in g):
                raise InvalidValueError(f"grid: must be two ints >= 1 (M, N), got {self.grid!r}")
            object.__setattr__(self, "grid", g)

    def _check_vq(self) -> None:
        if self.method != "gptvq":
            if self.vq_dim or self.vq_rows:
                raise InvalidValueError("vq_dim/vq_rows: only gptvq uses them (leave them 0)")
            return
        check_vq_format(self.bits, self.vq_dim)
        if self.group_size % self.vq_dim:
            raise InvalidValueError(
                f"group_size: {self.group_size} is not a multiple of vq_dim {self.vq_dim}"
            )
        if not isinstance(self.vq_rows, int) or self.vq_rows < 1:
            raise InvalidValueError(f"vq_rows: must be an int >= 1, got {self.vq_rows!r}")
        K = num_centroids(self.bits, self.vq_dim)
        if self.vq_rows * self.group_size // self.vq_dim < K:
            raise InvalidValueError(
                f"vq_rows: a codebook of {self.vq_rows} rows × {self.group_size} columns holds "
                f"{self.vq_rows * self.group_size // self.vq_dim} vectors, fewer than its {K} "
                "centroids"
            )
        if self.symmetric or self.act_order:
            raise InvalidValueError("symmetric/act_order: scalar-grid options; gptvq takes neither")

    @property
    def vector(self) -> bool:
        """Whether the codes index codebooks (gptvq) rather than a scalar grid."""
        return self.method == "gptvq"

    @property
    def index_bits(self) -> int:
        """Bits of one stored code: ``bits`` (scalar) or ``bits·vq_dim`` (gptvq)."""
        return self.bits * self.vq_dim if self.vector else self.bits

    @property
    def stores_zeros(self) -> bool:
        """Whether zero points are stored (asymmetric scalar grids)."""
        return not self.symmetric and not self.vector

    def to_dict(self) -> dict:
        d = asdict(self)
        d["grid"] = list(self.grid) if self.grid is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> QuantSpec:
        d = dict(d)
        if d.get("grid") is not None:
            d["grid"] = tuple(d["grid"])
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise InvalidValueError(f"quantization: unknown field(s) {sorted(unknown)}")
        return cls(**d)

    def check_model(self, num_experts: int, widths: tuple[int, ...]) -> None:
        """Raise ``ValueError`` when the spec does not fit E experts with input/output
        widths ``widths`` (group size must divide every input width; the rank must not exceed
        any matrix side; the ``tileq-core`` grid must factor E, the ``tileq`` grid must have
        at least E cells)."""
        for w in widths:
            if self.rotate_block:
                check_rotation(self.rotate_block, w)
            if w % self.group_size:
                raise InvalidValueError(
                    f"group_size: {self.group_size} does not divide the projection width {w}"
                )
            if self.vector and w % self.vq_rows:
                raise InvalidValueError(
                    f"vq_rows: {self.vq_rows} does not divide the projection width {w}"
                )
            if self.rank > w:
                raise InvalidValueError(f"rank: {self.rank} exceeds the matrix side {w}")
        if self.grid is None:
            return
        M, N = self.grid
        if self.lowrank == "tileq-core" and num_experts != M * N:
            raise InvalidValueError(f"grid: {M}x{N} does not factor the {num_experts} experts")
        if self.lowrank == "tileq" and num_experts > M * N:
            raise InvalidValueError(f"grid: {M}x{N} has fewer cells than the {num_experts} experts")


# [I] Rows per expert up to which the kernel runs (in tiles of 8 rows, re-reading the codes
# for each tile: csrc/quant_cpu.cpp); above it dequantization and the GEMM, whose cost per row
# is lower once the rows are many. On a SmolLM2-sized 8-bit bank (8 experts of 576 x 1536, 2 threads,
# AVX-512 VNNI) the tiled kernel was 4.5x faster than dequantization + GEMM at 32 rows per
# expert, 2x at 256, 1.5x at 512 and even at 1024.
KERNEL_MAX_ROWS = 256


def kernel_unreadable(spec: QuantSpec) -> str | None:
    """Why the compiled decode kernel (``csrc/quant_cpu.cpp``) cannot read codes stored with
    ``spec`` (e.g. ``"act-order codes"``), or None when it can: scalar codes of 4 or 8 bits
    (4-bit groups whole bytes), no act-order or rotation."""
    if spec.vector:
        return "vector (GPTVQ) codes"
    if spec.act_order:
        return "act-order codes"
    if spec.rotate_block:
        return "rotated codes"
    if spec.bits not in (4, 8):
        return f"{spec.bits}-bit codes"
    if spec.bits == 4 and spec.group_size % 2:
        return "4-bit codes in groups of an odd size"
    return None


def kernel_applies(spec: QuantSpec, x: Tensor) -> bool:
    """Whether the compiled decode kernel (``csrc/quant_cpu.cpp``) can multiply ``x`` by
    weights quantized with ``spec``: codes it reads (:func:`kernel_unreadable`), ``x``
    float32 on the CPU without gradients, and the kernel built."""
    return (
        kernel_unreadable(spec) is None
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and not (torch.is_grad_enabled() and x.requires_grad)
        and cpu_kernel.available()
    )


def _empty_factors(spec: QuantSpec, K: int, d_out: int, d_in: int) -> LowRankFactors | None:
    r = spec.rank
    if spec.lowrank == "none":
        return None
    ar = torch.arange(K)
    if spec.lowrank == "per-expert":
        return LowRankFactors(
            "per-expert", torch.zeros(K, d_out, r), torch.zeros(K, d_in, r), ar, ar
        )
    if spec.lowrank == "shared-1d":
        return LowRankFactors(
            "shared-1d",
            torch.zeros(K, d_out, r),
            torch.zeros(1, d_in, r),
            ar,
            torch.zeros(K, dtype=torch.long),
        )
    M, N = spec.grid
    if spec.lowrank == "tileq":  # code orientation: M input-side factors, N output-side ones
        return LowRankFactors(
            "tileq",
            torch.zeros(N, d_out, r),
            torch.zeros(M, d_in, r),
            ar // M,
            ar % M,
            in_scale=torch.zeros(K, d_in),
        )
    return LowRankFactors(
        "tileq-core",
        torch.zeros(M, d_out, r),
        torch.zeros(N, d_in, r),
        ar // N,
        ar % N,
        torch.zeros(K, r, r),
    )


class QuantizedProjection(nn.Module):
    """One projection of E experts, ``W_e [O, I]`` as packed codes + scales (+ low rank).

    Buffers: ``codes`` uint8 packed ``[packed_size(E·O·I, bits)]``; ``scales`` ``[E, O, G]``
    float16 bit patterns held as int16 (so casting the model's dtype never rounds them; read
    them with :attr:`scale_values`);
    ``zeros`` uint8 packed ``[packed_size(E·O·G, bits)]`` (asymmetric only); ``g_idx``
    int16 ``[E, I]`` (act-order only); submodule ``lowrank`` (optional). GPTVQ specs
    (:mod:`~moelab.core.experts.vqformat`): ``codes`` packed ``[packed_size(E·O·I/d, bits·d)]``
    centroid indices, ``scales`` ``[E, O/rows, G]`` per codebook, ``codebook`` int8
    ``[E, O/rows, G, K, d]``, no zeros.
    """

    def __init__(self, num_experts: int, out_features: int, in_features: int, spec: QuantSpec):
        super().__init__()
        E, d_out, d_in = num_experts, out_features, in_features
        spec.check_model(E, (d_in, d_out) if spec.vector else (d_in,))
        self.spec = spec
        self.shape = (E, d_out, d_in)
        G = d_in // spec.group_size
        self.code_shape = (E, d_out, d_in // spec.vq_dim) if spec.vector else self.shape
        self.register_buffer(
            "codes",
            torch.zeros(
                packed_size(math.prod(self.code_shape), spec.index_bits), dtype=torch.uint8
            ),
        )
        scale_rows = d_out // spec.vq_rows if spec.vector else d_out
        self.register_buffer(
            "scales", torch.ones(E, scale_rows, G, dtype=torch.float16).view(torch.int16)
        )
        codebook = None
        if spec.vector:
            K = num_centroids(spec.bits, spec.vq_dim)
            codebook = torch.zeros(E, scale_rows, G, K, spec.vq_dim, dtype=torch.int8)
        self.register_buffer("codebook", codebook)
        zeros = (
            torch.zeros(packed_size(E * d_out * G, spec.bits), dtype=torch.uint8)
            if spec.stores_zeros
            else None
        )
        self.register_buffer("zeros", zeros)
        g_idx = torch.zeros(E, d_in, dtype=torch.int16) if spec.act_order else None
        self.register_buffer("g_idx", g_idx)
        perm = torch.arange(d_in, dtype=torch.int16).repeat(E, 1) if spec.rotate_block else None
        self.register_buffer("perm", perm)
        self.lowrank = _empty_factors(spec, E, d_out, d_in)

    @classmethod
    def from_codes(
        cls,
        spec: QuantSpec,
        codes: Tensor,
        scales: Tensor,
        zeros: Tensor | None,
        g_idx: Tensor | None,
        lowrank: LowRankFactors | None,
        perm: Tensor | None = None,
        codebook: Tensor | None = None,
    ) -> QuantizedProjection:
        """Pack ``codes [E, O, I]`` (int, in range), ``scales [E, O, G]``, ``zeros [E, O, G]``
        (asymmetric), ``g_idx [E, I]`` (act-order), the factors and the rotation's column
        order ``perm [E, I]`` (``rotate_block`` specs; codes in the rotated basis) into a
        projection. GPTVQ specs: ``codes [E, O, I/d]`` centroid indices, ``scales
        [E, O/rows, G]`` and ``codebook [E, O/rows, G, K, d]`` int8.

        Raises:
            ValueError: shapes or presence of zeros/g_idx/codebook/factors disagree with
                ``spec``, or a scale or factor does not fit float16 (:func:`as_stored`).
        """
        E, rows, n = codes.shape
        proj = cls(E, rows, n * spec.vq_dim if spec.vector else n, spec)
        if scales.shape != proj.scales.shape:
            raise InvalidValueError(
                f"scales: expected {tuple(proj.scales.shape)}, got {tuple(scales.shape)}"
            )
        if (zeros is None) == spec.stores_zeros or (g_idx is None) == spec.act_order:
            raise InvalidValueError(
                "zeros/g_idx: must be given exactly for asymmetric / act-order specs"
            )
        if (codebook is None) == spec.vector or (
            codebook is not None and codebook.shape != proj.codebook.shape
        ):
            raise InvalidValueError(
                f"codebook: gptvq specs need int8 {tuple(proj.codebook.shape)}"
                if spec.vector
                else "codebook: only gptvq specs store one"
            )
        if codebook is not None:
            proj.codebook = codebook.to(torch.int8)
        if (lowrank is None) != (spec.lowrank == "none"):
            raise InvalidValueError(
                "lowrank: factors must be given exactly when spec.lowrank != 'none'"
            )
        if (perm is None) != (not spec.rotate_block):
            raise InvalidValueError("perm: must be given exactly for rotate_block specs")
        if perm is not None:
            if perm.shape != proj.perm.shape:
                raise InvalidValueError(
                    f"perm: expected {tuple(proj.perm.shape)}, got {tuple(perm.shape)}"
                )
            proj.perm = perm.to(torch.int16)
        proj.codes = pack_codes(codes, spec.index_bits)
        proj.scales = as_stored(scales, "scales").to(torch.float16).view(torch.int16)
        if zeros is not None:
            proj.zeros = pack_codes(zeros, spec.bits)
        if g_idx is not None:
            proj.g_idx = g_idx.to(torch.int16)
        if lowrank is not None:
            want = proj.lowrank
            if lowrank.U.shape != want.U.shape or lowrank.V.shape != want.V.shape:
                raise InvalidValueError(
                    f"lowrank: factor shapes {tuple(lowrank.U.shape)}, {tuple(lowrank.V.shape)} do "
                    f"not match the spec's {tuple(want.U.shape)}, {tuple(want.V.shape)}"
                )
            if (lowrank.in_scale is None) != (want.in_scale is None) or (
                lowrank.in_scale is not None and lowrank.in_scale.shape != want.in_scale.shape
            ):
                raise InvalidValueError("lowrank: in_scale does not match the spec's")
            for name in ("U", "V", "S", "in_scale"):  # stored as float16: memory == disk
                t = getattr(lowrank, name)
                if t is not None:
                    setattr(lowrank, name, as_stored(t, f"lowrank: factor {name}"))
            proj.lowrank = lowrank
        return proj

    @property
    def scale_values(self) -> Tensor:
        """``[E, O, G]`` float16 scales."""
        return self.scales.view(torch.float16)

    def unpacked_codes(self) -> Tensor:
        """``[E, O, I]`` int64 codes (gptvq: ``[E, O, I/d]`` centroid indices)."""
        return unpack_codes(self.codes, self.spec.index_bits, self.code_shape)

    def unpacked_zeros(self) -> Tensor | None:
        if self.zeros is None:
            return None
        return unpack_codes(self.zeros, self.spec.bits, self.scales.shape)

    def _unpack_experts(
        self, packed: Tensor, shape: tuple[int, ...], bits: int, experts: Tensor | None
    ):
        """uint8 codes ``[n, *shape[1:]]`` of ``bits`` bits of ``experts`` (all when None).
        Each expert's codes fill whole bytes when its code count is a multiple of 8 (or at 8
        bits), so only those experts' bytes are read; otherwise all are unpacked and the rows
        picked."""
        per = math.prod(shape[1:])
        if experts is None:
            return unpack_codes(packed, bits, shape, torch.uint8)
        if bits != 8 and per % 8:
            return unpack_codes(packed, bits, shape, torch.uint8).index_select(0, experts)
        rows = packed.view(shape[0], packed_size(per, bits)).index_select(0, experts)
        rows = rows.reshape(-1)
        return unpack_codes(rows, bits, (len(experts), *shape[1:]), torch.uint8)

    def dequantize(
        self, dtype: torch.dtype = torch.float32, experts: Tensor | None = None
    ) -> Tensor:
        """``[E, O, I]`` dequantized weights (without the low-rank correction; rotated back
        to the original basis, ``Q R_eᵀ``, for ``rotate_block`` specs), or ``[n, O, I]`` of
        the experts in the int64 index tensor ``experts [n]`` only (what a forward needs when
        some experts receive no rows: decode reads k of E experts' codes)."""
        pick = (lambda t: t) if experts is None else (lambda t: t.index_select(0, experts))
        spec = self.spec
        codes = self._unpack_experts(self.codes, self.code_shape, spec.index_bits, experts)
        if spec.vector:
            w = vq_dequantize(
                codes, pick(self.codebook), pick(self.scale_values), spec.vq_rows,
                spec.group_size, dtype,
            )  # fmt: skip
        else:
            zeros = None
            if self.zeros is not None:
                zeros = self._unpack_experts(
                    self.zeros, tuple(self.scales.shape), spec.bits, experts
                )
            g_idx = None if self.g_idx is None else pick(self.g_idx)
            w = dequantize(
                codes, pick(self.scale_values), zeros, spec.bits, spec.group_size, g_idx, dtype
            )
        if self.perm is not None:
            w = unrotate(w, pick(self.perm), self.spec.rotate_block)
        return w

    def kernel_mm(self, x: Tensor, counts: Tensor) -> Tensor:
        """``[N, O]`` rows of ``x [N, I]`` (float32, sorted by expert: ``counts [E]`` int64
        rows for each expert in order, zeros allowed) through the dequantized weights, without
        the low-rank correction, by the compiled decode kernel
        (:func:`cpu_kernel.quant_rows`: the packed codes read once per 8 rows of an expert).
        The caller checks that the kernel applies (:func:`kernel_applies`) and that no expert
        has more than :data:`KERNEL_MAX_ROWS` rows."""
        zeros = None
        if self.zeros is not None:
            zeros = self._unpack_experts(self.zeros, tuple(self.scales.shape), self.spec.bits, None)
        return cpu_kernel.quant_rows(
            x, counts, self.codes, self.scale_values, zeros, self.spec.bits, self.shape[1]
        )

    def weight(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """``[E, O, I]`` effective weights: dequantized plus the low-rank correction."""
        w = self.dequantize(dtype)
        if self.lowrank is not None:
            w = w + self.lowrank.dense().to(dtype)
        return w

    def storage_bytes(self) -> dict[str, int]:
        """Bytes as stored: ``codes``, ``scales`` (fp16), ``zeros``, ``g_idx``, ``perm`` (int16),
        ``codebook`` (int8) and ``lowrank`` (fp16 factors; the int64 grid map is metadata and
        not counted)."""
        return {
            "codes": self.codes.numel(),
            "codebook": self.codebook.numel() if self.codebook is not None else 0,
            "scales": self.scales.numel() * FLOAT_BYTES,
            "zeros": self.zeros.numel() if self.zeros is not None else 0,
            "g_idx": self.g_idx.numel() * 2 if self.g_idx is not None else 0,
            "perm": self.perm.numel() * 2 if self.perm is not None else 0,
            "lowrank": self.lowrank.extra_params() * FLOAT_BYTES if self.lowrank is not None else 0,
        }


class QuantizedExpertBank(nn.Module):
    """Drop-in :class:`~moelab.core.experts.ExpertBank` computed from quantized projections.

    Same forward contract: ``x_ND [N, D]`` rows sorted by expert, ``counts [E]`` → ``[N, D]``
    (plus ``[N, F]`` activations with ``return_activations``). ``w_in``/``w_down`` give the
    effective dense weights in the bank layout (``[E, D, 2F]`` / ``[E, F, D]``) for readers
    such as the analysis (computed on demand, not stored). Every activation of
    :class:`ExpertBank` is supported (gated ones have gate/up/down projections, the others
    up/down); expert biases (``config.bias``) stay in full precision as buffers ``b_in``
    ``[E, width]`` and ``b_down`` ``[E, D]``.

    Raises:
        ValueError: ``config.lora_rank`` is set (merge the adapters first).
    """

    def __init__(
        self, config: ExpertsConfig, num_experts: int, spec: QuantSpec, backend: str = "auto"
    ):
        super().__init__()
        if config.lora_rank:
            raise InvalidValueError(
                "model: the experts carry LoRA adapters; merge them first (moelab merge-lora)"
            )
        self.config = config
        self.num_experts = num_experts
        self.spec = spec
        self.backend = backend
        D, Fh = config.hidden_size, config.ffn_hidden_size
        gated = config.activation in GATED_ACTIVATIONS
        names = ("gate", "up", "down") if gated else ("up", "down")
        width = 2 * Fh if gated else Fh
        self.register_buffer("b_in", torch.zeros(num_experts, width) if config.bias else None)
        self.register_buffer("b_down", torch.zeros(num_experts, D) if config.bias else None)
        self.proj_names = names
        self.projections = nn.ModuleDict(
            {
                n: QuantizedProjection(
                    num_experts, D if n == "down" else Fh, Fh if n == "down" else D, spec
                )
                for n in names
            }
        )

    @classmethod
    def empty(cls, config: ExpertsConfig, num_experts: int, spec: QuantSpec) -> QuantizedExpertBank:
        """A bank with zero-filled buffers of the right shapes (fill with ``load_state_dict``)."""
        return cls(config, num_experts, spec)

    @classmethod
    def from_projections(
        cls,
        config: ExpertsConfig,
        num_experts: int,
        spec: QuantSpec,
        projections: dict[str, QuantizedProjection],
        biases: tuple[Tensor, Tensor] | None = None,
    ) -> QuantizedExpertBank:
        bank = cls(config, num_experts, spec)
        if (biases is not None) != bool(config.bias):
            raise InvalidValueError("biases: give (b_in, b_down) exactly when config.bias is set")
        if biases is not None:
            bank.b_in, bank.b_down = (b.detach().clone() for b in biases)
        if set(projections) != set(bank.proj_names):
            raise InvalidValueError(
                f"projections: expected {bank.proj_names}, got {sorted(projections)}"
            )
        for name, p in projections.items():
            if p.shape != bank.projections[name].shape:
                raise InvalidValueError(
                    f"projections[{name!r}]: shape {p.shape}, expected {bank.projections[name].shape}"
                )
            bank.projections[name] = p
        return bank

    activation = ExpertBank.activation

    @property
    def _dtype(self) -> torch.dtype:
        """The compute dtype: the low-rank factors' if any (they follow model casts), else
        float32."""
        for p in self.projections.values():
            if p.lowrank is not None:
                return p.lowrank.U.dtype
        return torch.float32

    def _w_in(self, dtype: torch.dtype) -> Tensor:
        ws = [self.projections[n].weight(dtype) for n in self.proj_names[:-1]]
        return torch.cat(ws, dim=1).transpose(1, 2).contiguous()

    @property
    def w_in(self) -> Tensor:
        """Effective input projection ``[E, D, 2F]`` (swiglu) or ``[E, D, F]``."""
        return self._w_in(self._dtype)

    @property
    def w_down(self) -> Tensor:
        """Effective down projection ``[E, F, D]``."""
        return self.projections["down"].weight(self._dtype).transpose(1, 2).contiguous()

    def _compute(
        self,
        x_ND: Tensor,
        counts: Tensor,
        down_lowrank: bool,
        x_TD: Tensor | None = None,
        token_idx: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(expert rows [N, D], activations [N, F], counts [E])``; ``x_TD``/``token_idx``
        (``x_ND == x_TD[token_idx]``) let the gate/up corrections project each token once."""
        dt = x_ND.dtype
        all_counts = counts
        active = None
        kernel = self._use_kernel(x_ND, counts)
        if not kernel:
            # Only the experts that receive rows are dequantized (rows stay sorted by expert,
            # so dropping the empty groups keeps the grouped matmul's layout).
            active = counts.nonzero().squeeze(1)
            if len(active) == len(counts):
                active = None
            else:
                counts = counts[active]
        h = torch.cat(
            [self._project(n, x_ND, counts, active, kernel) for n in self.proj_names[:-1]], dim=1
        )
        corr = [
            self.projections[n].lowrank.apply_rows(x_ND, all_counts, x_TD, token_idx)
            for n in self.proj_names[:-1]
            if self.projections[n].lowrank is not None
        ]
        if corr:
            h = h + torch.cat(corr, dim=-1)
        if self.b_in is not None:
            h = h + self.b_in.to(dt)[expert_of_rows(all_counts)]
        a = self.activation(h)
        down = self.projections["down"]
        y = self._project("down", a, counts, active, kernel)
        if self.b_down is not None:
            y = y + self.b_down.to(dt)[expert_of_rows(all_counts)]
        if down_lowrank and down.lowrank is not None:
            y = y + down.lowrank.apply_rows(a, all_counts)
        return y, a, all_counts

    def _use_kernel(self, x: Tensor, counts: Tensor) -> bool:
        """Whether this forward's projections run the compiled decode kernel
        (``csrc/quant_cpu.cpp``), which reads the packed codes instead of writing and
        re-reading a float32 copy: 4 or 8 bits in float32 without gradients
        (:func:`kernel_applies`), at most :data:`KERNEL_MAX_ROWS` rows per expert. Act-order,
        rotated or 2/3-bit codes, other dtypes, larger batches and gradients take
        dequantization plus the grouped matmul (the same values up to float rounding; with
        :func:`cpu_kernel.int8_activations` the kernel's rows are quantized to int8 per group
        first). Decided once per forward: every projection shares the spec and the rows. A
        call of at most :data:`KERNEL_MAX_ROWS` rows (every decode step) is decided without
        reading ``counts``, so torch.compile traces it without a break."""
        n = x.shape[0]
        return (
            kernel_applies(self.spec, x)
            and n > 0
            and (n <= KERNEL_MAX_ROWS or int(counts.max()) <= KERNEL_MAX_ROWS)
        )

    def _project(
        self, name: str, x: Tensor, counts: Tensor, active: Tensor | None, kernel: bool
    ) -> Tensor:
        """Rows ``x [N, I]`` (sorted by expert: ``counts`` rows for each of the ``active``
        experts, or of every expert when None) through projection ``name``'s dequantized
        weights, without its low-rank correction: ``[N, O]`` (``kernel``: see
        :meth:`_use_kernel`; ``counts`` is then every expert's)."""
        proj = self.projections[name]
        if kernel:
            return proj.kernel_mm(x, counts)
        w = proj.dequantize(x.dtype, active).transpose(1, 2).contiguous()
        return grouped_mm(x, w, counts, self.backend)

    def forward(self, x_ND: Tensor, counts: Tensor, return_activations: bool = False):
        """Expert outputs ``[N, D]`` for rows sorted by expert (see :class:`ExpertBank`)."""
        y, a, _ = self._compute(x_ND, counts, True)
        return (y, a) if return_activations else y

    def forward_combined(
        self, d, num_tokens: int, combine: Callable, x_TD: Tensor | None = None
    ) -> Tensor:
        """Experts plus combine in one: TileQ's single pass (module doc of
        :mod:`moelab.core.experts.lowrank`) — the gate/up corrections project each token of
        ``x_TD`` once where the factors allow it, and the TileQ schemes' down correction is
        accumulated per token with the routing weights after ``combine(expert rows)``.

        Args:
            d: the dispatcher's :class:`~moelab.core.dispatch.Dispatched` rows.
            num_tokens: T.
            combine: ``combine(y_ND, d, T) -> [T, D]`` (the dispatcher's).
            x_TD: ``[T, D]`` the tokens ``d.x`` was gathered from (``d.x == x_TD[d.token_idx]``);
                None projects every row.
        Returns:
            ``[T, D]`` float32 (float64 for float64 inputs).
        """
        lr = self.projections["down"].lowrank
        fuse = lr is not None and lr.accumulates_tokens
        token_idx = d.token_idx if x_TD is not None else None
        y_rows, a, counts = self._compute(d.x, d.counts, not fuse, x_TD, token_idx)
        y = combine(y_rows, d, num_tokens)
        if not fuse:
            return y
        w = d.weight if d.weight is not None else d.pair_weight[d.order]
        return y + lr.apply_tokens(a, counts, d.token_idx, w, num_tokens).to(y.dtype)

    def expert_output(self, x_TD: Tensor, expert: int) -> Tensor:
        """Output of one expert on all tokens ``[T, D]`` (effective weights)."""
        dt = x_TD.dtype
        w_in = self._w_in(dt)[expert]
        w_down = self.projections["down"].weight(dt)[expert].T
        h = x_TD @ w_in
        if self.b_in is not None:
            h = h + self.b_in[expert].to(dt)
        y = self.activation(h) @ w_down
        return y + self.b_down[expert].to(dt) if self.b_down is not None else y

    def storage_bytes(self) -> dict[str, int]:
        """Stored bytes per component summed over projections (see QuantizedProjection)."""
        total: dict[str, int] = {}
        for p in self.projections.values():
            for k, v in p.storage_bytes().items():
                total[k] = total.get(k, 0) + v
        return total

    def num_weights(self) -> int:
        """Expert weight entries represented (``Σ_proj E·O·I``)."""
        return sum(p.shape[0] * p.shape[1] * p.shape[2] for p in self.projections.values())
