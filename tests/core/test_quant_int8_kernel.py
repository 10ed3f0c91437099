"""The quantized decode kernel's integer path (int8 activations, AVX-512 VNNI dot products)
against a float64 reference of the same quantization, and its switch."""

import pytest
import torch
import torch.nn.functional as F

from moelab.core.config import ExpertsConfig
from moelab.core.experts import cpu_kernel
from moelab.core.experts.qformat import pack_codes
from moelab.core.experts.quantized import QuantizedExpertBank, QuantizedProjection, QuantSpec

_k = cpu_kernel.kernel()
needs_vnni = pytest.mark.skipif(
    _k is None or not _k.int8_dot_supported(), reason="needs the kernel on an AVX-512 VNNI CPU"
)


def int8_reference(x, counts, experts, codes, scales, zeros, bits, group):
    """Rows quantized per group (step max|x|/127, round half to even, as llama.cpp's Q8
    activations), then s·d·(Σ c·q − z·Σ q) per group, all in float64."""
    N, K = x.shape
    xg = x.view(N, K // group, group)
    amax = xg.abs().amax(-1, keepdim=True)
    q = torch.round(xg * torch.where(amax > 0, 127 / amax, 0.0)).clamp(-127, 127).double()
    d = (amax / 127).squeeze(-1).double()
    out, start = [], 0
    for c, e in zip(counts, experts, strict=True):
        qe, de = q[start : start + c], d[start : start + c]
        w = codes[e].double().view(codes.shape[1], K // group, group)
        z = zeros[e].double() if zeros is not None else torch.full_like(w[..., 0], 2 ** (bits - 1))
        dot = torch.einsum("cgj,ogj->cog", qe, w) - z[None] * qe.sum(-1)[:, None, :]
        out.append((dot * scales[e].double()[None] * de[:, None, :]).sum(-1))
        start += c
    return torch.cat(out)


@needs_vnni
@pytest.mark.parametrize(
    ("bits", "group", "symmetric"), [(8, 64, True), (8, 128, False), (4, 64, True), (4, 128, False)]
)
def test_integer_path_equals_the_int8_reference(bits, group, symmetric):
    g = torch.Generator().manual_seed(bits * group)
    E, n_out, K = 4, 80, 256
    codes = torch.randint(0, 1 << bits, (E, n_out, K), generator=g)
    scales = ((torch.rand(E, n_out, K // group, generator=g) + 0.5) / (1 << bits)).half()
    zeros = None
    if not symmetric:
        zeros = torch.randint(0, 1 << bits, (E, n_out, K // group), generator=g).to(torch.uint8)
    counts, experts = [2, 8, 1, 3], [3, 0, 2, 0]
    x = torch.randn(sum(counts), K, generator=g)
    x[1, :group] = 0.0  # an all-zero group: step 0, no division by zero
    packed = pack_codes(codes, bits)
    got = _k.quant_experts_mm(x, counts, experts, packed, scales, zeros, bits, n_out, True)
    ref = int8_reference(x, counts, experts, codes, scales.float(), zeros, bits, group)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    # and the float path is the unquantized product, which the int8 rows approximate
    exact = _k.quant_experts_mm(x, counts, experts, packed, scales, zeros, bits, n_out, False)
    err = (got - exact).abs().max() / exact.abs().max()
    assert 0 < err < 0.02


@needs_vnni
def test_groups_not_a_multiple_of_64_take_the_float_path():
    g = torch.Generator().manual_seed(1)
    E, n_out, K, group = 2, 16, 96, 32
    codes = torch.randint(0, 256, (E, n_out, K), generator=g)
    scales = torch.rand(E, n_out, K // group, generator=g).half()
    x = torch.randn(3, K, generator=g)
    packed = pack_codes(codes, 8)
    on = _k.quant_experts_mm(x, [3], [1], packed, scales, None, 8, n_out, True)
    off = _k.quant_experts_mm(x, [3], [1], packed, scales, None, 8, n_out, False)
    assert torch.equal(on, off)


def _bank(bits, group):
    E, D, Fh = 3, 128, 128
    spec = QuantSpec(method="rtn", bits=bits, group_size=group, symmetric=True,
                     act_order=False, lowrank="none", rank=0)  # fmt: skip
    g = torch.Generator().manual_seed(bits)

    def proj(d_out, d_in):
        codes = torch.randint(0, 1 << bits, (E, d_out, d_in), generator=g)
        scales = (torch.rand(E, d_out, d_in // group, generator=g) + 0.5) / (1 << bits)
        return QuantizedProjection.from_codes(spec, codes, scales, None, None, None)

    projs = {"gate": proj(Fh, D), "up": proj(Fh, D), "down": proj(D, Fh)}
    cfg = ExpertsConfig(hidden_size=D, ffn_hidden_size=Fh)
    return QuantizedExpertBank.from_projections(cfg, E, spec, projs), projs


@pytest.mark.skipif(_k is None, reason="no C++ toolchain")
@pytest.mark.parametrize("bits", [8, 4])
def test_the_switch_off_gives_the_dequantized_weights_values(bits, monkeypatch):
    """MOELAB_INT8_ACTIVATIONS=0: decode rows equal the float64 product with the dequantized
    weights; on a VNNI CPU with the switch on they differ by the activations' rounding only."""
    bank, projs = _bank(bits, 64)
    w = {n: p.dequantize(torch.float64) for n, p in projs.items()}
    counts = torch.tensor([2, 0, 3])
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(5))
    r = x.double()
    ref = torch.cat(
        [
            (F.silu(r[s] @ w["gate"][e].T) * (r[s] @ w["up"][e].T)) @ w["down"][e].T
            for e, s in ((0, slice(0, 2)), (2, slice(2, 5)))
        ]
    )
    monkeypatch.setenv("MOELAB_INT8_ACTIVATIONS", "0")
    assert not cpu_kernel.int8_activations()
    with torch.no_grad():
        off = bank(x, counts)
    torch.testing.assert_close(off.double(), ref, rtol=1e-4, atol=1e-5)
    monkeypatch.setenv("MOELAB_INT8_ACTIVATIONS", "1")
    if not _k.int8_dot_supported():
        return
    assert cpu_kernel.int8_activations()
    with torch.no_grad():
        on = bank(x, counts)
    err = ((on.double() - ref).abs().max() / ref.abs().max()).item()
    assert 0 < err < 0.03
