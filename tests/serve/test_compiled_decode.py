"""Decoding through ``torch.compile`` (``Engine(compile=True)``, ``moelab generate --compile``):
the same greedy tokens as eager decoding, one graph for every step (no graph break at the
fused expert kernel or the packed-code kernel of quantized weights, no recompile when the cache
grows), one compile per model and module structure, and the flag's refusals."""

import gc
import weakref

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from typer.testing import CliRunner

from moelab.cli import app
from moelab.core.experts import cpu_kernel
from moelab.data import ByteTokenizer
from moelab.models import ModelConfig, MoETransformer, save_model
from moelab.serve.engine import Engine
from moelab.serve.generate import generate_ids
from moelab.serve.params import SamplingParams


def peaked_model(**overrides) -> MoETransformer:
    """A tiny model whose greedy choices have wide margins (a scaled LM head), so inductor's
    last-bit differences cannot flip a near-tie."""
    torch.manual_seed(0)
    model = MoETransformer(ModelConfig.tiny(vocab_size=50, max_seq_len=160, **overrides)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    return model


def assert_one_graph_with_eager_tokens(model: MoETransformer, prompt: list[int], n: int) -> None:
    """Compiled greedy decoding of ``n`` tokens equals eager decoding, in one graph without a
    break (the decode kernels run as operators in the graph)."""
    want = list(generate_ids(model, prompt, max_new_tokens=n, temperature=0))
    torch._dynamo.reset()
    counters.clear()
    got = list(generate_ids(model, prompt, max_new_tokens=n, temperature=0, compile=True))
    assert got == want and len(got) == n
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]


# inductor needs the same C++ toolchain as the kernel
@pytest.mark.slow
@pytest.mark.skipif(cpu_kernel.kernel() is None, reason="no C++ toolchain")
# heads of 64: the serving cache's first capacity (64) equals the head size, which duck
# sizing would fuse into one symbol and specialise, recompiling at the first growth
@pytest.mark.parametrize("shape", [{}, {"d_model": 128, "n_heads": 2}], ids=["tiny", "head64"])
def test_compiled_decode_gives_eager_tokens_with_one_graph_across_cache_growth(shape):
    model = peaked_model(**shape)
    prompt = [3, 7, 1, 4, 4, 9, 2, 8]
    # 148 positions: the cache grows from 64 to 128 to 160 on the way
    assert_one_graph_with_eager_tokens(model, prompt, 140)
    again = list(generate_ids(model, prompt[:3], max_new_tokens=20, temperature=0, compile=True))
    assert again == list(generate_ids(model, prompt[:3], max_new_tokens=20, temperature=0))
    assert counters["stats"]["unique_graphs"] == 1  # a new engine reuses the graph


@pytest.mark.slow
@pytest.mark.skipif(cpu_kernel.kernel() is None, reason="no C++ toolchain")
def test_compiled_batched_decode_gives_eager_tokens_for_8_rows():
    # 8 rows in one compiled step (GQA): checking each row's cached length against start_pos
    # inside the graph made inductor size buffers by a symbol it never bound (NameError,
    # every request failed) from 7 rows on
    torch.manual_seed(0)
    model = MoETransformer(ModelConfig.tiny(vocab_size=50, max_seq_len=64, n_kv_heads=2)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30)

    def decode(compile):
        engine = Engine(model, max_batch=8, track_experts=False, compile=compile)
        seqs = [engine.submit([1 + i, 2, 3, 4, 5], SamplingParams(max_tokens=12, temperature=0))
                for i in range(8)]  # fmt: skip
        while engine.has_work():
            engine.step()
        assert all(s.error is None for s in seqs)
        return [s.output_ids for s in seqs]

    torch._dynamo.reset()
    assert decode(True) == decode(False)


def test_stop_after_the_cache_grew_cancels_instead_of_raising():
    # the grown buffers are inference tensors; freeing a row outside step() used to raise
    # "Inplace update to inference tensor outside InferenceMode"
    engine = Engine(peaked_model(), max_batch=2)
    seq = engine.submit([1, 2, 3], SamplingParams(max_tokens=120, temperature=0))
    for _ in range(80):
        engine.step()
    assert engine.cache.capacity > 64
    engine.stop()
    assert seq.finish_reason == "cancelled" and engine.cache.lengths == [0, 0]


@pytest.mark.parametrize(
    "extra, needle",
    [(["--offload", "--cache-mb", "4"], "not with --offload"), (["--decoder", "team"], "causal")],
)
def test_compile_refuses_offload_and_diffusion_decoders(tmp_path, extra, needle):
    save_model(MoETransformer(ModelConfig.tiny(vocab_size=256, max_seq_len=64)), tmp_path)
    ByteTokenizer().save(tmp_path)
    for command in ("generate", "serve"):
        result = CliRunner().invoke(app, [command, str(tmp_path), "--compile", *extra])
        assert result.exit_code == 2, result.output
        text = result.output.strip()
        assert text.startswith("error:") and needle in text and "\n" not in text, text


