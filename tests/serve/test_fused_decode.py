"""The fused decode step (``Engine(fused=True)``, ``csrc/decode_step.cpp``): the logits, chosen
experts and cache writes of the PyTorch modules, for every block variant it runs, rows at
their own positions, float32 and quantized weights; the engine's greedy tokens; refusals."""

import pytest
import torch
from typer.testing import CliRunner

from moelab.cli import app
from moelab.compress.quant.dense import quantize_dense
from moelab.compress.quant.pipeline import QuantizeConfig, quantize_model
from moelab.core.config import ExpertsConfig, MoEConfig, RouterConfig
from moelab.core.experts import cpu_kernel
from moelab.core.experts.quantized import QuantSpec
from moelab.data import ByteTokenizer
from moelab.models import ModelConfig, MoETransformer, save_model
from moelab.serve.engine import Engine
from moelab.serve.fused import FusedDecode, unsupported
from moelab.serve.kv_slots import SlotKVCache
from moelab.serve.params import SamplingParams

pytestmark = pytest.mark.skipif(cpu_kernel.kernel() is None, reason="no C++ toolchain")


def tiny(router: dict | None = None, experts: dict | None = None, **overrides) -> MoETransformer:
    torch.manual_seed(0)
    d = overrides.pop("d_model", 32)
    f = overrides.pop("ffn_hidden_size", 48)
    moe = MoEConfig(
        router=RouterConfig(num_experts=6, top_k=2, **(router or {})),
        experts=ExpertsConfig(hidden_size=d, ffn_hidden_size=f, **(experts or {})),
    )
    overrides.setdefault("n_heads", 4)
    overrides.setdefault("max_seq_len", 96)
    cfg = ModelConfig(vocab_size=50, d_model=d, n_layers=3, moe=moe, **overrides)
    model = MoETransformer(cfg).eval()
    with torch.no_grad():  # visible norms and biases (their init is ones/zeros)
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.3 * torch.randn_like(p))
        for block in model.blocks:
            bias = getattr(getattr(block.ffn, "router", None), "expert_bias", None)
            if bias is not None:
                bias.copy_(0.05 * torch.randn_like(bias))
    return model


def prefilled(model: MoETransformer, lengths: list[int]) -> SlotKVCache:
    """A slotted cache whose row i holds a random prompt of lengths[i] positions."""
    g = torch.Generator().manual_seed(1)
    cache = SlotKVCache(model, len(lengths))
    for i, n in enumerate(lengths):
        cache.select(i, i + 1)
        model(torch.randint(0, 50, (1, n), generator=g), kv_cache=cache, start_pos=0)
    return cache


@torch.inference_mode()
def assert_fused_matches(
    model: MoETransformer, lengths: list[int], steps: int, atol: float, rtol: float = 0.0
):
    """``steps`` decode steps of rows at ``lengths`` through the modules and the fused step:
    logits within ``atol`` (+ ``rtol`` of their size), the same experts, the same cached
    keys/values."""
    fused = FusedDecode(model)
    ref_cache, fused_cache = prefilled(model, lengths), prefilled(model, lengths)
    x = torch.randint(0, 50, (len(lengths), 1), generator=torch.Generator().manual_seed(2))
    pos = list(lengths)
    for _ in range(steps):
        start = pos[0] if len(set(pos)) == 1 else torch.tensor(pos)
        ref_cache.select(0, len(pos))
        fused_cache.select(0, len(pos))
        want = model(x, kv_cache=ref_cache, start_pos=start)
        got = fused(x, kv_cache=fused_cache, start_pos=start)
        assert torch.isfinite(want.logits).all()
        torch.testing.assert_close(got.logits, want.logits, atol=atol, rtol=rtol)
        for r, o in zip(want.records, got.records, strict=True):
            assert (r is None) == (o is None)
            if r is not None:
                k = o.expert_idx.shape[1]
                want_experts = r.all_expert_idx.view(-1, k).sort(dim=1).values
                assert torch.equal(o.expert_idx.sort(dim=1).values, want_experts)
                assert torch.equal(o.counts, r.counts)
        x = want.logits.argmax(-1)
        pos = [p + 1 for p in pos]
    assert ref_cache.lengths == fused_cache.lengths
    for a, b in zip(ref_cache.k + ref_cache.v, fused_cache.k + fused_cache.v, strict=True):
        torch.testing.assert_close(a, b, atol=atol, rtol=0)
    assert torch.equal(ref_cache.key_mask, fused_cache.key_mask)


