import pytest
import torch

from moelab.models import ModelConfig, MoETransformer
from moelab.models.block_diffusion import (
    PrefixKV,
    block_causal_mask,
    diffusion_forward,
    to_block_diffusion,
)
from moelab.serve.diffusion import DecodeOptions, diffusion_generate
from moelab.serve.diffusion.branches import branch_forward, build_branches, choose_branch
from moelab.serve.diffusion.decode import BlockDecoder, cold_positions, transfer_set
from moelab.serve.diffusion.experts import TeamMoEStep
from moelab.serve.generate import generate_ids

B = 4


def _dm(seed=0, experts=8):
    torch.manual_seed(seed)
    cfg = ModelConfig.tiny(vocab_size=20, num_experts=experts, max_seq_len=64)
    return to_block_diffusion(MoETransformer(cfg), B).eval()


def test_tau_one_all_masked_falls_back_to_one_token_per_step():
    dm = _dm()
    r = diffusion_generate(dm, [1, 2, 3, 4], max_new_tokens=8, options=DecodeOptions(threshold=1.0))
    assert len(r.ids) == 8 and dm.cfg.mask_token_id not in r.ids
    # 2 blocks of 4 one-token steps, plus one KV-storing forward between them (0 tokens)
    assert r.stats.accepted == [1, 1, 1, 1, 0, 1, 1, 1, 1]
    assert r.stats.kv == [False] * 4 + [True] + [False] * 4
    # the authors' count: denoising forwards only; the *_all variants include the KV pass
    assert r.stats.nfe == 8 and r.stats.tpf == 1.0
    assert r.stats.nfe_all == 9 and r.stats.tpf_all == pytest.approx(8 / 9)


def test_transfer_set_threshold_and_fallback():
    conf = torch.tensor([[0.2, 0.95, 0.97, 0.5], [0.2, 0.3, 0.1, 0.4]])
    masked = torch.tensor([[True, True, False, True], [True, True, True, False]])
    tr = transfer_set(conf, masked, 0.9)
    assert tr.tolist() == [[False, True, False, False], [False, True, False, False]]


def test_counters_equal_hand_counts_from_routing():
    dm = _dm(1)
    ids = torch.randint(0, 20, (1, 8))
    pos = torch.arange(8)
    mask = block_causal_mask(pos, pos, B)
    hook = TeamMoEStep()
    with torch.no_grad():
        out_h = diffusion_forward(dm, ids, pos, mask, moe_hook=hook).logits
        out = diffusion_forward(dm, ids, pos, mask)
    assert torch.allclose(out_h, out.logits, atol=1e-5)
    hand = [int(r.all_expert_idx.unique().numel()) for r in out.records if r is not None]
    assert hook.experts_per_layer() == hand
    r = diffusion_generate(dm, [1, 2, 3, 4], max_new_tokens=8, options=DecodeOptions(0.5))
    s = r.stats
    assert s.nfe_all == len(s.accepted) and s.tokens == 8
    assert s.apf_all == pytest.approx(sum(sum(f) / len(f) for f in s.forwards) / s.nfe_all)
    assert s.apt_all == pytest.approx(s.apf_all / (8 / s.nfe_all))
    den = [f for f, kv in zip(s.forwards, s.kv, strict=True) if not kv]
    assert s.nfe == len(den) == s.nfe_all - 1  # one KV pass between the two blocks
    assert s.apf == pytest.approx(sum(sum(f) / len(f) for f in den) / len(den))
    assert s.apt == pytest.approx(s.apf / (8 / len(den)))
    # the cost proxy: one dense cost per forward plus every distinct expert's bytes
    loaded = sum(sum(f) for f in s.forwards)
    assert s.cost_proxy_s(0.5, 100.0, 1000.0) == pytest.approx(0.5 * s.nfe_all + loaded * 0.1)
    # decode time excludes the prefill of the prompt's complete block
    assert 0 < s.prefill_s < s.wall_s and s.decode_s == pytest.approx(s.wall_s - s.prefill_s)


def test_caching_changes_no_token_when_cached_equals_recomputed():
    dm = _dm(2)
    with torch.no_grad():  # no attention: a token's MoE input depends on that token alone
        for blk in dm.blocks:
            blk.attn.o_proj.weight.zero_()
    for spec in (False, True):
        base = DecodeOptions(threshold=0.3, speculate=spec)
        cached = DecodeOptions(threshold=0.3, speculate=spec, cache=True)
        a = diffusion_generate(dm, [5, 6, 7], max_new_tokens=12, options=base)
        b = diffusion_generate(dm, [5, 6, 7], max_new_tokens=12, options=cached)
        assert a.ids == b.ids and a.stats.accepted == b.stats.accepted


