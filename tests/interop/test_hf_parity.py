"""moelab's logits equal transformers' for imported Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE
checkpoints, in both expert layouts; exported folders load back into transformers."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from moelab.interop import export_hf, import_hf

ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]
LAYOUTS = ["per_expert", "fused"]
ATOL = 1e-4


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(seed))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_imported_logits_match_transformers(hf, tmp_path, arch, layout):
    ref_model = hf.model(arch)
    folder = hf.save(ref_model, tmp_path / "hf", layout)
    model, meta = import_hf(folder)
    assert meta.arch == arch and meta.layout == layout
    ids = _ids()
    with torch.no_grad():
        ref, got = ref_model(ids).logits, model(ids).logits
    diff = _max_diff(ref, got)
    print(f"{arch} {layout}: max |Δlogit| = {diff:.2e}")
    assert diff < ATOL
    assert ref.abs().amax() > 0.5  # not vacuous


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hidden_equals_expert_width(hf, tmp_path, layout):
    """D == F: the orientation of each expert tensor comes from its name, not its shape."""
    ref_model = hf.model("mixtral", intermediate_size=32)  # hidden_size 32
    model, _ = import_hf(hf.save(ref_model, tmp_path / "hf", layout))
    ids = _ids(1)
    with torch.no_grad():
        assert _max_diff(ref_model(ids).logits, model(ids).logits) < ATOL
    fused = ref_model.model.layers[0].mlp.experts
    bank = model.blocks[0].ffn.experts
    assert torch.equal(bank.w_gate_up, fused.gate_up_proj.detach().transpose(1, 2))
    assert torch.equal(bank.w_down, fused.down_proj.detach().transpose(1, 2))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_export_loads_in_transformers_with_identical_logits(hf, tmp_path, arch, layout):
    ref_model = hf.model(arch, seed=3)
    model, meta = import_hf(hf.save(ref_model, tmp_path / "hf", "per_expert"))
    out = export_hf(model, tmp_path / "out", arch, layout=layout, base_config=meta.hf_config)
    back = hf.transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ref_state, back_state = ref_model.state_dict(), back.state_dict()
    assert set(ref_state) == set(back_state)
    for name, t in ref_state.items():
        assert torch.equal(t, back_state[name]), name
    ids = _ids(2)
    with torch.no_grad():
        assert torch.equal(ref_model(ids).logits, back(ids).logits)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_is_bit_exact_for_every_tensor(hf, tmp_path, arch, layout):
    ref_model = hf.model(arch, seed=4)
    src = hf.save(ref_model, tmp_path / "hf", layout)
    model, _ = import_hf(src)
    out = export_hf(model, tmp_path / "out", arch, layout=layout)
    a, b = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    again, _ = import_hf(out)
    for (n, x), (_, y) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(x, y), n


def test_bf16_round_trip_keeps_dtype_and_bits(hf, tmp_path):
    ref_model = hf.model("qwen2_moe", seed=5).to(torch.bfloat16)
    src = hf.save(ref_model, tmp_path / "hf", "fused")
    model, _ = import_hf(src)
    assert model.embed.weight.dtype == torch.bfloat16
    out = export_hf(model, tmp_path / "out", "qwen2_moe", layout="fused")
    a, b = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    assert all(torch.equal(a[n], b[n]) and b[n].dtype == torch.bfloat16 for n in a)


def test_sharded_checkpoint(hf, tmp_path):
    ref_model = hf.model("olmoe", seed=6)
    ref_model.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    model, _ = import_hf(tmp_path / "hf")
    ids = _ids(3)
    with torch.no_grad():
        assert _max_diff(ref_model(ids).logits, model(ids).logits) < ATOL


def test_qwen2_moe_without_qkv_bias(hf, tmp_path):
    ref_model = hf.model("qwen2_moe", qkv_bias=False, mlp_only_layers=[])
    model, _ = import_hf(hf.save(ref_model, tmp_path / "hf", "per_expert"))
    assert not model.cfg.attention_bias and model.cfg.first_dense_layers == 0
    ids = _ids(4)
    with torch.no_grad():
        assert _max_diff(ref_model(ids).logits, model(ids).logits) < ATOL