VARIANTS = {
    "plain": {},
    "gqa_bias_qk_head": dict(n_kv_heads=2, attention_bias=True, qk_norm="head"),
    "qk_full_dense_first": dict(qk_norm="full", first_dense_layers=1, logit_scale=0.5),
    "sigmoid_unnormalised_scaled": dict(
        router=dict(score_func="sigmoid", norm_topk_prob=False, routed_scaling_factor=2.5)
    ),
    "softmax_after_topk_bias": dict(router=dict(softmax_before_topk=False, expert_bias=True)),
    "sigmoid_normalised_bias": dict(
        router=dict(score_func="sigmoid", norm_topk_prob=True, expert_bias=True)
    ),
    "gelu_experts": dict(experts=dict(activation="gelu")),
}


@pytest.mark.parametrize("variant", VARIANTS, ids=list(VARIANTS))
def test_fused_step_matches_the_modules_for_rows_at_their_own_positions(variant):
    model = tiny(**VARIANTS[variant])
    assert_fused_matches(model, [5, 9, 7], steps=4, atol=2e-5)


def test_fused_step_matches_with_one_shared_position_and_nine_rows():
    # nine rows: past dense_rows' eight, the projections go to at::linear
    assert_fused_matches(tiny(), [6] * 9, steps=3, atol=2e-5)


def test_fused_step_matches_long_contexts_that_split_attention_over_threads():
    # 4 rows x 2 heads x 600 positions x 64 dims: past the 2^18 multiply-adds above which the
    # attention's (row, head) units are shared by the threads
    model = tiny(d_model=128, n_heads=2, ffn_hidden_size=64, max_seq_len=640)
    assert_fused_matches(model, [600, 520, 610, 580], steps=3, atol=5e-5)


@torch.inference_mode()
def test_each_step_runs_in_one_mode_and_both_modes_give_the_same_logits():
    # the steps' warm-up: two steps with the kernels' work shared by the threads, two on the
    # calling thread alone; the kernels compute the same bits in either mode
    model = tiny()
    fused = FusedDecode(model)
    x = torch.tensor([[3], [11]])

    def step() -> tuple[torch.Tensor, dict[str, int]]:
        """A step's logits and its kernel calls in each mode."""
        cache = prefilled(model, [5, 7])
        cache.select(0, 2)
        before = cpu_kernel.scheduler_stats()
        logits = fused(x, kv_cache=cache, start_pos=torch.tensor([5, 7])).logits
        after = cpu_kernel.scheduler_stats()
        return logits, {m: after[f"{m}_calls"] - before[f"{m}_calls"] for m in ("parallel", "solo")}

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        cpu_kernel.reset_scheduler(0)  # the steps' mode averages are process-wide
        logits = []
        for i in range(4):
            out, ran = step()
            logits.append(out)
            assert fused.mode_steps() == {"parallel": min(i + 1, 2), "solo": max(i - 1, 0)}
            # every kernel call of the step ran in the step's mode
            assert ran["parallel" if i < 2 else "solo"] > 0
            assert ran["solo" if i < 2 else "parallel"] == 0
        assert all(torch.equal(a, logits[0]) for a in logits[1:])
        torch.set_num_threads(1)  # one thread: solo, and not a sample of either mode's cost
        assert step()[1]["parallel"] == 0
        assert fused.mode_steps() == {"parallel": 2, "solo": 3}
    finally:
        torch.set_num_threads(threads)


@torch.inference_mode()
def test_a_refused_step_writes_nothing_and_leaves_the_kernel_calls_their_own_mode():
    model = tiny()
    fused = FusedDecode(model)
    cache = prefilled(model, [5, 7])
    cache.select(0, 2)
    k_before = [t.clone() for t in cache.k]
    ex = fused._executor
    cos, sin = model.blocks[0].attn.rope.cos_sin(torch.device("cpu"))
    bad_v = [*cache.v[:-1], cache.v[-1][:, :1]]  # the last block's value cache misshapen
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with pytest.raises(RuntimeError, match="block 2's cache must be"):
            ex.step([3, 11], [5, 7], cache.k, bad_v, cache.key_mask, 0, cos, sin)
        assert all(torch.equal(a, b) for a, b in zip(cache.k, k_before, strict=True))
        # the calling thread's calls choose their own mode again: the warm-up, 2 solo of 4
        cpu_kernel.reset_scheduler(0)
        w, x = torch.randn(64, 32), torch.randn(1, 32)
        for _ in range(4):
            cpu_kernel.dense_rows(x, w)
        assert cpu_kernel.scheduler_stats()["solo_calls"] == 2
    finally:
        torch.set_num_threads(threads)


