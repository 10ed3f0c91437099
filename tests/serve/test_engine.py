"""The continuous-batching engine against single-sequence generation and recomputation."""

from __future__ import annotations

import dataclasses
import itertools
import time

import pytest
import torch

from moelab.data import ByteTokenizer
from moelab.models import ModelConfig, MoETransformer
from moelab.serve import Engine, FinishEvent, QueueFullError, SamplingParams, TokenEvent
from moelab.serve.generate import generate_ids


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return MoETransformer(ModelConfig.tiny(vocab_size=61, max_seq_len=48, n_kv_heads=2)).eval()


def _greedy_reference(model, prompt, n):
    """Greedy continuation by recomputing the whole prefix (no cache at all)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


PROMPTS = [[3, 7, 1], [5], [9, 9, 9, 9, 2, 4, 8], [1, 2], [40, 30, 20, 10, 5], [7] * 11]


def test_batched_greedy_equals_single_and_recomputation(model):
    engine = Engine(model, max_batch=8)
    params = SamplingParams(max_tokens=9, temperature=0)
    seqs = [engine.submit(p, params) for p in PROMPTS]
    while engine.has_work():
        engine.step()
    for p, s in zip(PROMPTS, seqs, strict=True):
        single = list(generate_ids(model, p, max_new_tokens=9, temperature=0))
        assert s.output_ids == single == _greedy_reference(model, p, 9)
        assert s.finish_reason == "length"


def test_batched_sampling_equals_single_for_same_seed(model):
    engine = Engine(model, max_batch=4)
    params = [SamplingParams(max_tokens=12, temperature=1.3, top_k=20, seed=s) for s in range(6)]
    seqs = [engine.submit(p, q) for p, q in zip(PROMPTS, params, strict=True)]
    while engine.has_work():
        engine.step()
    for p, q, s in zip(PROMPTS, params, seqs, strict=True):
        alone = Engine(model, max_batch=1).generate(p, q)
        assert s.output_ids == alone.output_ids
    # different seeds give different samples (so the test above can fail)
    assert len({tuple(s.output_ids) for s in seqs}) > 1


def test_continuous_batching_admits_while_others_decode(model):
    engine = Engine(model, max_batch=4)
    events = []
    long = engine.submit([1, 2, 3], SamplingParams(max_tokens=20, temperature=0),
                         lambda ev: events.append(("long", ev)))  # fmt: skip
    for _ in range(5):
        engine.step()
    assert len(long.output_ids) == 6 and engine.num_running == 1
    short = engine.submit([4, 5], SamplingParams(max_tokens=3, temperature=0),
                          lambda ev: events.append(("short", ev)))  # fmt: skip
    engine.step()  # admitted (prefill) and decoded together with the long one
    assert engine.num_running == 2 and len(short.output_ids) == 2
    while engine.has_work():
        engine.step()
    order = [who for who, ev in events if isinstance(ev, FinishEvent)]
    assert order == ["short", "long"]
    # joining mid-flight changed nothing for either sequence
    assert long.output_ids == _greedy_reference(model, [1, 2, 3], 20)
    assert short.output_ids == _greedy_reference(model, [4, 5], 3)


def test_max_batch_bounds_running_and_queue_bounds_waiting(model):
    engine = Engine(model, max_batch=2, max_queue=3)
    params = SamplingParams(max_tokens=4, temperature=0)
    seqs = [engine.submit([i + 1], params) for i in range(3)]
    with pytest.raises(QueueFullError, match="max_queue=3"):
        engine.submit([1], params)
    engine.step()
    assert engine.num_running == 2 and engine.num_waiting == 1
    while engine.has_work():
        engine.step()
        assert engine.num_running <= 2
    assert all(s.finish_reason == "length" and len(s.output_ids) == 4 for s in seqs)


def test_cancel_frees_the_row_and_others_continue(model):
    engine = Engine(model, max_batch=3)
    params = SamplingParams(max_tokens=15, temperature=0)
    a, b, c = (engine.submit(p, params) for p in ([1, 2], [3, 4, 5], [6]))
    for _ in range(3):
        engine.step()
    b.cancel()
    engine.step()
    assert b.finish_reason == "cancelled" and engine.num_running == 2
    assert engine.cache.lengths[2] == 0  # the last row moved into b's row and was freed
    d = engine.submit([7, 8], params)  # takes the freed row
    while engine.has_work():
        engine.step()
    for s, p in ((a, [1, 2]), (c, [6]), (d, [7, 8])):
        assert s.output_ids == _greedy_reference(model, p, 15)
    assert engine.cache.lengths == [0, 0, 0]


def test_stop_ids_stop_strings_context_and_timeout(model):
    tok = ByteTokenizer()
    torch.manual_seed(1)
    byte_model = MoETransformer(ModelConfig.tiny(vocab_size=256, max_seq_len=16)).eval()
    engine = Engine(byte_model, tok, max_batch=2)
    free = engine.generate([65, 66], SamplingParams(max_tokens=10, temperature=0))
    first = free.output_ids[0]
    stopped = engine.generate([65, 66], SamplingParams(max_tokens=10, temperature=0,
                                                       stop_ids=(free.output_ids[3],)))  # fmt: skip
    k = free.output_ids.index(free.output_ids[3])
    assert stopped.output_ids == free.output_ids[:k] and stopped.finish_reason == "stop"
    # a stop string made of the 2nd and 3rd generated characters cuts the text before it
    text = free.text
    cut = engine.generate([65, 66], SamplingParams(max_tokens=10, temperature=0, stop=(text[1:3],)))
    assert cut.finish_reason == "stop" and cut.text == text[: text.index(text[1:3])]
    assert first == cut.output_ids[0]
    # 16 positions: 2 prompt + 14 fed back, plus the token predicted at the last position
    full = engine.generate([65, 66], SamplingParams(max_tokens=100, temperature=0))
    assert len(full.output_ids) == 15 and full.finish_reason == "length"
    slow = engine.submit([65], SamplingParams(max_tokens=10, timeout_s=0.01))
    time.sleep(0.02)
    engine.step()
    assert slow.finish_reason == "timeout" and not slow.output_ids


def test_events_carry_text_and_routing(model):
    tok = ByteTokenizer()
    torch.manual_seed(2)
    byte_model = MoETransformer(ModelConfig.tiny(vocab_size=256, max_seq_len=32)).eval()
    engine = Engine(byte_model, tok, max_batch=2)
    events = []
    seq = engine.submit(tok.encode("hi"), SamplingParams(max_tokens=5, temperature=0, routing=True),
                        events.append)  # fmt: skip
    plain = engine.submit(tok.encode("hi"), SamplingParams(max_tokens=5, temperature=0))
    while engine.has_work():
        engine.step()
    toks = [e for e in events if isinstance(e, TokenEvent)]
    assert [e.token_id for e in toks] == seq.output_ids == plain.output_ids
    assert "".join(e.text for e in events) == seq.text == tok.decode(seq.output_ids)
    k, E = byte_model.cfg.moe.router.top_k, byte_model.cfg.moe.router.num_experts
    # the experts reported for token i are those routed at the position that produced it
    ids = tok.encode("hi") + seq.output_ids
    with torch.no_grad():
        out = byte_model(torch.tensor([ids[:-1]]))
    moe = [r for r in out.records if r is not None]
    for i, ev in enumerate(toks):
        pos = len(tok.encode("hi")) - 1 + i
        assert len(ev.experts) == len(moe)
        for layer, rec in enumerate(moe):
            want = rec.all_expert_idx[rec.all_token_idx == pos].tolist()
            assert ev.experts[layer] == want and len(want) == k
            assert all(0 <= e < E for e in want)
    assert sum(sum(c) for c in engine.stats.expert_counts) == 2 * len(moe) * k * (2 + 4) * 1


def test_cache_is_not_preallocated_for_the_whole_context():
    torch.manual_seed(3)
    model = MoETransformer(ModelConfig.tiny(vocab_size=61, max_seq_len=1024)).eval()
    engine = Engine(model, max_batch=2)
    engine.generate([1, 2, 3], SamplingParams(max_tokens=5, temperature=0))
    assert engine.cache.capacity == 64 and engine.cache.k[0].shape[2] == 64
    engine.generate([1] * 70, SamplingParams(max_tokens=3, temperature=0))
    assert engine.cache.capacity == 128  # grown on demand


def test_padded_batched_prefill_counts_only_real_tokens(model):
    engine = Engine(model, max_batch=4)
    prompts = [[1] * 9, [2, 3], [4, 5, 6, 7]]
    seqs = [engine.submit(p, SamplingParams(max_tokens=3, temperature=0)) for p in prompts]
    engine.step()  # one padded prefill of all three (9 positions each), then one decode step
    assert engine.cache.lengths[:3] == [10, 3, 5] and engine.stats.prompt_tokens == 15
    while engine.has_work():
        engine.step()
    k, layers = model.cfg.moe.router.top_k, model.cfg.n_layers
    fed = 15 + 3 * 2  # prompt tokens plus two fed-back tokens per sequence
    assert [sum(c) for c in engine.stats.expert_counts] == [fed * k] * layers
    for s, p in zip(seqs, prompts, strict=True):
        assert s.output_ids == _greedy_reference(model, p, 3)


def test_expert_counts_follow_each_layers_own_expert_count(model):
    """A model pruned to different expert counts per layer (RaGEP): one count list per layer
    of that layer's length, every routed pair counted, tokens as generated alone."""
    from moelab.compress.prune import apply_pruning

    E = model.cfg.moe.router.num_experts
    keeps = [list(range(E - j)) for j in range(model.cfg.num_moe_layers)]
    pruned = apply_pruning(model, keeps)
    engine = Engine(pruned, max_batch=2)
    seqs = [engine.submit(p, SamplingParams(max_tokens=3, temperature=0)) for p in ([1, 2], [3])]
    while engine.has_work():
        engine.step()
    k = pruned.cfg.moe.router.top_k
    assert [len(c) for c in engine.stats.expert_counts] == [len(kp) for kp in keeps]
    assert [sum(c) for c in engine.stats.expert_counts] == [(3 + 2 * 2) * k] * len(keeps)
    for s, p in zip(seqs, ([1, 2], [3]), strict=True):
        assert s.output_ids == _greedy_reference(pruned, p, 3)


