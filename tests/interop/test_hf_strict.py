"""Strictness: missing/extra/mis-shaped tensors, config/weights disagreement, unsupported
settings, and the expert layouts written by hand (independently of the converter)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from moelab.interop import (
    ConfigMismatchError,
    InteropError,
    MissingTensorError,
    TensorShapeError,
    UnexpectedTensorError,
    UnsupportedConfigError,
    config_from_hf,
    detect_layout,
    export_hf,
    import_hf,
)
from moelab.models import ModelConfig, MoETransformer


@pytest.fixture
def qwen2_folder(hf, tmp_path):
    model = hf.model("qwen2_moe", seed=1)
    return hf.save(model, tmp_path / "hf", "fused"), model


def _edit_weights(folder, fn):
    path = folder / "model.safetensors"
    t = load_file(path)
    fn(t)
    save_file(t, path, metadata={"format": "pt"})


def _edit_config(folder, **changes):
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def test_errors_are_value_errors():
    for cls in (MissingTensorError, UnexpectedTensorError, TensorShapeError, ConfigMismatchError):
        assert issubclass(cls, InteropError) and issubclass(cls, ValueError)


def test_missing_tensor_is_named(qwen2_folder):
    folder, _ = qwen2_folder
    _edit_weights(folder, lambda t: t.pop("model.layers.1.mlp.shared_expert_gate.weight"))
    with pytest.raises(MissingTensorError, match=r"model\.layers\.1\.mlp\.shared_expert_gate"):
        import_hf(folder)


def test_extra_tensor_is_named(qwen2_folder):
    folder, _ = qwen2_folder
    _edit_weights(folder, lambda t: t.update({"model.layers.0.mlp.mystery.weight": torch.ones(3)}))
    with pytest.raises(UnexpectedTensorError, match=r"model\.layers\.0\.mlp\.mystery\.weight"):
        import_hf(folder)


def test_extra_o_proj_bias_is_not_dropped(qwen2_folder):
    folder, _ = qwen2_folder
    _edit_weights(
        folder, lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": torch.ones(32)})
    )
    with pytest.raises(UnexpectedTensorError, match=r"o_proj\.bias"):
        import_hf(folder)


def test_shape_mismatch_names_tensor_and_both_shapes(qwen2_folder):
    folder, _ = qwen2_folder
    name = "model.layers.2.mlp.experts.down_proj"
    _edit_weights(folder, lambda t: t.update({name: torch.zeros(4, 32, 20)}))
    with pytest.raises(TensorShapeError, match=r"down_proj.*\(4, 32, 20\).*\(4, 32, 24\)") as e:
        import_hf(folder)
    assert "moe_intermediate_size=24" in str(e.value)


def test_config_expert_count_disagreeing_with_weights_names_field(hf, tmp_path):
    folder = hf.save(hf.model("qwen2_moe"), tmp_path / "hf", "per_expert")
    _edit_config(folder, num_experts=5)
    with pytest.raises(ConfigMismatchError, match=r"num_experts: config\.json says 5.*4 experts"):
        import_hf(folder)


def test_config_fused_expert_count_disagreement(qwen2_folder):
    folder, _ = qwen2_folder
    _edit_config(folder, num_experts=5)
    with pytest.raises(ConfigMismatchError, match=r"num_experts=5"):
        import_hf(folder)


def test_config_layer_count_disagreeing_with_weights(qwen2_folder):
    folder, _ = qwen2_folder
    _edit_config(folder, num_hidden_layers=2)
    with pytest.raises(ConfigMismatchError, match=r"num_hidden_layers: config\.json says 2"):
        import_hf(folder)


def test_tied_config_with_different_lm_head(hf, tmp_path):
    folder = hf.save(hf.model("mixtral"), tmp_path / "hf", "fused")
    _edit_config(folder, tie_word_embeddings=True)
    with pytest.raises(ConfigMismatchError, match="tie_word_embeddings"):
        import_hf(folder)


def test_mixed_layouts_rejected():
    with pytest.raises(InteropError, match="mixes"):
        detect_layout(["a.mlp.experts.gate_up_proj", "b.mlp.experts.0.gate_proj.weight"])


def _base(arch):
    return {
        "model_type": arch,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 50,
        "num_experts_per_tok": 2,
        "num_local_experts": 4,
        "num_experts": 4,
        "intermediate_size": 16,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 16,
    }


@pytest.mark.parametrize(
    "arch,change,field",
    [
        ("mixtral", {"sliding_window": 4096}, "sliding_window"),
        ("qwen2_moe", {"use_sliding_window": True}, "use_sliding_window"),
        ("qwen2_moe", {"layer_types": ["sliding_attention"] * 2}, "layer_types"),
        ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step"),  # 2 is supported now
        ("qwen2_moe", {"mlp_only_layers": [7]}, "mlp_only_layers"),  # [1] is supported now
        ("qwen3_moe", {"attention_bias": True}, "attention_bias"),
        ("olmoe", {"clip_qkv": 8.0}, "clip_qkv"),
        ("olmoe", {"head_dim": 16}, "head_dim"),
        ("mixtral", {"hidden_act": "gelu"}, "hidden_act"),
        ("mixtral", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
        ("mixtral", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
        ("deepseek_v3", {}, "model_type"),
        ("llama", {}, "model_type"),
    ],
)
def test_unsupported_settings_name_the_field(arch, change, field):
    cfg = _base(arch)
    cfg.update(change)
    with pytest.raises(UnsupportedConfigError, match=field):
        config_from_hf(cfg)


def test_config_mapping_fields():
    cfg, _ = config_from_hf(
        {
            **_base("qwen2_moe"),
            "mlp_only_layers": [0],
            "norm_topk_prob": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
            "num_key_value_heads": 2,
            "max_position_embeddings": 128,
            "router_aux_loss_coef": 0.01,
        }
    )
    r, ex = cfg.moe.router, cfg.moe.experts
    assert (cfg.first_dense_layers, cfg.dense_ffn_size, cfg.attention_bias) == (1, 16, True)
    assert (cfg.rope_theta, cfg.norm_eps, cfg.tie_embeddings) == (5e5, 1e-6, True)
    assert (cfg.n_kv_heads, cfg.max_seq_len, cfg.qk_norm) == (2, 128, "none")
    assert (r.score_func, r.softmax_before_topk, r.norm_topk_prob) == ("softmax", True, True)
    assert (ex.shared_expert_size, ex.shared_expert_gate) == (16, True)
    assert cfg.moe.losses.convention == "hf" and cfg.moe.losses.aux_loss_coeff == 0.01
    legacy, _ = config_from_hf({**_base("mixtral"), "rope_theta": 1e6})
    assert legacy.rope_theta == 1e6 and legacy.moe.router.norm_topk_prob


@pytest.mark.parametrize(
    "arch,cfg_kw,field",
    [
        ("mixtral", dict(qk_norm="head"), "qk_norm"),
        ("qwen3_moe", dict(), "qk_norm"),
        ("olmoe", dict(qk_norm="full", attention_bias=True), "attention_bias"),
        ("qwen2_moe", dict(attention_bias=True), "shared_expert_size"),
        ("mixtral", dict(first_dense_layers=1), "first_dense_layers"),
        ("gpt2", dict(), "arch"),
    ],
)
def test_export_rejects_what_the_arch_cannot_express(tmp_path, arch, cfg_kw, field):
    model = MoETransformer(ModelConfig.tiny(**cfg_kw))
    with pytest.raises(UnsupportedConfigError, match=field):
        export_hf(model, tmp_path / "out", arch)
    assert not (tmp_path / "out").exists()


def test_export_rejects_router_features(tmp_path):
    cfg = ModelConfig.tiny()
    cfg.moe.router.score_func = "sigmoid"
    with pytest.raises(UnsupportedConfigError, match=r"moe\.router\.score_func"):
        export_hf(MoETransformer(cfg), tmp_path / "out", "mixtral")


# ---------------------------------------------------------------- hand-written layouts
def _per_expert_by_hand(fused: dict, arch: str) -> dict:
    """Split the fused v5 tensors into one nn.Linear per expert (independent of moelab)."""
    out = {}
    for name, t in fused.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            pre = name.removesuffix("experts.gate_up_proj")
            F = t.shape[1] // 2
            for e in range(t.shape[0]):
                if arch == "mixtral":
                    p = pre.replace(".mlp.", ".block_sparse_moe.")
                    out[f"{p}experts.{e}.w1.weight"] = t[e, :F].clone()
                    out[f"{p}experts.{e}.w3.weight"] = t[e, F:].clone()
                else:
                    out[f"{pre}experts.{e}.gate_proj.weight"] = t[e, :F].clone()
                    out[f"{pre}experts.{e}.up_proj.weight"] = t[e, F:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            pre = name.removesuffix("experts.down_proj")
            for e in range(t.shape[0]):
                if arch == "mixtral":
                    p = pre.replace(".mlp.", ".block_sparse_moe.")
                    out[f"{p}experts.{e}.w2.weight"] = t[e].clone()
                else:
                    out[f"{pre}experts.{e}.down_proj.weight"] = t[e].clone()
        elif arch == "mixtral" and name.endswith("mlp.gate.weight"):
            out[name.replace(".mlp.", ".block_sparse_moe.")] = t
        else:
            out[name] = t
    return out


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
@pytest.mark.parametrize("square", [False, True], ids=["D!=F", "D==F"])
def test_hand_written_per_expert_layout_equals_fused(hf, tmp_path, arch, square):
    over = {}
    if square:
        over = {
            "intermediate_size" if arch in ("mixtral", "olmoe") else "moe_intermediate_size": 32
        }
    ref = hf.model(arch, seed=7, **over)
    fused_dir = hf.save(ref, tmp_path / "fused", "fused")
    per_dir = tmp_path / "per"
    per_dir.mkdir()
    (per_dir / "config.json").write_text((fused_dir / "config.json").read_text())
    tensors = load_file(fused_dir / "model.safetensors")
    save_file(_per_expert_by_hand(tensors, arch), per_dir / "model.safetensors")
    a, meta_a = import_hf(fused_dir)
    b, meta_b = import_hf(per_dir)
    assert (meta_a.layout, meta_b.layout) == ("fused", "per_expert")
    for (n, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), n
    ids = torch.randint(0, 97, (1, 9))
    with torch.no_grad():
        assert float((ref(ids).logits - b(ids).logits).abs().max()) < 1e-4
    # and export reproduces the hand-written file exactly
    out = export_hf(b, tmp_path / "out", arch, layout="per_expert")
    back = load_file(out / "model.safetensors")
    want = load_file(per_dir / "model.safetensors")
    assert set(back) == set(want) and all(torch.equal(back[n], want[n]) for n in want)
