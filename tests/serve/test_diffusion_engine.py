"""The serving engine for block-diffusion models: equal to the one-sequence decoder, continuous
batching at block granularity, sampling seeds, stops, routing, faults, and the HTTP API."""

from __future__ import annotations

import functools

import openai
import pytest
import torch

from moelab.data import ByteTokenizer
from moelab.errors import InvalidValueError
from moelab.models import ModelConfig, MoETransformer
from moelab.models.block_diffusion import to_block_diffusion
from moelab.serve import Engine, SamplingParams
from moelab.serve.diffusion import (
    BlockDecoder,
    DecodeOptions,
    DiffusionEngine,
    diffusion_generate,
    sampling_picker,
)

from .live import live_server

B = 4
TOK = ByteTokenizer()


def _dm(seed: int = 0, vocab: int = 20, max_seq_len: int = 64) -> MoETransformer:
    torch.manual_seed(seed)
    cfg = ModelConfig.tiny(vocab_size=vocab, num_experts=8, max_seq_len=max_seq_len)
    return to_block_diffusion(MoETransformer(cfg), B).eval()


@pytest.mark.parametrize("decoder", ["vanilla", "team"])
def test_engine_equals_single_sequence_decoding_and_admits_while_decoding(decoder):
    dm = _dm()
    opts = DecodeOptions.preset(decoder, 0.6)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [3, 3, 3, 3, 3, 3]]
    engine = DiffusionEngine(dm, options=opts, max_batch=2)
    seqs = [engine.submit(p, SamplingParams(max_tokens=10, temperature=0)) for p in prompts[:3]]
    engine.step()
    assert engine.num_running == 2 and engine.num_waiting == 1
    assert [len(s.output_ids) for s in seqs[:2]] == [1, 3]  # the rest of their first block
    seqs.append(engine.submit(prompts[3], SamplingParams(max_tokens=10, temperature=0)))
    while engine.has_work():
        engine.step()
    for p, s in zip(prompts, seqs, strict=True):
        want = diffusion_generate(dm, p, max_new_tokens=10, options=opts).ids
        assert s.output_ids == want and s.finish_reason == "length"
    assert engine.stats.generated_tokens == 40
    assert engine.stats.prompt_tokens == sum(map(len, prompts))


def test_sampling_is_seeded_per_sequence_and_matches_the_picker():
    dm = _dm(1)
    params = SamplingParams(max_tokens=12, temperature=1.0, top_k=5, seed=7)
    alone = DiffusionEngine(dm).generate([1, 2, 3], params).output_ids
    engine = DiffusionEngine(dm, max_batch=4)
    others = [
        engine.submit([5, 6], SamplingParams(max_tokens=12, temperature=1.0, seed=s))
        for s in range(3)
    ]
    mine = engine.submit([1, 2, 3], params)
    while engine.has_work():
        engine.step()
    assert mine.output_ids == alone
    assert len({tuple(s.output_ids) for s in others}) > 1  # different seeds, different draws
    g = torch.Generator().manual_seed(7)
    want = diffusion_generate(
        dm, [1, 2, 3], max_new_tokens=12, options=DecodeOptions.preset("team"),
        pick=sampling_picker(1.0, 5, 1.0, g),
    )  # fmt: skip
    assert alone == want.ids


def test_sampling_picker_confidence_is_the_drawn_tokens_probability():
    logits = torch.tensor([[[2.0, 1.0, 0.0, -1.0], [0.0, 1.0, 0.5, 5.0]]])
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        conf, pred = sampling_picker(1.0, 2, None, g)(logits)
        for row, kept in ((0, [0, 1]), (1, [3, 1])):  # the top-2 of each row
            t = int(pred[0, row])
            assert t in kept
            want = torch.softmax(logits[0, row, kept], dim=-1)[kept.index(t)]
            assert conf[0, row].item() == pytest.approx(want.item())
    conf, pred = sampling_picker(0.0)(logits)  # temperature 0: greedy
    assert pred.tolist() == [[0, 3]]
    assert conf[0, 1].item() == pytest.approx(torch.softmax(logits[0, 1], dim=-1)[3].item())


def test_stop_ids_end_the_sequence_unemitted():
    dm = _dm(2)
    free = diffusion_generate(dm, [1, 2], max_new_tokens=12, options=DecodeOptions(0.6)).ids
    stop = free[5]
    engine = DiffusionEngine(dm, options=DecodeOptions(0.6))
    s = engine.generate([1, 2], SamplingParams(max_tokens=12, temperature=0, stop_ids=(stop,)))
    assert s.finish_reason == "stop" and s.output_ids == free[: free.index(stop)]


def test_routing_reports_top_k_experts_per_layer_and_counts_add_up():
    dm = _dm(3)
    engine = DiffusionEngine(dm, options=DecodeOptions.preset("vanilla", 1.0))
    events = []
    s = engine.submit(
        [1, 2, 3, 4], SamplingParams(max_tokens=8, temperature=0, routing=True), events.append
    )
    while engine.has_work():
        engine.step()
    toks = [e for e in events if hasattr(e, "experts")]
    n_moe = sum(b.is_moe for b in dm.blocks)
    k = dm.blocks[-1].ffn.config.router.top_k
    assert len(toks) == len(s.output_ids) == 8
    for ev in toks:
        assert len(ev.experts) == n_moe and all(len(set(e)) == k for e in ev.experts)
    # τ = 1: one token per forward, 2 blocks of 4 forwards over 4 rows + 1 KV-storing forward
    rows = 2 * (4 * 4) + 4
    assert [sum(c) for c in engine.stats.expert_counts] == [rows * k] * n_moe