def test_causal_prefix_usmoe_decodes_incrementally_in_a_ragged_batch():
    """Per-row router state in the slotted cache: prompts of different lengths, rows that
    join mid-flight and rows moved when others finish all give the tokens of full
    recomputation, and compaction keeps the state near the longest row."""
    from moelab.core.config import RouterConfig
    from moelab.models import with_router

    torch.manual_seed(5)
    router = RouterConfig(num_experts=4, top_k=2, kind="usmoe",
                          selection_scope="causal_prefix", budget_fraction=0.75)  # fmt: skip
    usmoe = with_router(
        MoETransformer(ModelConfig.tiny(vocab_size=61, max_seq_len=48, n_kv_heads=2)), router
    ).eval()
    engine = Engine(usmoe, max_batch=3)
    prompts = PROMPTS + PROMPTS[::-1]
    lengths = [4, 9, 2, 6, 12, 3, 5, 1, 8, 2, 7, 4]
    seqs = [engine.submit(p, SamplingParams(max_tokens=n, temperature=0))
            for p, n in zip(prompts, lengths, strict=True)]  # fmt: skip
    state_lengths = []
    while engine.has_work():
        engine.step()
        state_lengths.append(max(s.length for s in engine.cache._prefix.values()))
    for p, n, s in zip(prompts, lengths, seqs, strict=True):
        assert s.output_ids == _greedy_reference(usmoe, p, n)
    longest_row = max(len(p) + n for p, n in zip(prompts, lengths, strict=True))
    # the state was compacted (it shrank at least once) and never held much more than
    # twice the longest row (+ one forward's positions before the compaction)
    assert any(b < a for a, b in itertools.pairwise(state_lengths))
    assert max(state_lengths) <= 2 * longest_row + 16 + max(len(p) for p in prompts)


