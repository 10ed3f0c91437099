"""GGUF export for llama.cpp: export → moelab's GGUF reader → identical logits per architecture
and type (float and llama.cpp's block types), metadata read back, one-line refusals naming the
field, the CLI, and (where llama-cpp-python is installed) llama.cpp's own greedy tokens and
``llama_model_quantize``'s bytes."""

from __future__ import annotations

import copy
import json
from collections import Counter

import numpy as np
import pytest
import torch
import typer
from typer.testing import CliRunner

from moelab.cli.convert import convert_command
from moelab.core.config import ExpertsConfig, MoEConfig, RouterConfig
from moelab.core.latent_moe import LatentMoEConfig
from moelab.data.tokenizer import BPETokenizer, ByteTokenizer
from moelab.interop import UnexpectedTensorError, UnsupportedConfigError, export_gguf
from moelab.interop.gguf import load_gguf, read_gguf, read_gguf_metadata
from moelab.interop.gguf_layout import GGUF_ARCHS, gguf_rules
from moelab.interop.gguf_quants import quantize_ggml
from moelab.interop.gguf_vocab import byte_vocab_tokens, unescape_rwkv
from moelab.models import ModelConfig, MoETransformer, save_model
from moelab.serve.chat import PLAIN_TEMPLATE, ChatTemplate

gguf = pytest.importorskip("gguf", reason="needs the gguf package: pip install gguf")

TEXT = "the cat sat on 4567 mats<|endoftext|> and the dog"


@pytest.fixture(scope="module")
def tok() -> BPETokenizer:
    texts = ["the cat sat on the mat 123", "a dog and 4567 cats", "the mat is flat"] * 20
    return BPETokenizer.train(texts, 300, min_frequency=2)


def _model(
    vocab: int, seed: int = 0, router: dict | None = None, experts: dict | None = None, **kw
):
    """A random tiny MoE model, every weight O(1) in effect (D=64, F=32: whole Q8_0 blocks;
    ``d_model`` in ``kw`` widens it)."""
    d_model = kw.pop("d_model", 64)
    ex = dict(hidden_size=d_model, ffn_hidden_size=32) | (experts or {})
    moe = kw.pop("moe", MoEConfig(RouterConfig(**(dict(num_experts=4, top_k=2) | (router or {}))), ExpertsConfig(**ex)))  # fmt: skip
    cfg = ModelConfig(
        vocab_size=vocab, d_model=d_model, n_layers=2, n_heads=4, n_kv_heads=kw.pop("n_kv_heads", 2),
        max_seq_len=96, rope_theta=5e4, norm_eps=1e-6, moe=moe, **kw,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = MoETransformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 0.6 / p.shape[-1] ** 0.5)
    return model.eval()


ARCH_MODELS = {
    "llama": dict(),
    "qwen2moe": dict(
        attention_bias=True,
        router=dict(norm_topk_prob=False),
        experts=dict(shared_expert_size=32, shared_expert_gate=True),
    ),
    "qwen3moe": dict(qk_norm="head", tie_embeddings=True, head_dim=32),
    "olmoe": dict(qk_norm="full", n_kv_heads=4, router=dict(norm_topk_prob=False)),
}


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """C's roundf (half away from zero), as ggml's reference quantizer uses it."""
    a = x.abs()
    return x.sign() * (a.floor() + (2 * (a - a.floor())).floor())


def _q8_0(w: torch.Tensor, dim: int) -> torch.Tensor:
    """ggml's Q8_0 along ``dim``, dequantised: blocks of 32, d = max|w|/127 stored as fp16,
    q = roundf(w/d) as int8 (``quantize_row_q8_0_ref``), value = q·d."""
    x = w.float().movedim(dim, -1)
    blocks = x.reshape(-1, 32)
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = _roundf(blocks * inv)
    out = q * d.half().float()
    return out.reshape(x.shape).movedim(-1, dim)


def _input_dim(name: str) -> int:
    """The axis each GGUF row runs along in moelab's layout (the matmul's input axis)."""
    if name.endswith(("experts.w_gate_up", "experts.w_down")):
        return 1
    if name.endswith(("shared_expert.w_gate_up", "shared_expert.w_down")):
        return 0
    return -1


