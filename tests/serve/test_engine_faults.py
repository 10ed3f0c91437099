"""Failures inside the serving engine end the requests they concern, and only those: sampling
settings checked in the dtype they run in, a request whose sampling raises, a prefill or a
decode forward that raises, per-layer expert counts, and the threaded loop (no request is
ever left without a finish)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moelab.errors import InvalidValueError
from moelab.models import ModelConfig, MoETransformer
from moelab.serve import Engine, SamplingParams
from moelab.serve import engine as engine_module
from moelab.serve.diffusion import DiffusionEngine, diffusion_generate
from moelab.serve.diffusion import decode as decode_module
from moelab.serve.generate import generate_ids
from moelab.serve.sampling import check_sampling, filtered_logits, sample_next

POISON = 13
"""A token id whose presence in a forward's input makes :class:`_Faulty` raise."""


class _Faulty(MoETransformer):
    """A model the engine rejects mid-step: its forward raises on inputs holding ``POISON``,
    or on its ``fail_at``-th call (1-based; prefills and decode steps both count)."""

    fail_at: int | None = None
    calls = 0

    def forward(self, ids, *args, **kwargs):
        type(self).calls += 1
        if bool((ids == POISON).any()) or type(self).calls == self.fail_at:
            raise RuntimeError(f"injected fault at call {type(self).calls}")
        return super().forward(ids, *args, **kwargs)


def _model(cls=MoETransformer, **cfg) -> MoETransformer:
    torch.manual_seed(0)
    return cls(ModelConfig.tiny(vocab_size=61, max_seq_len=48, **cfg)).eval()


@pytest.fixture
def faulty():
    model = _model(_Faulty)
    _Faulty.calls, _Faulty.fail_at = 0, None
    return model