def _capacity_model(seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig.tiny(vocab_size=61, max_seq_len=48, n_kv_heads=2)
    cfg.moe.router.capacity_factor = 0.5  # binds: ceil(T·2/4 · 0.5) = T/4 slots per expert
    return MoETransformer(ModelConfig.from_dict(cfg.to_dict())).eval()


def test_capacity_limited_models_are_served_dropless_and_batch_invariant():
    """Capacity is computed over every token of a forward pass, so served together the
    prompts used to take each other's expert slots (5 of 6 changed in the issue). Served
    dropless, as vLLM/SGLang do: batched == alone == the dropless model recomputed in full,
    and the model keeps its capacity factor for full-sequence scoring."""
    from moelab.models import with_router

    model = _capacity_model()
    dropless = with_router(model, dataclasses.replace(model.cfg.moe.router, capacity_factor=None))
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11], [12], [13, 14, 15], [16, 17, 18, 19, 20]]
    engine = Engine(model, max_batch=6)
    seqs = [engine.submit(p, SamplingParams(max_tokens=8, temperature=0)) for p in prompts]
    while engine.has_work():
        engine.step()
    for p, s in zip(prompts, seqs, strict=True):
        alone = Engine(model, max_batch=1).generate(p, SamplingParams(max_tokens=8, temperature=0))
        assert s.output_ids == alone.output_ids == _greedy_reference(dropless, p, 8)
    assert all(b.ffn.router.config.capacity_factor == 0.5 for b in model.blocks if b.is_moe)
    ids = torch.tensor([list(itertools.chain(*prompts))])
    with torch.no_grad():
        assert model(ids).records[0].dropped > 0  # outside the engine: the capacity as trained


