"""Offloaded experts: outputs and generations identical to the in-memory model; statistics,
scheduling, bandwidth cap and bad inputs."""

import threading
import time

import numpy as np
import pytest
import torch

from moelab.compress.lossless import StoreError, compress_model, decompress_model
from moelab.compress.lossless.store import PACK_FILE, BandwidthLimiter
from moelab.models import ModelConfig, MoETransformer
from moelab.serve.generate import generate_ids
from moelab.serve.offload import load_offloaded, offload_engine
from moelab.serve.offload.scheduler import TensorTask, dispatch_order
from moelab.serve.offload.trace import record_requests, record_trace

E, K = 8, 2


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(vocab_size=48, max_seq_len=48)
    cfg.moe.router.num_experts = E
    cfg = ModelConfig.from_dict(cfg.to_dict())
    model = MoETransformer(cfg).eval().to(torch.bfloat16)
    seqs = [torch.randint(0, 48, (16,)) for _ in range(3)]
    trace = record_trace(model, seqs)
    root = tmp_path_factory.mktemp("off")
    compress_model(model, root / "zstd", codec="zstd", trace=trace)
    compress_model(model, root / "raw", codec="raw")
    expert_mib = (
        2
        * sum(
            t.numel()
            for t in (
                model.blocks[0].ffn.experts.w_gate_up[0],
                model.blocks[0].ffn.experts.w_down[0],
            )
        )
        / 2**20
    )
    return model, root, expert_mib, trace


def total_mib(setup, fraction):
    model, _, expert_mib, _ = setup
    return fraction * expert_mib * E * model.cfg.num_moe_layers


@pytest.mark.parametrize(
    ("store", "policy", "threads", "prefetch"),
    [
        ("zstd", "zipmoe", 2, 0),
        ("zstd", "zipmoe", 0, 0),
        ("zstd", "lru", 2, 2),
        ("raw", "lru", 0, 0),
        ("raw", "lfu", 2, 2),
        ("raw", "fifo", 1, 0),
        ("raw", "none", 0, 0),
        ("zstd", "none", None, 0),
    ],
)
def test_offloaded_generation_equals_in_memory(setup, store, policy, threads, prefetch):
    model, root, _, _ = setup
    prompt = [5, 9, 2, 7, 11]
    want = list(generate_ids(model, prompt, max_new_tokens=24, temperature=0))
    om = load_offloaded(
        root / store,
        # 80 %: the authors' planner gives zipmoe two tiers (30 % falls back to one LFU tier)
        cache_mb=total_mib(setup, 0.8 if policy == "zipmoe" else 0.3),
        policy=policy,
        threads=threads,
        prefetch=prefetch,
    )
    got = list(generate_ids(om, prompt, max_new_tokens=24, temperature=0))
    assert got == want
    # sampled generation and a batched forward are bit-identical too
    assert list(generate_ids(om, prompt, max_new_tokens=8, seed=3)) == list(
        generate_ids(model, prompt, max_new_tokens=8, seed=3)
    )
    x = torch.randint(0, 48, (3, 12))
    before = offload_engine(om).snapshot()
    requests = before.requests
    with torch.no_grad():
        assert torch.equal(om(x).logits, model(x).logits)
    s = offload_engine(om).snapshot()
    assert before.requests == requests < s.requests  # a snapshot is a copy
    assert s.requests == s.hits_full + s.hits_sm + s.misses
    assert s.misses > 0 and s.bytes_read > 0
    if prefetch:
        assert s.prefetch_issued > 0
    offload_engine(om).close()


def test_fp32_decode_equals_in_memory(tmp_path):
    """fp32 experts take the fused kernel's decode-sized path in memory; offloaded, each
    expert goes through the same kernel, so decoding is bit-identical too."""
    torch.manual_seed(1)
    cfg = ModelConfig.tiny(vocab_size=48, max_seq_len=48)
    cfg.moe.router.num_experts = E
    model = MoETransformer(ModelConfig.from_dict(cfg.to_dict())).eval()
    compress_model(model, tmp_path / "zstd", codec="zstd")
    om = load_offloaded(tmp_path / "zstd", cache_mb=1.0, threads=2)
    prompt = [5, 9, 2]
    assert list(generate_ids(om, prompt, max_new_tokens=12, temperature=0)) == list(
        generate_ids(model, prompt, max_new_tokens=12, temperature=0)
    )
    x = torch.randint(0, 48, (2, 3))
    with torch.no_grad():
        assert torch.equal(om(x).logits, model(x).logits)
    offload_engine(om).close()