def quantized(model: MoETransformer, spec, dense_bits: int | None = None) -> MoETransformer:
    from moelab.compress.quant import QuantizeConfig, quantize_model
    from moelab.compress.quant.dense import quantize_dense

    calibration = [torch.randint(0, model.cfg.vocab_size, (2, 16))]
    quantize_model(model, calibration, QuantizeConfig(spec=spec, sequential=False))
    if dense_bits is not None:
        quantize_dense(model, bits=dense_bits, group_size=16)
    return model


@pytest.mark.slow
@pytest.mark.skipif(cpu_kernel.kernel() is None, reason="no C++ toolchain")
@pytest.mark.parametrize("bits, symmetric, dense_bits", [(8, True, 8), (4, False, None)])
def test_compiled_quantized_decode_gives_eager_tokens_with_one_graph(bits, symmetric, dense_bits):
    from moelab.core.experts.quantized import QuantSpec

    spec = QuantSpec(method="rtn", bits=bits, group_size=16, symmetric=symmetric)
    # the packed-code kernel is one operator in the graph (moelab::quant_rows_mm)
    assert_one_graph_with_eager_tokens(
        quantized(peaked_model(), spec, dense_bits), [3, 7, 1, 4, 4, 9, 2, 8], 40
    )


@pytest.mark.parametrize(
    "spec, why",
    [
        ({"bits": 2}, "2-bit codes"),
        ({"bits": 4, "lowrank": "per-expert", "rank": 2}, "per-expert low-rank factors"),
    ],
)
def test_compile_refuses_what_would_break_the_graph(tmp_path, spec, why):
    from moelab.core.experts.quantized import QuantSpec

    torch.manual_seed(0)
    model = MoETransformer(ModelConfig.tiny(vocab_size=256, max_seq_len=64)).eval()
    quantized(model, QuantSpec(method="rtn", group_size=16, symmetric=True, **spec))
    with pytest.raises(
        ValueError, match=f"projection blocks.0.ffn.experts.projections.gate has {why}"
    ):
        Engine(model, compile=True)
    Engine(model)  # eager decoding is fine
    save_model(model, tmp_path)
    ByteTokenizer().save(tmp_path)
    result = CliRunner().invoke(app, ["generate", str(tmp_path), "--compile", "--prompt", "a"])
    assert result.exit_code == 2, result.output
    text = result.output.strip()
    assert text.startswith("error:") and why in text and "\n" not in text, text


@pytest.mark.slow
@pytest.mark.skipif(cpu_kernel.kernel() is None, reason="no C++ toolchain")
def test_each_model_and_structure_decodes_through_its_own_compile():
    # compiled decodes skip the guards on modules where torch allows it: another model, or
    # the same model quantized in place, must still get graphs of its own
    from moelab.core.experts.quantized import QuantSpec
    from moelab.serve.compiled import compiled_decode

    torch._dynamo.reset()
    prompt = [3, 7, 1, 4, 4, 9, 2, 8]
    a = peaked_model()
    torch.manual_seed(1)
    b = MoETransformer(ModelConfig.tiny(vocab_size=50, max_seq_len=160, n_layers=3)).eval()
    with torch.no_grad():
        b.lm_head.weight.mul_(30)
    for model in (a, b, a):
        want = list(generate_ids(model, prompt, max_new_tokens=12, temperature=0))
        assert (
            list(generate_ids(model, prompt, max_new_tokens=12, temperature=0, compile=True))
            == want
        )
    assert compiled_decode(a).compiled is compiled_decode(a).compiled  # one compile per model
    before = compiled_decode(a).compiled
    quantized(a, QuantSpec(method="rtn", bits=8, group_size=16, symmetric=True))
    assert compiled_decode(a).compiled is not before  # the structure changed: a new compile
    want = list(generate_ids(a, prompt, max_new_tokens=12, temperature=0))
    assert list(generate_ids(a, prompt, max_new_tokens=12, temperature=0, compile=True)) == want
    gone = weakref.ref(b)  # the per-model cache holds no reference to its model
    del b
    gc.collect()
    assert gone() is None


def test_structure_sees_what_skipped_module_guards_would_miss():
    import dataclasses

    from moelab.serve.compiled import structure

    model = MoETransformer(ModelConfig.tiny(vocab_size=50, max_seq_len=32)).eval()
    key = structure(model)
    model.load_state_dict(model.state_dict())  # new values in the same tensors: read per call
    assert structure(model) == key
    router = next(b.ffn.router for b in model.blocks if b.is_moe)
    changes = [
        lambda: model.train(),
        lambda: setattr(router, "config", dataclasses.replace(router.config)),
        lambda: setattr(model.lm_head, "weight", torch.nn.Parameter(model.lm_head.weight + 0)),
        lambda: model.blocks[0].attn.o_proj.register_buffer("extra", torch.zeros(1)),
    ]
    for change in changes:
        change()
        assert structure(model) != key
        key = structure(model)