def test_reused_rows_copy_stored_and_others_match_full():
    dm = _dm(3)
    blk = dm.blocks[0]
    x = torch.randn(6, dm.cfg.d_model)
    with torch.no_grad():
        full = blk.ffn(x).hidden_states
        reuse = torch.tensor([True, False, True, False, False, True])
        stored = {0: torch.randn(6, dm.cfg.d_model)}
        y = TeamMoEStep(reuse=reuse, stored=stored)(0, blk, x)
    assert torch.allclose(y[reuse], stored[0][reuse])
    assert torch.allclose(y[~reuse], full[~reuse], atol=1e-6)


def test_limited_activation_keeps_cold_inside_active_set_and_hot_unchanged():
    dm = _dm(4, experts=16)
    blk = dm.blocks[1]
    torch.manual_seed(0)
    x = torch.randn(12, dm.cfg.d_model)
    cold = torch.tensor(
        [False, False, True, True, True, False, True, True, True, True, False, True]
    )
    with torch.no_grad():
        plain = TeamMoEStep()
        y0 = plain(1, blk, x)
        lim = TeamMoEStep(cold=cold)
        y1 = lim(1, blk, x)
    active = set(plain.choice[1][~cold].flatten().tolist())
    assert set(lim.choice[1][cold].flatten().tolist()) <= active
    assert torch.equal(lim.choice[1][~cold], plain.choice[1][~cold])
    assert torch.allclose(y1[~cold], y0[~cold])
    assert int(lim.experts[1].sum()) == len(active) <= int(plain.experts[1].sum())
    assert not torch.equal(lim.choice[1][cold], plain.choice[1][cold])  # it did restrict


def test_cold_rule_by_hand():
    """The authors' rule: masked, farther than the distance from every unmasked position of
    the both-filled branch, not among the 2 most confident masked positions of B0, and
    previous confidence below 0.7."""
    M = 99
    base = torch.tensor([5, M, M, M, M, M, M, M])  # B0: position 0 decoded
    conf = torch.tensor([0.0, 0.9, 0.1, 0.6, 0.3, 0.8, 0.65, 0.05])
    ref = base.clone()
    ref[[1, 5]] = 7  # B3 fills B0's two most confident masked positions
    opts = DecodeOptions(threshold=0.95, limit=True, hot_distance=1)
    # distances to {0, 1, 5}: 0 0 1 2 1 0 1 2 -> farther than 1: positions 3 and 7
    for branch in (base, ref):
        cold = cold_positions(branch, ref, base, conf, M, opts, 8)
        assert cold.nonzero().flatten().tolist() == [3, 7]
    # position 3 is the 2nd most confident masked position of B3, but not of B0: still cold;
    # a confidence at the threshold makes it hot, and a wider distance leaves nothing cold
    conf[3] = 0.7
    assert cold_positions(base, ref, base, conf, M, opts, 8).nonzero().flatten().tolist() == [7]
    wide = DecodeOptions(threshold=0.95, limit=True, hot_distance=2)
    assert not cold_positions(base, ref, base, conf, M, wide, 8).any()
    # the authors' distance is 3 by default; a branch with no unmasked position has every
    # distance 0 in their code, so nothing is cold
    assert DecodeOptions().hot_distance == 3
    empty = torch.full((8,), M)
    assert not cold_positions(empty, empty, empty, torch.zeros(8), M, opts, 8).any()


def test_speculative_branches_equal_separate_forwards():
    dm = _dm(5)
    prefix = PrefixKV()
    pos = torch.arange(4)
    with torch.no_grad():
        diffusion_forward(
            dm, torch.tensor([[1, 2, 3, 4]]), pos, block_causal_mask(pos, pos, 4), prefix=prefix,
            store=True,
        )  # fmt: skip
        m = dm.cfg.mask_token_id
        br = build_branches(torch.tensor([7, m, m, m]), 1, 3, 9, 11)
        assert br.tolist() == [[7, m, m, m], [7, 9, m, m], [7, m, m, 11], [7, 9, m, 11]]
        together = branch_forward(dm, br, 4, prefix)
        for i in range(4):
            alone = branch_forward(dm, br[i : i + 1], 4, prefix)
            assert torch.allclose(together[i], alone[0], atol=1e-5)


def test_acceptance_rules():
    tr = torch.zeros(4, 4, dtype=torch.bool)
    pred = torch.zeros(4, 4, dtype=torch.long)
    assert choose_branch(tr, pred, 1, 2, 5, 6) == 0
    tr[0, 1], pred[0, 1] = True, 5  # a1
    assert choose_branch(tr, pred, 1, 2, 5, 6) == 1
    tr[1, 2], pred[1, 2] = True, 6  # a12
    assert choose_branch(tr, pred, 1, 2, 5, 6) == 3
    tr[1, 2] = False
    tr[0, 2], pred[0, 2] = True, 7  # B0 transfers p2 but disagrees with the fill
    assert choose_branch(tr, pred, 1, 2, 5, 6) == 1
    tr[0, 1] = False
    tr[2, 1], pred[2, 1] = True, 5  # a21 without a2 or a1
    assert choose_branch(tr, pred, 1, 2, 5, 6) == 0