def test_zipmoe_plan_uses_both_tiers_and_belady_bounds_lru(setup):
    model, root, _, _ = setup
    # the authors' rule needs each tier to hold E / L = 4 experts: 30 % of the experts'
    # bytes cannot (LFU fallback), 80 % can (4F + 4SM = 6 full experts' bytes of 6.4)
    om = load_offloaded(root / "zstd", cache_mb=total_mib(setup, 0.3), storage_mbps=20)
    assert offload_engine(om).plan.kind == "lfu"
    om = load_offloaded(root / "zstd", cache_mb=total_mib(setup, 0.8), storage_mbps=20)
    eng = offload_engine(om)
    assert (eng.plan.kind, eng.plan.n_full, eng.plan.n_sm) == ("two_tier", 4, 4)
    assert eng.plan.n_full * eng.full_bytes + eng.plan.n_sm * eng.sm_bytes <= eng.layer_bytes
    # the earlier rules, kept as options, serve the same tokens
    om = load_offloaded(
        root / "zstd", cache_mb=total_mib(setup, 0.3), planner="argmin", admission="hysteresis"
    )
    assert offload_engine(om).plan.kind == "two_tier"
    assert list(generate_ids(om, [4, 8], max_new_tokens=12, temperature=0)) == list(
        generate_ids(model, [4, 8], max_new_tokens=12, temperature=0)
    )
    prompt = [1, 2, 3]
    future = record_requests(
        model, lambda: list(generate_ids(model, prompt, max_new_tokens=16, temperature=0))
    )
    hits = {}
    for policy in ("lru", "belady"):
        om = load_offloaded(
            root / "raw", cache_mb=total_mib(setup, 0.3), policy=policy, future=future
        )
        out = list(generate_ids(om, prompt, max_new_tokens=16, temperature=0))
        assert out == list(generate_ids(model, prompt, max_new_tokens=16, temperature=0))
        hits[policy] = offload_engine(om).snapshot().hits_full
    assert hits["belady"] >= hits["lru"]


def test_waiting_for_loads_blocks_instead_of_spinning(setup, monkeypatch):
    """While an expert's second tensor is still being read, the forward thread blocks until a
    load finishes: each wait returns on a newly finished tensor, so there are no more waits
    than tensors. Before, a finished first tensor made every wait return at once, and the poll
    loop spun thousands of times, burning a core that the decode threads needed."""
    from moelab.serve.offload import engine as engine_module

    calls, real_wait = [], engine_module.wait

    def counting_wait(fs, **kw):
        calls.append(len(fs))
        return real_wait(fs, **kw)

    monkeypatch.setattr(engine_module, "wait", counting_wait)
    model, root, _, _ = setup
    om = load_offloaded(root / "zstd", cache_mb=total_mib(setup, 0.3), threads=2, storage_mbps=0.5)
    x = torch.randint(0, 48, (1, 8))
    with torch.no_grad():
        assert torch.equal(om(x).logits, model(x).logits)
    s = offload_engine(om).snapshot()
    offload_engine(om).close()
    tensors = 2 * (s.misses + s.hits_sm)  # w_gate_up and w_down per load
    assert s.wait_s > 0.05 and calls
    assert len(calls) <= tensors


def test_dispatch_order_interleaves_type_one_and_two():
    def task(i, one):
        spec = {"chunks": [{}] * 5}
        return TensorTask(0, i, "w", spec, None if one else np.zeros(1, np.uint8), False)

    ones = [task(i, True) for i in range(2)]
    twos = [task(10 + i, False) for i in range(5)]
    # P = 2, d_dec = 1, d_sm = 5: after one Type-I (5 ops → 2.5 ≤ 5) add Type-II until
    # ops/2 > 5·n_io: 5 → +5 = 10 (5 ≤ 5, add) → +5 = 15 (7.5 > 5, stop)
    order = dispatch_order(ones + twos, threads=2, d_dec=1.0, d_sm=5.0)
    assert [t.expert for t in order] == [0, 10, 11, 1, 12, 13, 14]