def _greedy(model, prompt, n) -> list[int]:
    """Greedy continuation by recomputing the whole prefix with the plain model."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(
                int(MoETransformer.forward(model, torch.tensor([ids])).logits[0, -1].argmax())
            )
    return ids[len(prompt) :]


def _run(engine: Engine) -> None:
    for _ in range(200):  # bounded: every test here finishes in far fewer steps
        if not engine.has_work():
            return
        engine.step()
    raise AssertionError("the engine did not finish its requests in 200 steps")


# ------------------------------------------------------------ sampling settings
@pytest.mark.parametrize("top_p", [1e-300, 1e-46])
def test_top_p_that_is_zero_in_float32_is_refused(top_p):
    with pytest.raises(InvalidValueError, match=r"top_p: .* 0 in float32"):
        check_sampling(1.0, None, top_p)
    with pytest.raises(InvalidValueError, match="top_p"):
        SamplingParams(top_p=top_p)
    with pytest.raises(InvalidValueError, match=r"temperature: .*float32"):
        SamplingParams(temperature=1e300)  # finite as a double, inf in float32
    with pytest.raises(InvalidValueError, match=r"seed: .*2\*\*64"):
        SamplingParams(seed=2**64)


def test_the_most_likely_token_survives_any_top_p():
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9]])
    kept = filtered_logits(logits, 1.0, None, 0.0)  # unvalidated: the filter alone keeps one
    assert torch.isfinite(kept).tolist() == [[False, True, False, False]]
    g = torch.Generator().manual_seed(0)
    draws = {int(sample_next(logits, top_p=1e-40, generator=g)) for _ in range(20)}
    assert draws == {1}  # a subnormal but positive float32 top_p is the argmax


def test_a_request_whose_sampling_raises_fails_alone(monkeypatch):
    model = _model()
    real = engine_module.sample_next

    def sample(logits, *, temperature, **kw):
        if temperature == 0.7:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(logits, temperature=temperature, **kw)

    monkeypatch.setattr(engine_module, "sample_next", sample)
    params = [SamplingParams(max_tokens=6, temperature=t, seed=3) for t in (0, 1.0, 0.7, 1.0)]
    prompts = [[1, 2], [3], [4, 5, 6], [7, 8]]
    engine = Engine(model, max_batch=4)
    seqs = [engine.submit(p, q) for p, q in zip(prompts, params, strict=True)]
    _run(engine)
    assert [s.finish_reason for s in seqs] == ["length", "length", "error", "length"]
    assert seqs[2].error.startswith("sampling: RuntimeError: probability tensor")
    for p, q, s in zip(prompts, params, seqs, strict=True):
        if q.temperature != 0.7:  # bystanders: exactly what they give alone
            assert s.output_ids == Engine(model, max_batch=1).generate(p, q).output_ids


def test_block_diffusion_request_whose_sampling_raises_fails_alone(monkeypatch):
    from moelab.models.block_diffusion import to_block_diffusion
    from moelab.serve.diffusion import DecodeOptions

    torch.manual_seed(0)
    dm = to_block_diffusion(MoETransformer(ModelConfig.tiny(vocab_size=20, max_seq_len=64)), 4)
    dm.eval()
    real = decode_module.filtered_logits

    def filt(logits, temperature, top_k, top_p):
        if temperature == 0.7:
            raise RuntimeError("sampling blew up")
        return real(logits, temperature, top_k, top_p)

    monkeypatch.setattr(decode_module, "filtered_logits", filt)
    opts = DecodeOptions.preset("vanilla", 0.6)
    engine = DiffusionEngine(dm, options=opts, max_batch=3)
    a = engine.submit([1, 2, 3], SamplingParams(max_tokens=8, temperature=0))
    b = engine.submit([4, 5], SamplingParams(max_tokens=8, temperature=0.7, seed=1))
    _run(engine)
    assert b.finish_reason == "error" and "sampling blew up" in b.error
    want = diffusion_generate(dm, [1, 2, 3], max_new_tokens=8, options=opts).ids
    assert a.finish_reason == "length" and a.output_ids == want


# ------------------------------------------------------------ forward failures
def test_prefill_failure_fails_only_the_request_that_fails_alone(faulty):
    engine = Engine(faulty, max_batch=4)
    prompts = [[1, 2, 3], [POISON, 4], [5, 6]]
    greedy = SamplingParams(max_tokens=5, temperature=0)
    seqs = [engine.submit(p, greedy) for p in prompts]
    _run(engine)  # one batched prefill of three fails; retried alone, two succeed
    assert [s.finish_reason for s in seqs] == ["length", "error", "length"]
    assert seqs[1].error == "engine: RuntimeError: injected fault at call 3"  # 1: batch, 2: alone
    assert isinstance(seqs[1].exception, RuntimeError)
    for p, s in zip(prompts, seqs, strict=True):
        if s.finish_reason == "length":
            assert s.output_ids == _greedy(faulty, p, 5)
    later = engine.generate([7, 8], greedy)  # and the engine goes on serving
    assert later.finish_reason == "length" and later.output_ids == _greedy(faulty, [7, 8], 5)


def test_decode_failure_fails_the_running_requests_and_clears_the_cache(faulty):
    engine = Engine(faulty, max_batch=2)
    greedy = SamplingParams(max_tokens=4, temperature=0)
    prompts = [[1, 2], [3, 4, 5], [6]]
    seqs = [engine.submit(p, greedy) for p in prompts]
    _Faulty.fail_at = 3  # call 1 prefills the first two, call 2 decodes, call 3 raises
    _run(engine)
    assert [s.finish_reason for s in seqs] == ["error", "error", "length"]
    assert [len(s.output_ids) for s in seqs[:2]] == [2, 2]
    assert seqs[2].output_ids == _greedy(faulty, [6], 4)  # the waiting one ran afterwards
    assert engine.cache.lengths == [0, 0] and engine.num_running == 0


def test_a_failing_forward_under_the_engine_thread_ends_every_request(faulty):
    engine = Engine(faulty, max_batch=2)
    engine.start()
    try:
        bad = engine.submit([POISON], SamplingParams(max_tokens=3, temperature=0))
        assert bad.done.wait(30), "the request was lost inside the engine"
        assert bad.finish_reason == "error" and engine.alive and not engine.has_work()
        good = engine.submit([1, 2], SamplingParams(max_tokens=3, temperature=0))
        assert good.done.wait(30) and good.output_ids == _greedy(faulty, [1, 2], 3)
    finally:
        engine.stop()


def test_an_unexpected_failure_outside_the_forward_ends_every_request(faulty, monkeypatch):
    engine = Engine(faulty, max_batch=2)
    real, calls = engine._reap, []

    def reap() -> None:  # the loop's last resort: any exception step() itself lets through
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("bookkeeping broke")
        real()

    monkeypatch.setattr(engine, "_reap", reap)
    engine.start()
    try:
        seqs = [engine.submit(p, SamplingParams(max_tokens=20, temperature=0)) for p in ([1], [2])]
        assert all(s.done.wait(30) for s in seqs)
        assert [s.error for s in seqs] == ["engine: RuntimeError: bookkeeping broke"] * 2
        assert engine.alive and engine.num_running == 0 and engine.cache.lengths == [0, 0]
        good = engine.submit([1, 2], SamplingParams(max_tokens=3, temperature=0))
        assert good.done.wait(30) and good.output_ids == _greedy(faulty, [1, 2], 3)
    finally:
        engine.stop()


def test_generate_ids_raises_what_the_engine_contained(faulty):
    _Faulty.fail_at = 3
    out = []
    with pytest.raises(RuntimeError, match="injected fault at call 3"):
        for t in generate_ids(faulty, [1, 2], max_new_tokens=5, temperature=0):
            out.append(t)
    assert out == _greedy(faulty, [1, 2], 2)  # the tokens before the fault were yielded


def test_per_layer_pruned_model_generates():
    model = _model(n_layers=2)
    pruned = MoETransformer(dataclasses.replace(model.cfg, experts_per_layer=(4, 3))).eval()
    engine = Engine(pruned, max_batch=2)
    seqs = [engine.submit(p, SamplingParams(max_tokens=5, temperature=0)) for p in ([1, 2], [3])]
    _run(engine)
    for p, s in zip(([1, 2], [3]), seqs, strict=True):
        assert s.finish_reason == "length" and s.output_ids == _greedy(pruned, p, 5)
    counts = engine.stats.expert_counts
    k = pruned.cfg.moe.router.top_k
    assert [len(c) for c in counts] == [4, 3]
    # every forward token is routed to k experts: 3 prompt tokens + 4 decode steps x 2 rows
    assert [sum(c) for c in counts] == [(3 + 8) * k] * 2


def test_only_rows_with_non_finite_logits_fail_and_an_overflowing_sum_is_not_one():
    """A NaN row and an inf row get -1 and an error; a row of huge finite logits, whose sum
    overflows float32, is sampled normally."""
    engine = Engine(_model(), max_batch=4)
    seqs = [
        engine_module.Sequence.__new__(engine_module.Sequence) for _ in range(4)
    ]  # only what _sample reads
    for s in seqs:
        s.params, s.prompt_ids, s.output_ids, s.error = SamplingParams(temperature=0), [1], [], None
    logits = torch.zeros(4, 61)
    logits[0, 3] = float("nan")
    logits[1, 5] = float("inf")
    logits[2] = 3e38
    logits[2, 7] = 3.3e38
    logits[3, 9] = 1.0
    assert engine._sample(logits, seqs) == [-1, -1, 7, 9]
    assert "not finite" in seqs[0].error and "not finite" in seqs[1].error
    assert seqs[2].error is None and seqs[3].error is None