def quantized(bits: int, dense: bool, **overrides) -> MoETransformer:
    model = tiny(d_model=64, ffn_hidden_size=128, **overrides)
    calib = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(3))
    spec = QuantSpec(method="rtn", bits=bits, group_size=64, symmetric=True)
    quantize_model(model, [calib], QuantizeConfig(spec=spec, sequential=False))
    if dense:
        quantize_dense(model, bits, 64)
    return model.eval()


@pytest.mark.parametrize("bits", [8, 4])
def test_fused_step_matches_quantized_experts_and_projections(bits, monkeypatch):
    # float32 activations: the kernel's dequantized values, so only sum order differs
    monkeypatch.setenv("MOELAB_INT8_ACTIVATIONS", "0")
    assert_fused_matches(quantized(bits, dense=True), [5, 9], steps=3, atol=5e-5)
    assert_fused_matches(quantized(bits, dense=False), [7], steps=2, atol=5e-5)


@pytest.mark.skipif(not cpu_kernel.int8_activations(), reason="no AVX-512 VNNI")
def test_fused_step_with_int8_activations_matches_the_modules():
    # one step from the same caches: both quantize the same rows (float32 activations
    # instead would differ by ~3e-3 here); later steps can differ by a rounding step of an
    # activation (one step of its group's max|x|/127) moved by a last-bit difference
    model = quantized(8, dense=True)
    assert_fused_matches(model, [6, 8], steps=1, atol=1e-4)


def test_sigmoid_weights_stay_finite_for_very_negative_router_logits():
    # selected logits below -88 round sigmoid to 0; the weights come from log-sigmoid (as
    # F.logsigmoid), not from log of the rounded score, which would give NaN
    model = tiny(router=dict(score_func="sigmoid", norm_topk_prob=True, expert_bias=True))
    with torch.no_grad():
        model.embed.weight[:, 0] = 100.0  # every hidden state has a large positive x[0]
        for block in model.blocks:
            block.ffn_norm.weight.zero_()
            block.ffn_norm.weight[0] = 1.0
            block.ffn.router.weight[:, 0] = -400.0  # logits about -2000
    assert_fused_matches(model, [5, 7], steps=2, atol=1e-3, rtol=1e-5)


def test_engine_fused_gives_the_greedy_tokens_of_eager_decoding():
    model = tiny()
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # wide margins: rounding cannot flip a greedy choice
    prompts = [[3, 7, 1], [4, 4, 9, 2, 8, 1, 1], [5], [2, 2, 2, 2, 2]]

    def run(fused: bool) -> list[list[int]]:
        engine = Engine(model, max_batch=3, fused=fused)
        seqs = [engine.submit(p, SamplingParams(max_tokens=12 + i, temperature=0))
                for i, p in enumerate(prompts)]  # fmt: skip
        while engine.has_work():
            engine.step()
        return [s.output_ids for s in seqs], engine.stats.expert_counts

    (want, want_counts), (got, got_counts) = run(False), run(True)
    assert got == want
    assert got_counts == want_counts


def test_engine_fused_decodes_across_cache_growth():
    # 110 positions: the serving cache grows from 64 positions to 128 on the way, and the
    # step must write into the new buffers
    model = tiny(max_seq_len=160)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)

    def run(fused: bool) -> list[int]:
        engine = Engine(model, max_batch=2, fused=fused)
        seq = engine.submit([3, 1, 4, 1, 5], SamplingParams(max_tokens=105, temperature=0))
        while engine.has_work():
            engine.step()
        assert engine.cache.capacity == 128
        return seq.output_ids

    want = run(False)
    assert run(True) == want and len(want) == 105


def test_engine_fused_serves_capacity_layers_dropless_like_the_engine():
    # alone, the fused step refuses a capacity factor (it would route without it); an
    # engine serves such layers dropless in every forward (moelab.serve.batching), and
    # its fused step is built under that routing
    model = tiny(router=dict(capacity_factor=0.5))
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    assert "a capacity factor" in unsupported(model)
    with pytest.raises(ValueError, match="a capacity factor"):
        FusedDecode(model)
    prompts = [[3, 7, 1], [4, 4, 9, 2, 8], [5]]

    def run(fused: bool) -> list[list[int]]:
        engine = Engine(model, max_batch=3, fused=fused)
        seqs = [engine.submit(p, SamplingParams(max_tokens=10, temperature=0)) for p in prompts]
        while engine.has_work():
            engine.step()
        return [s.output_ids for s in seqs]

    assert run(True) == run(False)
    assert model.blocks[0].ffn.router.config.capacity_factor == 0.5  # restored