def test_bandwidth_cap_paces_reads():
    lim = BandwidthLimiter(mbps=10)  # 10 MB/s: 100 kB take 10 ms
    t0 = time.perf_counter()
    for _ in range(5):
        lim.wait(100_000, time.perf_counter())
    assert time.perf_counter() - t0 >= 0.05 - 1e-3
    with pytest.raises(ValueError, match="storage_mbps"):
        BandwidthLimiter(0)
    # a per-request latency: 5 reads of 1 byte at 4 ms each take >= 20 ms
    lim = BandwidthLimiter(mbps=1e6, latency_ms=4)
    t0 = time.perf_counter()
    for _ in range(5):
        lim.wait(1, time.perf_counter())
    assert time.perf_counter() - t0 >= 0.02 - 1e-3
    with pytest.raises(ValueError, match="latency_ms"):
        BandwidthLimiter(10, latency_ms=-1)


def test_uncached_reads_serve_the_same_tokens(setup):
    model, root, _, _ = setup
    om = load_offloaded(root / "zstd", cache_mb=total_mib(setup, 0.8), uncached=True)
    eng = offload_engine(om)
    assert eng.pack.uncached
    assert list(generate_ids(om, [6, 1], max_new_tokens=8, temperature=0)) == list(
        generate_ids(model, [6, 1], max_new_tokens=8, temperature=0)
    )
    assert eng.snapshot().bytes_read > 0
    eng.close()


def test_bad_inputs(setup, tmp_path):
    model, root, expert_mib, _ = setup
    with pytest.raises(ValueError, match="smaller than one layer's top-2 experts"):
        load_offloaded(root / "zstd", cache_mb=1.5 * expert_mib)
    with pytest.raises(ValueError, match="policy"):
        load_offloaded(root / "zstd", cache_mb=10, policy="arc")
    with pytest.raises(ValueError, match="compressed store"):
        load_offloaded(root / "raw", cache_mb=10, policy="zipmoe")
    with pytest.raises(ValueError, match="belady"):
        load_offloaded(root / "raw", cache_mb=10, policy="belady")
    # a pack tampered after loading fails at the read, naming the expert and the file
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(root / "zstd", bad)
    om = load_offloaded(bad, cache_mb=2 * expert_mib, verify="off")
    with open(bad / PACK_FILE, "r+b") as f:
        data = bytearray(f.read())
        for i in range(0, len(data), 97):
            data[i] ^= 0x5A
        f.seek(0)
        f.write(data)
    with pytest.raises(StoreError, match=r"experts.pack: layer \d+ expert \d+ tensor"):
        list(generate_ids(om, [1, 2], max_new_tokens=3, temperature=0))
    assert torch.equal(
        decompress_model(root / "zstd").blocks[0].ffn.experts.w_down,
        model.blocks[0].ffn.experts.w_down,
    )


def test_prefetch_staging_is_paid_from_the_rounding_first(setup):
    model, root, expert_mib, _ = setup
    L = model.cfg.num_moe_layers
    # 2 slots per layer plus half an expert spare; staging 1 expert: only the spare and one
    # slot go, staging 2: two slots go (1.5 experts short)
    mib = (2 * L + 0.5) * expert_mib
    for prefetch, lost in ((0, 0), (1, 1), (2, 2)):
        om = load_offloaded(root / "raw", cache_mb=mib, policy="lfu", prefetch=prefetch)
        slots = offload_engine(om).slots_per_layer
        assert sum(slots) == 2 * L - lost and min(slots) >= 1


def test_zipmoe_staging_is_paid_by_as_few_layers_as_possible(setup):
    """A budget of exactly 2 experts per layer: the staging buffer of one prefetched expert
    takes one expert's bytes from layer 0 alone; every other layer keeps the unprefetched
    plan, and the plans plus the staging fit the budget."""
    model, root, expert_mib, _ = setup
    L = model.cfg.num_moe_layers
    mib = 2 * L * expert_mib
    base = offload_engine(load_offloaded(root / "zstd", cache_mb=mib, threads=2))
    eng = offload_engine(load_offloaded(root / "zstd", cache_mb=mib, threads=2, prefetch=1))
    split = (base.plan.n_full, base.plan.n_sm)
    assert [(p.n_full, p.n_sm) for p in base.plans] == [split] * L
    assert [(p.n_full, p.n_sm) for p in eng.plans[1:]] == [split] * (L - 1)
    assert (eng.plan.n_full, eng.plan.n_sm) == split
    used = sum(p.n_full * eng.full_bytes + p.n_sm * eng.sm_bytes for p in eng.plans)
    assert used + eng.full_bytes <= mib * 2**20
    assert eng.plans[0].n_full * eng.full_bytes + eng.plans[0].n_sm * eng.sm_bytes <= (
        2 * L * expert_mib * 2**20 / L - eng.full_bytes
    )
    for e in (base, eng):
        e.close()