def test_routing_matches_a_replay_of_the_accepting_forward():
    """τ = 1 vanilla: each step transfers one token; the experts reported for it are the
    routing of its position in a plain forward over the block state before that step."""
    from moelab.models.block_diffusion import block_causal_mask, diffusion_forward

    dm = _dm(4)
    mask_id = dm.cfg.mask_token_id
    dec = BlockDecoder(dm, [1, 2, 3, 4], max_new_tokens=4, options=DecodeOptions(1.0), routing=True)
    block = dec.next_block()
    x = torch.tensor([1, 2, 3, 4] + [mask_id] * 4)
    pos = torch.arange(8)
    order = []  # replay greedy τ = 1: the most confident masked position each step
    for _ in range(4):
        with torch.no_grad():
            out = diffusion_forward(dm, x[None], pos, block_causal_mask(pos, pos, B))
        logits = out.logits[0, 4:].float()
        logits[:, mask_id] = float("-inf")
        conf, pred = logits.softmax(-1).max(-1)
        conf[x[4:] != mask_id] = -1
        p = int(conf.argmax())
        recs = [r for r in out.records if r is not None]
        order.append(
            (p, [sorted(r.all_expert_idx[r.all_token_idx == 4 + p].tolist()) for r in recs])
        )
        x[4 + p] = pred[p]
    assert block.ids == x[4:].tolist()
    for p, experts in order:
        assert [sorted(e) for e in block.experts[p]] == experts


def test_faults_and_refusals():
    dm = _dm(5)
    with pytest.raises(InvalidValueError, match="DiffusionEngine"):
        Engine(dm)
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="block_diffusion"):
        DiffusionEngine(MoETransformer(ModelConfig.tiny(vocab_size=20)))
    engine = DiffusionEngine(dm, max_batch=1)
    with pytest.raises(InvalidValueError, match="mask token"):
        engine.submit([1, dm.cfg.mask_token_id], SamplingParams())
    with pytest.raises(InvalidValueError, match="no block to decode"):
        DiffusionEngine(_dm(5, max_seq_len=18)).submit([1] * 16, SamplingParams())
    a = engine.submit([1, 2], SamplingParams(max_tokens=20, temperature=0))
    b = engine.submit([3], SamplingParams(max_tokens=20, temperature=0))
    engine.step()
    a.cancel()
    engine.step()
    assert a.finish_reason == "cancelled" and engine.running == [b] and len(engine.decoders) == 1
    with torch.no_grad():
        dm.lm_head.weight[0, 0] = float("nan")
    engine.drain()
    assert b.finish_reason == "error" and "not finite" in b.error and not engine.has_work()


def test_context_full_finishes_with_length():
    dm = _dm(6, max_seq_len=16)
    s = DiffusionEngine(dm).generate([1] * 10, SamplingParams(max_tokens=50, temperature=0))
    assert s.finish_reason == "length" and len(s.output_ids) == 6


def test_openai_client_against_a_diffusion_server():
    dm = _dm(7, vocab=256, max_seq_len=128)
    opts = DecodeOptions.preset("team", 0.8)
    make = functools.partial(DiffusionEngine, options=opts)
    with live_server(dm, make_engine=make) as (url, _):
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
        r = c.completions.create(model="tiny", prompt="ROMEO:", max_tokens=12, temperature=0)
        want = diffusion_generate(dm, TOK.encode("ROMEO:"), max_new_tokens=12, options=opts)
        assert r.choices[0].text == TOK.decode(want.ids)
        assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
        streamed = c.completions.create(
            model="tiny", prompt="ROMEO:", max_tokens=12, temperature=0, stream=True
        )
        assert "".join(ch.choices[0].text for ch in streamed) == r.choices[0].text
        with pytest.raises(openai.BadRequestError):
            c.completions.create(model="tiny", prompt="x", max_tokens=12, temperature=-1)
        assert [m.id for m in c.models.list().data] == ["tiny"]


def test_expert_counts_follow_each_layers_own_expert_count():
    """A block-diffusion model pruned to 5 then 3 experts: the engine's per-layer counts have
    each layer's own length and every routed pair is counted."""
    from moelab.compress.prune import apply_pruning

    dm = apply_pruning(_dm(3), [[0, 1, 2, 5, 7], [2, 4, 6]])
    engine = DiffusionEngine(dm, options=DecodeOptions.preset("vanilla", 1.0))
    engine.generate([1, 2, 3, 4], SamplingParams(max_tokens=8, temperature=0))
    k = dm.cfg.moe.router.top_k
    assert [len(c) for c in engine.stats.expert_counts] == [5, 3]
    assert [sum(c) for c in engine.stats.expert_counts] == [(2 * (4 * 4) + 4) * k] * 2