REFUSED = {
    "shared expert": dict(experts=dict(shared_expert_size=16)),
    "'expert_choice' router": dict(router=dict(kind="expert_choice")),
    "group-limited": dict(router=dict(n_group=2, topk_group=1)),
}


@pytest.mark.parametrize("reason", REFUSED, ids=list(REFUSED))
def test_unsupported_models_are_refused_naming_the_part(reason):
    model = tiny(**REFUSED[reason])
    why = unsupported(model)
    assert why is not None and reason in why
    with pytest.raises(ValueError, match="fused decode step cannot run this model"):
        Engine(model, fused=True)


def test_hooks_training_mode_and_compile_with_fused_are_refused():
    model = tiny()
    handle = model.blocks[1].attn.register_forward_hook(lambda *a: None)
    assert unsupported(model) == "module blocks.1.attn has forward hooks"
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    assert unsupported(model) == "global forward hooks are registered (torch.nn.modules.module)"
    handle.remove()
    assert unsupported(model) is None
    model.blocks[0].ffn.router.train()
    assert unsupported(model) == "module blocks.0.ffn.router is in training mode"
    assert unsupported(model.train()) == "module model is in training mode"
    with pytest.raises(ValueError, match="choose one"):
        Engine(model.eval(), compile=True, fused=True)


def test_a_decode_step_takes_one_position_per_row():
    model = tiny()
    cache = prefilled(model, [4])
    with pytest.raises(ValueError, match="one position"):
        FusedDecode(model)(torch.zeros(1, 2, dtype=torch.long), kv_cache=cache, start_pos=4)
    with pytest.raises(ValueError, match="continue at their cached lengths"):
        FusedDecode(model)(torch.zeros(1, 1, dtype=torch.long), kv_cache=cache, start_pos=3)
    # refused ids leave the cache as it was
    mask = cache.key_mask.clone()
    for bad in (torch.tensor([[50]]), torch.tensor([[-1]]), torch.tensor([[1.0]])):
        with pytest.raises(ValueError, match="integer ids in"):
            FusedDecode(model)(bad, kv_cache=cache, start_pos=4)
        assert cache.lengths == [4] and torch.equal(cache.key_mask, mask)


def saved_tiny(tmp_path, **overrides):
    model = MoETransformer(ModelConfig.tiny(vocab_size=256, max_seq_len=64, **overrides))
    save_model(model, tmp_path)
    ByteTokenizer().save(tmp_path)


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--offload", "--cache-mb", "4"], "--fused: not with --offload"),
        (["--decoder", "team"], "--fused: applies to causal decoding"),
        (["--compile"], "--compile, --fused: choose one"),
    ],
)
def test_cli_fused_refuses_offload_diffusion_decoders_and_compile(tmp_path, extra, needle):
    saved_tiny(tmp_path)
    for command in ("generate", "serve"):
        result = CliRunner().invoke(app, [command, str(tmp_path), "--fused", *extra])
        assert result.exit_code == 2, result.output
        text = result.output.strip()
        assert text.startswith("error:") and needle in text and "\n" not in text, text


def test_cli_generate_fused_gives_the_eager_text_and_refuses_unsupported_models(tmp_path):
    saved_tiny(tmp_path / "ok")
    args = ["generate", str(tmp_path / "ok"), "--prompt", "ab", "--temperature", "0"]
    args += ["--max-new-tokens", "12"]
    eager, fused = CliRunner().invoke(app, args), CliRunner().invoke(app, [*args, "--fused"])
    assert eager.exit_code == fused.exit_code == 0, fused.output
    assert fused.output == eager.output and len(fused.output) > 3
    moe = MoEConfig(
        router=RouterConfig(num_experts=4, top_k=2),
        experts=ExpertsConfig(hidden_size=32, ffn_hidden_size=32, shared_expert_size=16),
    )
    saved_tiny(tmp_path / "shared", moe=moe)
    result = CliRunner().invoke(app, ["generate", str(tmp_path / "shared"), "--fused"])
    assert result.exit_code == 2, result.output
    assert "block 0 has a shared expert" in result.output
    # a capacity factor is served dropless, as the engine serves it
    moe = MoEConfig(
        router=RouterConfig(num_experts=4, top_k=2, capacity_factor=1.0),
        experts=ExpertsConfig(hidden_size=32, ffn_hidden_size=32),
    )
    saved_tiny(tmp_path / "cf", moe=moe)
    args[1] = str(tmp_path / "cf")
    eager, fused = CliRunner().invoke(app, args), CliRunner().invoke(app, [*args, "--fused"])
    assert eager.exit_code == fused.exit_code == 0, fused.output
    assert fused.output == eager.output