def test_position_scope_usmoe_is_served_one_sequence_at_a_time():
    from moelab.core.config import RouterConfig
    from moelab.models import with_router

    torch.manual_seed(5)
    router = RouterConfig(num_experts=4, top_k=2, kind="usmoe", selection_scope="position")
    usmoe = with_router(
        MoETransformer(ModelConfig.tiny(vocab_size=61, max_seq_len=48, n_kv_heads=2)), router
    ).eval()
    with pytest.raises(ValueError, match=r"max_batch: layer 0 routes with USMoE .*'position'"):
        Engine(usmoe, max_batch=2)
    seq = Engine(usmoe, max_batch=1).generate(
        [1, 2, 3], SamplingParams(max_tokens=4, temperature=0)
    )
    assert seq.output_ids == _greedy_reference(usmoe, [1, 2, 3], 4)


def test_position_scope_usmoe_warns_that_serving_alone_is_not_the_trained_model():
    import warnings

    from moelab.core.config import RouterConfig
    from moelab.models import with_router
    from moelab.serve.batching import BatchDependentRoutingWarning

    torch.manual_seed(5)
    base = MoETransformer(ModelConfig.tiny(vocab_size=61, max_seq_len=48, n_kv_heads=2))
    for scope, warns in (("position", True), ("causal_prefix", False)):
        router = RouterConfig(num_experts=4, top_k=2, kind="usmoe", selection_scope=scope)
        model = with_router(base, router).eval()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            Engine(model, max_batch=1)
        hits = [w for w in caught if issubclass(w.category, BatchDependentRoutingWarning)]
        assert len(hits) == (1 if warns else 0), scope
        if warns:
            assert "selection_scope='position'" in str(hits[0].message)


def test_the_slotted_cache_length_is_the_longest_row_after_releases():
    model = MoETransformer(ModelConfig.tiny(vocab_size=50, max_seq_len=64)).eval()
    engine = Engine(model, max_batch=2)
    long = engine.submit([1] * 9, SamplingParams(max_tokens=2, temperature=0))
    short = engine.submit([2] * 3, SamplingParams(max_tokens=6, temperature=0))
    while engine.has_work():
        engine.step()
        assert engine.cache.length == max(engine.cache.lengths)
    assert long.finish_reason == short.finish_reason == "length"