def _blocks(w: torch.Tensor, dim: int, outtype: str) -> torch.Tensor:
    """``w`` quantized to llama.cpp's ``outtype`` blocks along ``dim`` and dequantized by
    ``gguf.quants.dequantize`` (what moelab's reader must give back)."""
    qtype = gguf.GGMLQuantizationType[outtype.upper()]
    x = w.float().movedim(dim, -1).contiguous().numpy()
    q = quantize_ggml(x, qtype.name)
    return torch.from_numpy(gguf.quants.dequantize(q, qtype)).movedim(-1, dim)


def _as_stored(model: MoETransformer, outtype: str) -> MoETransformer:
    """``model`` with every matrix rounded as the GGUF file stores it (routers, the shared
    expert's gate, norms and biases stay float32), derived here without the exporter."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in out.named_parameters():
            if p.dim() < 2 or name.endswith(("router.weight", "shared_expert.gate")):
                continue
            if outtype == "q8_0":
                p.copy_(_q8_0(p, _input_dim(name)))
            elif outtype.startswith("q"):
                p.copy_(_blocks(p, _input_dim(name), outtype))
            elif outtype != "f32":
                p.copy_(p.to(torch.float16 if outtype == "f16" else torch.bfloat16).float())
    return out


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))


def _reloaded(path, model: MoETransformer, outtype: str):
    """``(model read back, (its logits, the model-as-stored's, the model's))`` on ``_ids``."""
    loaded, _ = load_gguf(path)
    ids = _ids(model.cfg.vocab_size)
    with torch.no_grad():
        logits = loaded(ids).logits, _as_stored(model, outtype)(ids).logits, model(ids).logits
    return loaded, logits


@pytest.mark.parametrize("outtype", ["f32", "f16", "bf16", "q8_0"])
@pytest.mark.parametrize("arch", sorted(ARCH_MODELS))
def test_round_trip_logits_identical(tmp_path, tok, arch, outtype):
    model = _model(tok.vocab_size, **ARCH_MODELS[arch])
    report = export_gguf(model, tmp_path / "m.gguf", tokenizer=tok, outtype=outtype)
    assert report.arch == arch
    loaded, (got, want, exact) = _reloaded(report.path, model, outtype)
    assert torch.equal(got, want)
    if outtype == "f32":
        assert torch.equal(got, exact)
    else:  # the stored model is a different model: the test sees the rounding
        err = float((got - exact).abs().max())
        bound = {"f16": 0.02, "bf16": 0.2, "q8_0": 1.0}[outtype]
        assert 0 < err < bound, err
    types = read_gguf(report.path).tensor_types
    assert types["blk.0.ffn_gate_inp.weight"] == "F32"
    assert types["blk.1.ffn_down_exps.weight"] == outtype.upper()
    assert loaded.cfg.tie_embeddings == model.cfg.tie_embeddings


def _wide(arch: str, ffn: int = 256) -> dict:
    """``ARCH_MODELS[arch]`` at D=256 with every matrix row a whole Q4_K super-block (expert
    width ``ffn``; the shared expert and heads widened to 256 and 64)."""
    kw = copy.deepcopy(ARCH_MODELS[arch]) | dict(d_model=256)
    kw["experts"] = kw.get("experts", {}) | dict(ffn_hidden_size=ffn)
    if "shared_expert_size" in kw["experts"]:
        kw["experts"]["shared_expert_size"] = 256
    if "head_dim" in kw:
        kw["head_dim"] = 64
    return kw


# RMS(Δlogit)/RMS(logit) against the float32 model, measured on these random models (the four
# architectures): q8_0 0.012-0.033, q5_1 0.08-0.12, q5_0 0.09-0.15, q4_k 0.17-0.23,
# q4_1 0.18-0.23, q4_0 0.20-0.26; the test's floor (0.05) is above Q8_0's error
BLOCK_BOUNDS = {"q4_k": 0.3, "q4_0": 0.35, "q4_1": 0.3, "q5_0": 0.2, "q5_1": 0.2}
BLOCK_CASES = [(a, t) for a in sorted(ARCH_MODELS) for t in ("q4_k", "q4_0")] + [
    ("llama", t) for t in ("q4_1", "q5_0", "q5_1")
]


@pytest.mark.parametrize("arch, outtype", BLOCK_CASES)
def test_round_trip_block_types(tmp_path, tok, arch, outtype):
    """The reader gives back exactly the blocks dequantized by gguf.quants (Q4_K: moelab's own
    quantizer), and the model differs from the float one by a quantization-sized amount."""
    model = _model(tok.vocab_size, **_wide(arch))
    report = export_gguf(model, tmp_path / "m.gguf", tokenizer=tok, outtype=outtype)
    assert not any("matrices with rows" in n for n in report.notes), report.notes
    ckpt = read_gguf(report.path)
    matrices = {k: v for k, v in ckpt.tensor_types.items() if v != "F32"}
    assert set(matrices.values()) == {outtype.upper()} and len(matrices) >= 14
    assert ckpt.tensor_types["blk.0.ffn_gate_inp.weight"] == "F32"
    assert ckpt.metadata["general.file_type"] == {
        "q4_k": 14, "q4_0": 2, "q4_1": 3, "q5_0": 8, "q5_1": 9
    }[outtype]  # fmt: skip
    _, (got, want, exact) = _reloaded(report.path, model, outtype)
    assert torch.equal(got, want)
    err = float((got - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt())
    assert 0.05 < err < BLOCK_BOUNDS[outtype], err


def test_q4_k_falls_back_as_llama_quantize(tmp_path, tok):
    """Rows of 96 (not 256, but 32·3) → Q5_0; rows of 24 (not even 32) → F16."""
    model = _model(tok.vocab_size, **_wide("llama", ffn=96))
    report = export_gguf(model, tmp_path / "m.gguf", tokenizer=tok, outtype="q4_k")
    types = read_gguf(report.path).tensor_types
    assert types["blk.0.ffn_down_exps.weight"] == "Q5_0"
    assert types["blk.0.ffn_gate_exps.weight"] == types["output.weight"] == "Q4_K"
    assert report.notes == ["2 matrices with rows not a multiple of 256 written as Q5_0"]
    narrow = _model(tok.vocab_size, experts=dict(ffn_hidden_size=24))  # D=64, F=24
    report = export_gguf(narrow, tmp_path / "n.gguf", tokenizer=tok, outtype="q4_k")
    types = read_gguf(report.path).tensor_types
    assert types["blk.0.ffn_down_exps.weight"] == "F16"
    assert types["blk.0.ffn_gate_exps.weight"] == types["token_embd.weight"] == "Q5_0"
    assert report.notes == [
        "2 matrices with rows not a multiple of 256 written as F16",
        "14 matrices with rows not a multiple of 256 written as Q5_0",
    ]
    assert report.tensor_types["F16"] == 2 and "Q4_K" not in report.tensor_types


def test_dense_llama_and_logit_scale(tmp_path, tok):
    dense = _model(tok.vocab_size, moe=None, logit_scale=0.5, tie_embeddings=True)
    report = export_gguf(dense, tmp_path / "d.gguf", tokenizer=tok)
    assert report.arch == "llama" and any("logit_scale" in n for n in report.notes)
    loaded, _ = load_gguf(report.path)
    assert loaded.cfg.moe is None and loaded.cfg.logit_scale == 1.0
    ids = _ids(tok.vocab_size)
    with torch.no_grad():  # (s·γ) ⊙ n(x) instead of s·(γ ⊙ n(x)): equal up to rounding
        torch.testing.assert_close(loaded(ids).logits, dense(ids).logits, rtol=0, atol=1e-5)


def test_q8_0_falls_back_to_f16_for_partial_blocks(tmp_path, tok):
    model = _model(tok.vocab_size, experts=dict(ffn_hidden_size=24))  # F=24: down rows of 24
    report = export_gguf(model, tmp_path / "m.gguf", tokenizer=tok, outtype="q8_0")
    types = read_gguf(report.path).tensor_types
    assert types["blk.0.ffn_down_exps.weight"] == "F16"
    assert types["blk.0.ffn_gate_exps.weight"] == "Q8_0"
    assert any("2 matrices" in n for n in report.notes), report.notes


def test_metadata_reads_back(tmp_path, tok):
    model = _model(tok.vocab_size, **ARCH_MODELS["qwen2moe"])
    path = tmp_path / "m.gguf"
    export_gguf(model, path, tokenizer=tok, chat_template=PLAIN_TEMPLATE, name="tiny")
    meta = read_gguf_metadata(path)
    p = "qwen2moe."
    assert meta["general.architecture"] == "qwen2moe" and meta["general.name"] == "tiny"
    assert (meta[p + "expert_count"], meta[p + "expert_used_count"]) == (4, 2)
    assert meta[p + "expert_feed_forward_length"] == 32
    assert meta[p + "expert_shared_feed_forward_length"] == 32
    assert meta[p + "rope.freq_base"] == 5e4
    assert meta[p + "attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6, rel=1e-6)
    assert meta[p + "context_length"] == 96 and meta[p + "block_count"] == 2
    assert (meta[p + "attention.head_count"], meta[p + "attention.head_count_kv"]) == (4, 2)
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "gpt-2"
    vocab = tok.hf_tokenizer.get_vocab(with_added_tokens=True)
    assert meta["tokenizer.ggml.tokens"] == sorted(vocab, key=vocab.get)
    merges = json.loads(tok.hf_tokenizer.to_str())["model"]["merges"]
    assert meta["tokenizer.ggml.merges"] == [" ".join(m) for m in merges]
    assert meta["tokenizer.ggml.token_type"][:3] == [3, 1, 1]  # <|endoftext|> is control
    assert meta["tokenizer.ggml.eos_token_id"] == tok.eot_id == 0
    assert meta["tokenizer.ggml.add_bos_token"] is False
    assert meta["tokenizer.chat_template"] == PLAIN_TEMPLATE
    loaded, gtok = load_gguf(path)
    r = loaded.cfg.moe.router
    assert (r.num_experts, r.top_k, r.norm_topk_prob) == (4, 2, False)
    assert loaded.cfg.moe.experts.shared_expert_size == 32 and loaded.cfg.attention_bias
    assert (loaded.cfg.rope_theta, loaded.cfg.max_seq_len) == (5e4, 96)
    assert loaded.cfg.norm_eps == pytest.approx(1e-6, rel=1e-6)
    assert gtok.encode(TEXT) == tok.encode(TEXT) and tok.eot_id in tok.encode(TEXT)


def test_chat_tokens_become_bos_and_eos(tmp_path, tok):
    from tokenizers import AddedToken

    hf = type(tok.hf_tokenizer).from_str(tok.hf_tokenizer.to_str())
    hf.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])  # fmt: skip
    chat = BPETokenizer(hf)
    V = chat.vocab_size
    path = tmp_path / "c.gguf"
    export_gguf(_model(V), path, tokenizer=chat, bos_token="<|im_start|>", eos_token="<|im_end|>")
    meta = read_gguf_metadata(path)
    assert (meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"]) == (
        V - 2,
        V - 1,
    )
    assert meta["tokenizer.ggml.token_type"][-2:] == [3, 3]
    _, gtok = load_gguf(path)
    text = "<|im_start|>user the cat<|im_end|>"
    assert gtok.encode(text) == chat.encode(text) and chat.encode(text)[0] == V - 2
    with pytest.raises(UnsupportedConfigError, match=r"^eos_token: '<\|eot\|>' is not a token"):
        export_gguf(_model(V), tmp_path / "x.gguf", tokenizer=chat, eos_token="<|eot|>")


def test_plain_chat_template_renders_like_moelab():
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi\nyou"}]
    assert ChatTemplate(PLAIN_TEMPLATE).render(msgs) == ChatTemplate().render(msgs)
    assert ChatTemplate().jinja == PLAIN_TEMPLATE


def test_byte_tokenizer_is_an_rwkv_byte_vocabulary(tmp_path):
    assert [unescape_rwkv(t) for t in byte_vocab_tokens()] == [bytes([b]) for b in range(256)]
    assert unescape_rwkv("a\\n\\x41\\\\") == b"a\nA\\"
    model = _model(256, seed=3)
    path = tmp_path / "b.gguf"
    report = export_gguf(model, path, tokenizer=ByteTokenizer())
    meta = read_gguf_metadata(path)
    assert meta["tokenizer.ggml.model"] == "rwkv" and "tokenizer.ggml.merges" not in meta
    assert "rwkv" in report.tokenizer
    loaded, gtok = load_gguf(path)
    assert isinstance(gtok, ByteTokenizer)
    with torch.no_grad():
        assert torch.equal(loaded(_ids(256)).logits, model(_ids(256)).logits)


def test_smollm_pre_tokenizer(tmp_path, tok):
    from tokenizers import Tokenizer, pre_tokenizers

    hf = Tokenizer.from_str(tok.hf_tokenizer.to_str())
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )  # fmt: skip
    digits = BPETokenizer(hf)
    path = tmp_path / "s.gguf"
    export_gguf(_model(tok.vocab_size), path, tokenizer=digits)
    assert read_gguf_metadata(path)["tokenizer.ggml.pre"] == "smollm"
    _, gtok = load_gguf(path)
    assert gtok.encode(TEXT) == digits.encode(TEXT) != tok.encode(TEXT)


def test_layout_uses_llama_cpp_tensor_names():
    """Every tensor written for an architecture is one gguf.constants lists for it."""
    for arch, kw in ARCH_MODELS.items():
        cfg = _model(300, **kw).cfg
        allowed = {
            gguf.TENSOR_NAMES[t].format(bid=b) + suffix
            for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH[arch.upper()]]
            for b in range(cfg.n_layers)
            for suffix in (".weight", ".bias")
        }
        written = {s for rule in gguf_rules(cfg, GGUF_ARCHS[arch]) for s in rule.sources}
        assert written <= allowed, (arch, sorted(written - allowed))
        assert len(written) > 10 * cfg.n_layers


def _adapters(vocab):
    from moelab.models.adapters.inject import add_lora

    model = _model(vocab)
    add_lora(model, ["blocks.0.attn.q_proj"], rank=2, alpha=4.0)
    return model


def _quantized(vocab):
    from moelab.core.experts.quantized import QuantSpec
    from moelab.models.quantized import quantized_structure

    return quantized_structure(_model(vocab), QuantSpec(method="rtn", bits=8, group_size=32))


REFUSALS = {
    "moe.router.kind": lambda V: _model(V, router=dict(kind="expert_choice")),
    "moe.router.kind ": lambda V: _model(V, router=dict(kind="usmoe")),
    "experts_per_layer": lambda V: _model(V, experts_per_layer=(4, 3)),
    "latent_moe": lambda V: _model(
        V,
        moe=None,
        latent_moe=LatentMoEConfig(num_heads=4, head_dim=16, num_experts=4, expert_size=32),
    ),
    "objective": lambda V: _model(V, objective="block_diffusion"),
    "moe.router.input_size": lambda V: _model(V, router=dict(input_size=16)),
    "moe.router.logit_noise_std": lambda V: _model(V, router=dict(logit_noise_std=0.01)),
    "moe.router.score_func": lambda V: _model(V, router=dict(score_func="sigmoid")),
    "moe.router.capacity_factor": lambda V: _model(V, router=dict(capacity_factor=1.0)),
    "moe.router.force_uniform": lambda V: _model(V, router=dict(force_uniform=True)),
    "first_dense_layers": lambda V: _model(V, first_dense_layers=1, **ARCH_MODELS["qwen2moe"]),
    "moe_layers": lambda V: _model(V, moe_layers=(1,), **ARCH_MODELS["qwen2moe"]),
    "n_kv_heads": lambda V: _model(V, qk_norm="full", router=dict(norm_topk_prob=False)),
    "moe.router.norm_topk_prob": lambda V: _model(
        V, qk_norm="head", router=dict(norm_topk_prob=False)
    ),
    "moe.experts.shared_expert_size": lambda V: _model(V, experts=dict(shared_expert_size=32)),
    "moe.experts.lora_rank": lambda V: _model(V, experts=dict(lora_rank=2)),
    "moe.experts": _quantized,
}


@pytest.mark.parametrize("field", sorted(REFUSALS))
def test_refusals_name_the_field(tmp_path, tok, field):
    model = REFUSALS[field](tok.vocab_size)
    path = tmp_path / "x.gguf"
    with pytest.raises(UnsupportedConfigError) as e:
        export_gguf(model, path, tokenizer=tok)
    msg = str(e.value)
    assert msg.startswith(field.strip() + ":") and "\n" not in msg, msg
    assert "llama.cpp" in msg or "GGUF" in msg, msg
    assert not path.exists() and not list(tmp_path.iterdir())


def test_other_refusals(tmp_path, tok):
    with pytest.raises(UnexpectedTensorError, match=r"lora_A.*llama\.cpp's 'llama' layout"):
        export_gguf(_adapters(tok.vocab_size), tmp_path / "a.gguf", tokenizer=tok)
    with pytest.raises(
        UnsupportedConfigError, match=rf"^vocab_size: the model has {tok.vocab_size + 1} ids"
    ):
        export_gguf(_model(tok.vocab_size + 1), tmp_path / "v.gguf", tokenizer=tok)
    with pytest.raises(UnsupportedConfigError, match=r"^arch: must be one of"):
        export_gguf(_model(tok.vocab_size), tmp_path / "x.gguf", tokenizer=tok, arch="gpt2")
    with pytest.raises(UnsupportedConfigError, match=r"^qk_norm: qwen3_moe needs 'head'"):
        export_gguf(_model(tok.vocab_size), tmp_path / "x.gguf", tokenizer=tok, arch="qwen3moe")
    with pytest.raises(ValueError, match=r"^outtype"):
        export_gguf(_model(tok.vocab_size), tmp_path / "x.gguf", tokenizer=tok, outtype="q4")
    from tokenizers import normalizers

    hf = type(tok.hf_tokenizer).from_str(tok.hf_tokenizer.to_str())
    hf.normalizer = normalizers.NFKC()
    with pytest.raises(UnsupportedConfigError, match=r"^tokenizer normalizer: 'NFKC'"):
        export_gguf(_model(tok.vocab_size), tmp_path / "x.gguf", tokenizer=BPETokenizer(hf))
    assert not list(tmp_path.iterdir())


def test_existing_file_and_atomic_write(tmp_path, tok, monkeypatch):
    model = _model(tok.vocab_size)
    path = tmp_path / "m.gguf"
    path.write_bytes(b"old")
    with pytest.raises(FileExistsError, match="overwrite"):
        export_gguf(model, path, tokenizer=tok)

    def broken(self):
        raise OSError("disk went away")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", broken)
    with pytest.raises(OSError, match="went away"):
        export_gguf(model, path, tokenizer=tok, overwrite=True)
    assert path.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


app = typer.Typer()
app.command("convert")(convert_command)
app.command("noop")(lambda: None)  # keep "convert" a subcommand


@pytest.mark.parametrize("outtype", ["q8_0", "q4_0"])
def test_cli_convert_to_gguf(tmp_path, tok, outtype):
    run = tmp_path / "run"
    model = _model(tok.vocab_size)
    save_model(model, run)
    tok.save(run)
    runner = CliRunner()
    out = tmp_path / "m.gguf"
    res = runner.invoke(app, ["convert", str(run), str(out), "--to", "gguf", "--outtype", outtype])
    assert res.exit_code == 0, res.output
    assert f"llama.cpp 'llama', {outtype}" in res.output and "plain template" in res.output
    assert read_gguf_metadata(out)["tokenizer.chat_template"] == PLAIN_TEMPLATE
    loaded, _ = load_gguf(out)
    with torch.no_grad():
        ids = _ids(tok.vocab_size)
        assert torch.equal(loaded(ids).logits, _as_stored(model, outtype)(ids).logits)
    res = runner.invoke(app, ["convert", str(run), str(out), "--to", "gguf", "--arch", "olmoe"])
    assert res.exit_code == 2 and res.output.count("\n") == 1
    assert res.output.startswith("error: ") and "exists" in res.output
    res = runner.invoke(
        app, ["convert", str(run), str(out), "--to", "gguf", "--arch", "olmoe", "--overwrite"]
    )
    assert res.exit_code == 2 and "error: qk_norm: olmoe needs 'full'" in res.output


# ------------------------------------------------------------------ llama.cpp itself
def _greedy_moelab(model: MoETransformer, prompt: list[int], n: int) -> tuple[list[int], list]:
    ids, logits = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            row = model(torch.tensor([ids])).logits[0, -1]
            logits.append(row)
            ids.append(int(row.argmax()))
    return ids[len(prompt) :], logits


def _greedy_llama_cpp(llm, prompt: list[int], n: int) -> tuple[list[int], list]:
    llm.reset()
    llm.eval(prompt)
    out, logits = [], []
    for _ in range(n):
        row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        logits.append(row)
        out.append(int(row.argmax()))
        llm.eval([out[-1]])
    return out, logits


@pytest.mark.parametrize("arch", [*sorted(ARCH_MODELS), "bytes"])
def test_llama_cpp_greedy_tokens_equal_moelab(tmp_path, tok, arch):
    llama_cpp = pytest.importorskip(
        "llama_cpp",
        reason="llama.cpp check needs llama-cpp-python (pip install 'moelab[llamacpp]'; it "
        "compiles llama.cpp)",
    )
    tokenizer = ByteTokenizer() if arch == "bytes" else tok
    model = _model(tokenizer.vocab_size, seed=5, **ARCH_MODELS.get(arch, {}))
    path = tmp_path / "m.gguf"
    export_gguf(model, path, tokenizer=tokenizer, outtype="f32")
    # float32 K/V cache (llama.cpp's default is F16) and no flash attention: the F32 maths
    llm = llama_cpp.Llama(
        str(path), n_ctx=96, n_batch=96, n_threads=2, logits_all=True, verbose=False,
        type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, flash_attn=False,
    )  # fmt: skip
    text = "the cat sat on 4567 mats"
    assert llm.tokenize(text.encode(), add_bos=False, special=True) == tokenizer.encode(text)
    prompt = tokenizer.encode(text)
    ours, our_logits = _greedy_moelab(model, prompt, 32)
    theirs, their_logits = _greedy_llama_cpp(llm, prompt, 32)
    if ours != theirs:
        i = next(j for j, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
        a, b = our_logits[i].numpy(), their_logits[i]
        pytest.fail(
            f"{arch}: first divergence at generated token {i}: moelab {ours[i]} "
            f"(logits {a[ours[i]]:.5f} / {a[theirs[i]]:.5f}), llama.cpp {theirs[i]} "
            f"(logits {b[ours[i]]:.5f} / {b[theirs[i]]:.5f}); max |Δ| {np.abs(a - b).max():.2e}"
        )
    worst = max(float(np.abs(a.numpy() - b).max()) for a, b in zip(our_logits, their_logits, strict=True))  # fmt: skip
    assert worst < 1e-4, worst  # float32 rounding only (measured ~1e-6)


# llama.cpp's LLAMA_FTYPE of each block type (llama.h), quantized ``pure``; and its Q4_K_M mix
LLAMA_CASES = [("q4_k", 14, True), ("q4_0", 2, True), ("q4_1", 3, True), ("q5_0", 8, True)]
LLAMA_CASES += [("q5_1", 9, True), ("q4_k", 15, False)]


@pytest.mark.parametrize("outtype, ftype, pure", LLAMA_CASES)
def test_block_types_equal_llama_quantize_bytes(tmp_path, tok, outtype, ftype, pure):
    """moelab's export at ``outtype`` against ``llama_model_quantize`` run on moelab's F32
    export. ``pure`` (every matrix the ftype's base type; the shape fallbacks still apply):
    every tensor has llama.cpp's type and bytes; expert width 96 makes ffn_down take the
    Q4_K → Q5_0 fallback. The Q4_K_M mix (some matrices Q6_K/Q5_K/Q8_0): the matrices it
    writes as Q4_K have moelab's bytes."""
    llama_cpp = pytest.importorskip(
        "llama_cpp",
        reason="llama.cpp check needs llama-cpp-python (pip install 'moelab[llamacpp]'; it "
        "compiles llama.cpp)",
    )
    import ctypes

    model = _model(tok.vocab_size, seed=7, **_wide("qwen2moe", ffn=96))
    f32, ours, theirs = tmp_path / "f32.gguf", tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
    export_gguf(model, f32, tokenizer=tok, outtype="f32")
    export_gguf(model, ours, tokenizer=tok, outtype=outtype)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread, params.pure = ftype, 1, pure
    paths = str(f32).encode(), str(theirs).encode()
    assert llama_cpp.llama_model_quantize(*paths, ctypes.byref(params)) == 0
    mine = {t.name: t for t in gguf.GGUFReader(ours).tensors}
    ref = {t.name: t for t in gguf.GGUFReader(theirs).tensors}
    types = {n: t.tensor_type.name for n, t in mine.items()}
    # the mix: the matrices llama.cpp writes as Q4_K, or as Q5_0 by Q4_K's fallback
    same = [n for n, t in ref.items() if pure or t.tensor_type.name in ("Q4_K", "Q5_0")]
    for name in same:
        assert ref[name].tensor_type.name == types[name], name
        assert np.array_equal(np.asarray(ref[name].data), np.asarray(mine[name].data)), name
    if not pure:  # 0.3.36's Q4_K_M: 17 Q4_K, 1 Q5_0 (one ffn_down is Q6_K → Q8_0), 3 Q6_K
        assert len(same) >= 15, sorted(same)
        return
    assert {n: t.tensor_type.name for n, t in ref.items()} == types
    # 22 matrices (2 + 10 a layer: attention 4, experts 3, shared expert 3), F32 norms/routers
    want = {"Q4_K": 20, "Q5_0": 2} if outtype == "q4_k" else {outtype.upper(): 22}
    assert Counter(types.values()) == want | {"F32": 15}