def test_paths_refuse_the_wrong_model_kind():
    dm = _dm()
    with pytest.raises(ValueError, match="no causal"):
        list(generate_ids(dm, [1, 2], max_new_tokens=2))
    torch.manual_seed(0)
    ar = MoETransformer(ModelConfig.tiny(vocab_size=20))
    with pytest.raises(ValueError, match="block-diffusion path needs"):
        diffusion_generate(ar, [1, 2], max_new_tokens=4)
    with pytest.raises(ValueError, match="decoder"):
        DecodeOptions.preset("fast")
    with pytest.raises(ValueError, match="threshold"):
        DecodeOptions(threshold=0.0)


def test_refresh_every_step_is_vanilla_and_refresh_k_reuses_less():
    dm = _dm(3)
    base = diffusion_generate(dm, [5, 6, 7], max_new_tokens=12, options=DecodeOptions(0.5))
    every = diffusion_generate(
        dm, [5, 6, 7], max_new_tokens=12, options=DecodeOptions(0.5, cache=True, refresh=1)
    )
    assert every.ids == base.ids and every.stats.accepted == base.stats.accepted
    # every forward computes every row (the KV-storing ones always do), so activates as vanilla
    assert every.stats.forwards == base.stats.forwards
    with pytest.raises(ValueError, match="refresh"):
        DecodeOptions(refresh=0)


def test_cached_decoding_stores_the_keys_values_of_a_full_recompute():
    dm = _dm(4)
    prompt = [5, 6, 7, 8, 9, 1]
    dec = BlockDecoder(dm, prompt, max_new_tokens=10, options=DecodeOptions.preset("team"))
    assert dec.prefix.length == B
    dec.next_block()  # block 1 finished: its keys/values join the prefix
    assert dec.prefix.length == 2 * B and not dec.done
    assert dec.stats.accepted[-1] == 0  # the KV-storing forward
    full = PrefixKV()
    pos = torch.arange(2 * B)
    with torch.no_grad():
        diffusion_forward(
            dm, dec.x[None, : 2 * B], pos, block_causal_mask(pos, pos, B), prefix=full, store=True
        )
    for got, want in zip(dec.prefix.k + dec.prefix.v, full.k + full.v, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # and its expert count is that of every row computed
    hook = TeamMoEStep()
    p1 = PrefixKV(k=[k[:, :, :B] for k in full.k], v=[v[:, :, :B] for v in full.v])
    blk = torch.arange(B, 2 * B)
    with torch.no_grad():
        diffusion_forward(
            dm, dec.x[None, B : 2 * B], blk, torch.ones(B, 2 * B, dtype=torch.bool),
            prefix=p1, moe_hook=hook,
        )  # fmt: skip
    assert dec.stats.forwards[-1] == hook.experts_per_layer()


def test_speculative_fills_are_reused_at_the_next_step(monkeypatch):
    """The authors' DCD: the tokens speculation accepted were computed from the filled tokens
    in the accepting forward, so the next step reuses them; the earlier rule recomputes them.
    With no attention a reused output equals the recomputed one, so both decode the same
    tokens, and the authors' rule reuses exactly the accepted fills more rows."""
    from moelab.serve.diffusion import decode

    torch.manual_seed(2)  # blocks of 8: a block has steps after an accepted pair
    cfg = ModelConfig.tiny(vocab_size=20, num_experts=8, max_seq_len=64)
    dm = to_block_diffusion(MoETransformer(cfg), 8).eval()
    with torch.no_grad():
        for blk in dm.blocks:
            blk.attn.o_proj.weight.zero_()
    reused: list[int] = []
    real = decode._hook

    def spy(branches, cur, just, stored, prev_conf, mask_id, opts, b):
        if stored is not None:
            reused.append(int(((cur != mask_id) & ~just).sum()))
        return real(branches, cur, just, stored, prev_conf, mask_id, opts, b)

    monkeypatch.setattr(decode, "_hook", spy)
    # accept both fills whenever the step speculates, so fills are certainly accepted
    monkeypatch.setattr(decode, "choose_branch", lambda *a: 3)
    # τ = 1: one transfer per step (top-1), so every block has steps that speculate
    team = DecodeOptions.preset("team", 1.0)
    again = DecodeOptions(threshold=1.0, cache=True, limit=True, speculate=True, reuse_fills=False)
    a = diffusion_generate(dm, [5, 6, 7], max_new_tokens=24, options=team)
    n_a, reused[:] = list(reused), []
    b = diffusion_generate(dm, [5, 6, 7], max_new_tokens=24, options=again)
    assert a.ids == b.ids and a.stats.accepted == b.stats.accepted
    assert all(x >= y for x, y in zip(n_a, reused, strict=True))
    # the step after an accepted pair reuses both fills: exactly 2 rows more, or none when
    # the block ended with that step
    diffs = [x - y for x, y in zip(n_a, reused, strict=True)]
    assert set(diffs) <= {0, 2} and 2 in diffs