def test_truncated_sign_mantissa_bytes_name_the_expert(setup, tmp_path):
    """A pack cut inside the last tensor's SM bytes fails that load with a one-line error
    naming the file, layer, expert and tensor."""
    import shutil

    model, root, expert_mib, _ = setup
    bad = tmp_path / "cut"
    shutil.copytree(root / "zstd", bad)
    om = load_offloaded(bad, cache_mb=2 * expert_mib, verify="off")
    eng = offload_engine(om)
    L = model.cfg.num_moe_layers
    specs = eng.pack.tensors(L - 1, E - 1)
    last = max(specs.values(), key=lambda s: s["sm"]["offset"])
    with open(bad / PACK_FILE, "r+b") as f:
        f.truncate(last["sm"]["offset"] + last["sm"]["size"] // 2)
    futures = [f for _, f in eng.scheduler.submit(eng._tasks(L - 1, E - 1, None))]
    match = rf"experts.pack: layer {L - 1} expert {E - 1} tensor .*sign-mantissa bytes: truncated"
    with pytest.raises(StoreError, match=match):
        for f in futures:
            f.result(timeout=30)
    eng.close()


def test_demand_reads_go_before_queued_prefetches_and_cancelled_ones_are_never_read(setup):
    """With the read thread busy, prefetch loads of experts 1-2 are queued, then a demand
    load of expert 3 and a promotion of expert 2: the storage then serves 3, 2, 1 in that
    order; a cancelled prefetch (expert 4) is never read."""
    from moelab.serve.offload.pool import PREFETCH

    _, root, _, _ = setup
    om = load_offloaded(root / "zstd", cache_mb=total_mib(setup, 0.3), threads=2)
    eng = offload_engine(om)
    sched, pack = eng.scheduler, eng.pack
    offsets = {}
    for e in range(5):
        for spec in pack.tensors(0, e).values():
            offsets[spec["sm"]["offset"]] = e
            offsets[spec["chunks"][0]["offset"]] = e
    order, real_read = [], pack.read
    gate, entered = threading.Event(), threading.Event()

    def read(offset, size):
        if offset in offsets:
            order.append(offsets[offset])
        if offsets.get(offset) == 0:
            entered.set()
            gate.wait(5)
        return real_read(offset, size)

    pack.read = read
    first = sched.submit(eng._tasks(0, 0, None))  # holds the read thread
    assert entered.wait(5)
    pre = {e: sched.submit(eng._tasks(0, e, None), PREFETCH) for e in (1, 2, 4)}
    demand = sched.submit(eng._tasks(0, 3, None))
    sched.promote([f for _, f in pre[2]])
    sched.cancel([f for _, f in pre[4]])
    gate.set()
    for _, f in first + demand + pre[1] + pre[2]:
        assert f.result(5) is not None
    assert all(f.cancelled() for _, f in pre[4])
    later = [e for e in order if e != 0]
    assert 4 not in later
    # every read of expert 3 precedes every read of 2, and those precede every read of 1
    assert max(i for i, e in enumerate(later) if e == 3) < min(
        i for i, e in enumerate(later) if e == 2
    )
    assert max(i for i, e in enumerate(later) if e == 2) < min(
        i for i, e in enumerate(later) if e == 1
    )
    eng.close()


def test_gate_prefetch_guesses_the_next_layer_from_its_router(setup):
    """The gate predictor ranks experts by how many rows of the hidden state put them in the
    next layer's top-k (its own norm and router); for one row that is the router's top-k.
    Offloaded generation with it stays identical to the in-memory model."""
    from moelab.serve.offload.lookahead import guess_experts

    model, root, _, _ = setup
    blocks = [b for b in model.blocks if b.is_moe]
    h = torch.randn(3, 5, model.cfg.d_model, dtype=torch.bfloat16)
    logits = blocks[1].ffn.router.logits(blocks[1].ffn_norm(h).reshape(15, -1)).float()
    votes = torch.bincount(logits.topk(K, -1).indices.reshape(-1), minlength=E)
    got = guess_experts(blocks[1], h, 3)
    assert [int(votes[e]) for e in got] == sorted(votes.tolist(), reverse=True)[:3]
    one = h[:1, :1]
    top = blocks[1].ffn.router.logits(blocks[1].ffn_norm(one).reshape(1, -1)).topk(K)
    assert guess_experts(blocks[1], one, K) == top.indices[0].tolist()
    assert guess_experts(blocks[1], one, 8) == top.indices[0].tolist()  # only voted experts

    prompt = [5, 9, 2, 7, 11]
    want = list(generate_ids(model, prompt, max_new_tokens=16, temperature=0))
    om = load_offloaded(root / "zstd", cache_mb=total_mib(setup, 0.3), threads=2, prefetch=K)
    assert list(generate_ids(om, prompt, max_new_tokens=16, temperature=0)) == want
    s = offload_engine(om).snapshot()
    assert s.prefetch_issued > 0 and s.prefetch_hits > 0
    offload_engine(om).close()
    with pytest.raises(ValueError, match="predictor"):
        load_offloaded(root / "zstd", cache_mb=10, prefetch=1, predictor="oracle")


def test_trace_of_a_block_diffusion_model():
    """A block-diffusion model has no causal path: its profile routes the clean sequence under
    the block-causal mask, top-k experts per token and layer."""
    from moelab.models import ModelConfig, MoETransformer
    from moelab.models.block_diffusion import to_block_diffusion
    from moelab.serve.offload.trace import record_trace

    torch.manual_seed(0)
    dm = to_block_diffusion(MoETransformer(ModelConfig.tiny(vocab_size=20, num_experts=4)), 4)
    counts = record_trace(dm, [torch.randint(0, 20, (12,))])
    k = dm.cfg.moe.router.top_k
    assert counts.shape == (1, dm.cfg.num_moe_layers, 4)
    assert (counts.sum(-1) == 12 * k).all()


def test_offloaded_model_card_counts_the_stored_experts(setup):
    from moelab.models import count_params
    from moelab.serve.card import model_card

    model, root, _, _ = setup
    om = load_offloaded(root / "zstd", cache_mb=total_mib(setup, 0.3))
    assert model_card(om, "x")["params"] == count_params(model)
    offload_engine(om).close()


@pytest.mark.parametrize(
    ("policy", "prefetch", "predictor"),
    [("zipmoe", 0, "gate"), ("zipmoe", 1, "history"), ("lru", 2, "gate"), ("lfu", 1, "history")],
)
def test_layers_with_different_expert_counts_are_served_from_their_store(
    setup, tmp_path, policy, prefetch, predictor
):
    """A model pruned to 6 then 3 experts (RaGEP's per-layer budgets): the store, its
    profile, the planner, the caches and the predictor each follow the layer's own count, and
    generation equals the in-memory model's."""
    from moelab.compress.prune import apply_pruning

    model = apply_pruning(setup[0], [[0, 1, 2, 4, 5, 7], [1, 3, 6]])
    trace = record_trace(model, [torch.randint(0, 48, (16,)) for _ in range(3)])
    assert trace.shape == (3, 2, 6) and not trace[:, 1, 3:].any()
    compress_model(model, tmp_path / "s", trace=trace)
    prompt = [5, 9, 2, 7, 11]
    want = list(generate_ids(model, prompt, max_new_tokens=16, temperature=0))
    om = load_offloaded(
        tmp_path / "s", cache_mb=4 * setup[2], policy=policy, prefetch=prefetch,
        predictor=predictor,
    )  # fmt: skip
    assert list(generate_ids(om, prompt, max_new_tokens=16, temperature=0)) == want
    eng = offload_engine(om)
    assert eng.experts_per_layer == [6, 3]
    if policy == "zipmoe":
        assert all(p.n_full + p.n_sm <= E for p, E in zip(eng.plans, [6, 3], strict=True))
    else:
        assert eng.slots_per_layer[1] <= 3
    assert [len(t) for t in eng.predictor.total] == [6, 3]
    with pytest.raises(ValueError, match=r"trace: expected non-negative counts \[P, 2, 6\]"):
        load_offloaded(tmp_path / "s", cache_mb=4 * setup[2], trace=np.ones((1, 2, 8), int))


def test_no_cache_loads_every_request_and_threads_default_to_the_free_cores(setup):
    from moelab.serve.offload.engine import free_cores

    _, root, _, _ = setup
    om = load_offloaded(root / "raw", cache_mb=total_mib(setup, 0.5), policy="none", threads=0)
    list(generate_ids(om, [3, 4], max_new_tokens=6, temperature=0))
    st = offload_engine(om).snapshot()
    assert st.requests > 0 and st.hits_full == st.hits_sm == 0 and st.misses == st.requests
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        om = load_offloaded(root / "zstd", cache_mb=total_mib(setup, 0.5))
        assert offload_engine(om).config.threads == free_cores() >= 1
        offload_engine(om).close()
    finally:
        torch.set_num_threads(before)
