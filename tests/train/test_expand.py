"""SPARKLING width expansion: the paper's copy-copy init (and plain copy) preserve the function,
the heads are kept, the random ablation's RMS rule holds per matrix and per layer, optimizer
state is kept/scaled/reset as specified, the new groups' re-warmup follows Eq. 28, and
expand → checkpoint → resume equals an uninterrupted run."""

import dataclasses
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from moelab.core.config import ExpertsConfig, MoEConfig, RouterConfig
from moelab.models import ModelConfig, MoETransformer
from moelab.train.config import ConfigError, TrainConfig
from moelab.train.expand import (
    ExpandSpec,
    counterpart_cosine,
    default_rewarm_steps,
    expand_live,
    expand_model,
    expanded_config,
    fan_in_scale,
    matrix_output_rms,
    parse_expand,
    parse_factor,
)
from moelab.train.expand_axes import Axis
from moelab.train.loop import train
from moelab.train.optim import build_optimizer, rewarm_factor
from moelab.train.schedule import lr_at

from .conftest import tiny_model, tiny_train


def _cfg(
    dense=False,
    tied=False,
    shared=0,
    qk_norm="none",
    bias=False,
    first_dense=0,
    act="swiglu",
    ebias=False,
):
    cfg = ModelConfig(
        vocab_size=64,
        d_model=16,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=16,
        tie_embeddings=tied,
        qk_norm=qk_norm,
        attention_bias=bias,
        first_dense_layers=first_dense,
        dense_ffn_size=24,
        moe=MoEConfig(
            router=RouterConfig(num_experts=4, top_k=2),
            experts=ExpertsConfig(
                hidden_size=16,
                ffn_hidden_size=8,
                shared_expert_size=shared,
                shared_expert_gate=shared > 0,
                activation=act,
                bias=ebias,
            ),
        ),
    )
    return dataclasses.replace(cfg, moe=None) if dense else cfg


def _model(cfg, seed=0):
    torch.manual_seed(seed)
    m = MoETransformer(cfg).double()
    with torch.no_grad():  # non-trivial norm gains, so "mean of the old gains" is tested
        for name, p in m.named_parameters():
            if p.dim() == 1:
                p.mul_(1 + 0.3 * torch.rand_like(p))
            elif ".experts.b_" in name:  # expert biases start at 0: make them count
                p.normal_(0, 0.005)
    return m


IDS = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(0))
VARIANTS = [
    dict(),
    dict(dense=True),
    dict(tied=True),
    dict(shared=8, qk_norm="full", bias=True, first_dense=1),
    dict(dense=True, tied=True, qk_norm="head"),
    dict(act="geglu", ebias=True),
    dict(act="gelu", ebias=True),
]
AXES = [(2, None), (None, 2), (2, 3)]
RMS_TOL = 0.05


@pytest.mark.parametrize("init", ["sparkling", "copy"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("hidden,inner", AXES)
def test_copy_inits_preserve_the_function(variant, hidden, inner, init):
    # sparkling at 2x (fan-in 1/sqrt(1+3c) = 1/2) and 3x (1/(1+c) = 1/3) equals Net2Net's divisor
    m = _model(_cfg(**variant))
    e = expand_model(m, ExpandSpec(hidden=hidden, inner=inner, init=init))
    assert e.model.cfg.d_model == 16 * (hidden or 1)
    # heads and head_dim are kept (SPARKLING 3.3): q/k/v grow only their input columns
    c = e.model.cfg
    assert (c.n_heads, c.n_kv_heads, c.head_dim) == (4, 2, 4)
    q = e.model.blocks[0].attn.q_proj.weight
    o = e.model.blocks[0].attn.o_proj.weight
    assert tuple(q.shape) == (16, c.d_model) and tuple(o.shape) == (c.d_model, 16)
    tied_hidden = variant.get("tied") and hidden
    assert c.logit_scale == (0.5 if tied_hidden and init == "sparkling" else 1.0)
    a, b = m(IDS), e.model(IDS)
    # RMSNorm normalises in fp32 (the model's rule), so hidden copies agree to fp32 rounding;
    # inner-only copies touch no norm and agree to float64 rounding
    tol = 1e-6 if hidden else 1e-12
    torch.testing.assert_close(b.logits, a.logits, rtol=0, atol=tol)
    assert e.model(IDS).hidden_states.shape[-1] == 16 * (hidden or 1)
    # the copy really copies: every new unit equals its source
    role = "hidden" if hidden else "inner"
    assert counterpart_cosine(e.model, m.cfg, role) == pytest.approx(1.0, abs=1e-9)


def test_sparkling_init_is_copy_copy_with_the_papers_fan_in_scale():
    m = _model(_cfg(tied=True))
    e = expand_model(m, ExpandSpec(hidden=1.5, inner=2))  # no calibration batch needed
    old, new = dict(m.named_parameters()), dict(e.model.named_parameters())
    a_hidden = 1 / math.sqrt(1 + 3 * 0.5)  # Eq. 16, c = 0.5
    assert fan_in_scale(16, 24) == pytest.approx(a_hidden) and fan_in_scale(8, 16) == 0.5
    assert fan_in_scale(8, 32) == pytest.approx(1 / 4) and fan_in_scale(8, 32, copied=False) == 0.5
    src = torch.tensor(list(range(16)) + list(range(8)))  # new unit j copies j mod 16
    # fan-in along D: every entry (old too) times a, new columns copies
    q_o, q_n = old["blocks.0.attn.q_proj.weight"], new["blocks.0.attn.q_proj.weight"]
    torch.testing.assert_close(q_n, a_hidden * q_o[:, src], rtol=1e-12, atol=0)
    # fan-out along D: rows copied, unscaled; norm gains and embedding columns copied
    o_o, o_n = old["blocks.1.attn.o_proj.weight"], new["blocks.1.attn.o_proj.weight"]
    assert torch.equal(o_n, o_o[src])
    for name in ("blocks.0.attn_norm.weight", "norm.weight"):
        assert torch.equal(new[name], old[name][src])
    assert torch.equal(new["embed.weight"], old["embed.weight"][:, src])
    assert e.model.cfg.logit_scale == pytest.approx(a_hidden)  # tied head: on the logits
    # expert bank [E, D, 2F]: D fan-in (a), F fan-out; w_down [E, F, D]: F fan-in (1/2)
    g_o = old["blocks.0.ffn.experts.w_gate_up"]
    g_n = new["blocks.0.ffn.experts.w_gate_up"]
    f_src = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7] * 2 + [8, 9, 10, 11, 12, 13, 14, 15] * 2)
    torch.testing.assert_close(g_n, a_hidden * g_o[:, src][:, :, f_src], rtol=1e-12, atol=0)
    d_o, d_n = old["blocks.0.ffn.experts.w_down"], new["blocks.0.ffn.experts.w_down"]
    torch.testing.assert_close(d_n, 0.5 * d_o[:, torch.arange(16) % 8][:, :, src])
    r_o, r_n = old["blocks.0.ffn.router.weight"], new["blocks.0.ffn.router.weight"]
    torch.testing.assert_close(r_n, a_hidden * r_o[:, src], rtol=1e-12, atol=0)


def _block_rms(model):
    """The residual stream's RMS after each block on ``IDS``."""
    out = []
    hooks = [
        b.register_forward_hook(lambda mod, a, o: out.append(float(o[0].pow(2).mean().sqrt())))
        for b in model.blocks
    ]
    with torch.no_grad():
        model(IDS)
    for h in hooks:
        h.remove()
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_sparkling_init_keeps_layer_rms_at_a_non_copy_factor(variant):
    """At 1.5x the fan-in constant 1/sqrt(1 + 3c) no longer preserves the function (only 2x
    does), but the residual stream keeps its RMS per layer (SPARKLING Eq. 16)."""
    m = _model(_cfg(**variant))
    e = expand_model(m, ExpandSpec(hidden=1.5, inner=1.5, init="sparkling"))
    assert not torch.allclose(e.model(IDS).logits, m(IDS).logits, atol=1e-3)
    for x, y in zip(_block_rms(m), _block_rms(e.model), strict=True):
        assert y == pytest.approx(x, rel=RMS_TOL)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("hidden,inner", AXES)
def test_random_init_keeps_every_matrix_and_layer_rms(variant, hidden, inner):
    m = _model(_cfg(**variant))
    e = expand_model(m, ExpandSpec(hidden=hidden, inner=inner, init="random"), IDS, seed=3)
    ref, new = matrix_output_rms(m, IDS), matrix_output_rms(e.model, IDS)
    assert e.scales, "some matrix input grew, so some c was fitted"
    for key in e.scales:  # exactly, by construction, on the calibration batch
        torch.testing.assert_close(new[key], ref[key], rtol=1e-9, atol=0)
    for key in ref:  # and every other matrix keeps its RMS closely (no input growth; with
        # the heads kept, o_proj's 16 new random rows make its output RMS the noisiest)
        assert torch.allclose(new[key], ref[key], rtol=0.5), key
    # c is about 1/sqrt(2) for 2x input growth (independent new half)
    # (not with expert biases: in this tiny model b_down dominates an expert's output, so the
    # new random half barely changes its RMS and c stays near 1)
    cs = torch.cat([c.reshape(-1) for c in e.scales.values()])
    assert variant.get("ebias") or 0.4 < float(cs.median()) < 0.85

    # residual-stream RMS after each block, per layer, within RMS_TOL
    for x, y in zip(_block_rms(m), _block_rms(e.model), strict=True):
        assert y == pytest.approx(x, rel=RMS_TOL)
    # old entries unchanged up to their scale; new norm gains = mean of the old ones
    old_norm = m.blocks[0].attn_norm.weight
    new_norm = e.model.blocks[0].attn_norm.weight
    if hidden:
        torch.testing.assert_close(new_norm[:16], old_norm)
        torch.testing.assert_close(new_norm[16:], old_norm.mean().expand(16))
    q_old, q_new = m.blocks[1].attn.q_proj.weight, e.model.blocks[1].attn.q_proj.weight
    c = e.scales.get("blocks.1.attn.q_proj.weight", torch.tensor(1.0, dtype=torch.float64))
    torch.testing.assert_close(q_new[: q_old.shape[0], :16], c * q_old)


def test_random_new_entries_have_the_old_rms_and_naive_the_default_init():
    m = _model(_cfg())
    e = expand_model(m, ExpandSpec(inner=4, init="random"), IDS, seed=1)
    w_old = m.blocks[0].ffn.experts.w_gate_up  # [E, D, 2F]: gate block then up block
    w_new = e.model.blocks[0].ffn.experts.w_gate_up
    F_old, F_new = 8, 32
    torch.testing.assert_close(w_new[:, :, :F_old], w_old[:, :, :F_old])  # no input growth: c=1
    torch.testing.assert_close(w_new[:, :, F_new : F_new + F_old], w_old[:, :, F_old:])
    fresh = torch.cat([w_new[:, :, F_old:F_new], w_new[:, :, F_new + F_old :]], dim=-1)
    rms_old = w_old.pow(2).flatten(1).mean(1).sqrt()
    rms_new = fresh.pow(2).flatten(1).mean(1).sqrt()
    torch.testing.assert_close(rms_new, rms_old, rtol=0.1, atol=0)
    n = expand_model(m, ExpandSpec(inner=4, init="naive"), seed=1)
    new_part = n.model.blocks[0].ffn.experts.w_gate_up[:, :, F_old:F_new]
    assert float(new_part.std()) == pytest.approx(m.cfg.init_std, rel=0.1)
    torch.testing.assert_close(
        n.model.blocks[0].ffn.experts.w_down[:, :F_old], m.blocks[0].ffn.experts.w_down
    )


def _step(model, opt, lr=1e-2, step=0):
    opt.set_lr(step, lr)
    model.loss(IDS, IDS).loss.backward()
    opt.step()
    opt.zero_grad()


def _shards_of(opt, name):
    """[(layout group, region, shard tensor)] of parameter ``name``."""
    return [
        (g, region, t)
        for g, ts in zip(opt.layout, opt.shards, strict=True)
        for (n, region), t in zip(g["shards"], ts, strict=True)
        if n == name
    ]


@pytest.mark.parametrize("state", ["asymmetric", "scaled"])
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_optimizer_state_is_kept_or_scaled_and_new_entries_start_at_zero(optimizer, state):
    m = _model(_cfg()).float()
    tc = TrainConfig(optimizer=optimizer, lr=1e-2, beta1=0.9, beta2=0.95)
    opt = build_optimizer(m, tc)
    for s in range(3):
        _step(m, opt, step=s)
    name = "blocks.1.attn.q_proj.weight"  # [H*hd, D]: fan-in along D, x 1/2
    p_old = dict(m.named_parameters())[name]
    old_state = {k: v.clone() for k, v in opt.state_of(p_old).items()}
    spec = ExpandSpec(hidden=2, state=state, rewarm_steps=4)
    e = expand_live(m, opt, spec, tc, step=3, calib_ids=None, seed=0)
    s_old = 1.0 if state == "asymmetric" else 0.5  # the paper keeps S unscaled (Eq. 24)
    shards = _shards_of(e.optimizer, name)
    assert [r for _, r, _ in shards] == [[[0, 16], [0, 16]], [[0, 16], [16, 32]]]
    (g_old, _, t_old), (g_new, _, t_new) = shards
    st = e.optimizer.state_of(t_old)
    assert g_old["rewarm_from"] is None
    if optimizer == "adamw":
        if state == "asymmetric":  # exactly the pre-expansion state
            assert torch.equal(st["exp_avg"], old_state["exp_avg"])
            assert torch.equal(st["exp_avg_sq"], old_state["exp_avg_sq"])
        torch.testing.assert_close(st["exp_avg"], old_state["exp_avg"] * s_old)
        torch.testing.assert_close(st["exp_avg_sq"], old_state["exp_avg_sq"] * s_old**2)
        assert float(st["step"]) == 3
    else:
        momentum = old_state["momentum_buffer"] * s_old
        torch.testing.assert_close(st["momentum_buffer"], momentum, rtol=0, atol=0)
    # new entries: own group, re-warmed, no state at all (moments 0, step 0)
    assert e.optimizer.state_of(t_new) == {}
    assert g_new["rewarm_from"] == 3 and g_new["rewarm_steps"] == 4
    assert g_new["rewarm_ratio"] == pytest.approx(1.3)
    # one step later: the new moments are exactly (1-b)·g, g², i.e. they started at zero
    e.optimizer.set_lr(3, 1e-2)
    e.model.loss(IDS, IDS).loss.backward()
    grad = dict(e.model.named_parameters())[name].grad.clone()
    e.optimizer.step()
    st_new = e.optimizer.state_of(t_new)
    g_n = grad[:, 16:]
    if optimizer == "adamw":
        torch.testing.assert_close(st_new["exp_avg"], 0.1 * g_n, rtol=1e-6, atol=1e-12)
        torch.testing.assert_close(st_new["exp_avg_sq"], 0.05 * g_n**2, rtol=1e-6, atol=1e-16)
        assert float(st_new["step"]) == 1 and float(e.optimizer.state_of(t_old)["step"]) == 4
        torch.testing.assert_close(
            e.optimizer.state_of(t_old)["exp_avg"],
            0.9 * old_state["exp_avg"] * s_old + 0.1 * grad[:, :16],
            rtol=1e-6,
            atol=1e-12,
        )
    else:  # torch Muon: buf.lerp_(g, 1 - momentum) from a zero buffer
        torch.testing.assert_close(st_new["momentum_buffer"], 0.05 * g_n, rtol=1e-6, atol=1e-12)


def test_symmetric_copy_state_copies_moments_and_stays_symmetric():
    m = _model(_cfg(dense=True)).float()
    tc = TrainConfig(lr=1e-2, weight_decay=0.0)
    opt = build_optimizer(m, tc)
    for s in range(2):
        _step(m, opt, step=s)
    e = expand_live(
        m,
        opt,
        ExpandSpec(inner=2, init="copy", state="symmetric"),
        tc,
        step=2,
        calib_ids=None,
        seed=0,
    )
    name = "blocks.0.ffn.w_down.weight"  # [D, F]: input grows, copies divided by 2
    st_old = opt.state_of(dict(m.named_parameters())[name])
    for g, ts in zip(e.optimizer.layout, e.optimizer.shards, strict=True):
        for (n, _), t in zip(g["shards"], ts, strict=True):
            if n == name:
                st = e.optimizer.state_of(t)
                torch.testing.assert_close(st["exp_avg"], st_old["exp_avg"] / 2)
                torch.testing.assert_close(st["exp_avg_sq"], st_old["exp_avg_sq"] / 4)
                assert float(st["step"]) == 2 and g["rewarm_steps"] == 0
    for s in range(3):
        _step(e.model, e.optimizer, step=2 + s)
    assert counterpart_cosine(e.model, m.cfg, "inner") > 0.9999


def test_legacy_rewarm_factor_formula():  # layouts saved before the paper's re-warmup
    g = {"rewarm_from": 10, "rewarm_steps": 4}
    assert [rewarm_factor(s, g) for s in (9, 10, 11, 12, 13, 14, 100)] == [
        1.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0,
    ]  # fmt: skip
    assert rewarm_factor(10, {"rewarm_from": 10, "rewarm_steps": 0}) == 1.0
    assert rewarm_factor(10, {"rewarm_from": None, "rewarm_steps": 5}) == 1.0


def test_new_groups_follow_the_papers_asymmetric_rewarmup():
    # Eq. 28 (rewarm_tail "own"): new groups start at eta_e = eta(t_e), rise linearly to
    # 1.3 eta_e over tau_w steps, then their own cosine to eta_min at T; old groups stay on
    # the base schedule
    cfg = TrainConfig(steps=1000, warmup_steps=30, lr=1e-2, min_lr_ratio=0.1)
    m = _model(_cfg()).float()
    opt = build_optimizer(m, cfg)
    spec = ExpandSpec(inner=2, rewarm_steps=4, rewarm_tail="own")
    e = expand_live(m, opt, spec, cfg, step=500, calib_ids=None, seed=0)
    eta_e = 1e-2 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 470 / 970)))  # by hand
    peak, lo = 1.3 * eta_e, 1e-3
    new_gi = [i for i, g in enumerate(e.optimizer.layout) if g["rewarm_from"] == 500]
    old_gi = [i for i, g in enumerate(e.optimizer.layout) if g["rewarm_from"] is None]
    assert new_gi and old_gi
    expected = {
        500: eta_e,
        501: eta_e * 1.075,
        502: eta_e * 1.15,
        503: eta_e * 1.225,
        504: peak,
        752: lo + (peak - lo) * 0.5,  # halfway through the new cosine (248 of 496)
        999: lo + (peak - lo) * 0.5 * (1 + math.cos(math.pi * 495 / 496)),
    }
    for step, want in expected.items():
        base = lr_at(step, lr=1e-2, warmup_steps=30, total_steps=1000, min_lr_ratio=0.1)
        e.optimizer.set_lr(step, base)
        lrs = [g["lr"] for g in e.optimizer.param_groups]
        for i in new_gi:
            assert lrs[i] == pytest.approx(want, rel=1e-12), step
        for i in old_gi:
            assert lrs[i] == base
    assert lrs[new_gi[0]] > lrs[old_gi[0]]  # never below the old parameters' rate here
    assert default_rewarm_steps(31_800) == 250 and default_rewarm_steps(200) == 2
    cfg = TrainConfig(steps=1000, expand_at=500, expand_hidden=2.0)
    assert ExpandSpec.from_train_config(cfg).rewarm_steps == 4  # 0.8 % of the 500 left
    assert ExpandSpec.from_train_config(cfg).rewarm_ratio == 1.3


@pytest.mark.parametrize("ratio", [1.3, 1.0])
def test_short_rewarmup_returns_to_the_base_schedule(ratio):
    # rewarm_tail "base" (the default): the base rate times 1 -> rho over tau_w steps, back
    # to 1 over as many, then exactly the base rate; rho = 1 is the base schedule throughout
    cfg = TrainConfig(steps=1000, warmup_steps=30, lr=1e-2, min_lr_ratio=0.1)
    m = _model(_cfg()).float()
    spec = ExpandSpec(inner=2, rewarm_steps=4, rewarm_ratio=ratio)
    assert spec.rewarm_tail == "base" and TrainConfig().rewarm_tail == "base"
    e = expand_live(m, build_optimizer(m, cfg), spec, cfg, step=500, calib_ids=None, seed=0)
    new_gi = [i for i, g in enumerate(e.optimizer.layout) if g["rewarm_from"] == 500]
    assert new_gi
    rise = {500: 0.0, 501: 0.25, 502: 0.5, 504: 1.0, 506: 0.5, 507: 0.25, 508: 0.0, 900: 0.0}
    for step, r in rise.items():
        base = lr_at(step, lr=1e-2, warmup_steps=30, total_steps=1000, min_lr_ratio=0.1)
        e.optimizer.set_lr(step, base)
        want = base * (1 + (ratio - 1) * r)
        for i in new_gi:
            assert e.optimizer.param_groups[i]["lr"] == pytest.approx(want, rel=1e-12), step


def _losses(run):
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if r["split"] == "train"]


@pytest.mark.parametrize(
    "stop,optimizer,dense",
    [(2, "adamw", False), (4, "adamw", False), (4, "muon", False), (4, "adamw", True)],
)  # resume from before and after the expansion; Muon's state and a dense model after it
def test_expand_checkpoint_resume_equals_uninterrupted(corpus, tmp_path, stop, optimizer, dense):
    kw = dict(steps=7, expand_at=3, expand_hidden=2.0, expand_expert=2.0, rewarm_steps=3)
    kw["optimizer"] = optimizer
    if dense:
        kw.pop("expand_expert")
    cfg = dataclasses.replace(tiny_model(), moe=None) if dense else tiny_model()
    full, part = tmp_path / "full", tmp_path / "part"
    train(cfg, tiny_train(corpus, **kw), full, progress=False)
    train(cfg, tiny_train(corpus, **kw), part, progress=False, stop_after=stop)
    train(None, None, part, resume=True, progress=False)
    a, b = _losses(full), _losses(part)
    assert [s for s, _ in b] == list(range(1, 8))
    for (_, x), (_, y) in zip(a, b, strict=True):
        assert x == pytest.approx(y, rel=1e-6, abs=1e-6)
    wa, wb = load_file(full / "model.safetensors"), load_file(part / "model.safetensors")
    assert wa["embed.weight"].shape == (256, 64)
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=1e-5, atol=1e-6)


def test_bad_inputs_fail_clearly(corpus, tmp_path):
    c = expanded_config(_cfg(), 1.5, None)  # heads kept, d_model 16 -> 24
    assert (c.d_model, c.n_heads, c.n_kv_heads, c.head_dim) == (24, 4, 2, 4)
    with pytest.raises(ValueError, match="d_model"):
        expanded_config(_cfg(), 1.3, None)  # 16 * 1.3 = 20.8
    with pytest.raises(ValueError, match="rewarm_ratio"):
        ExpandSpec(hidden=2, rewarm_ratio=0.0)
    with pytest.raises(ConfigError, match="rewarm_ratio"):
        TrainConfig(rewarm_ratio=-1.0)
    with pytest.raises(ValueError, match="calibration"):
        expand_model(_model(_cfg()), ExpandSpec(hidden=2, init="random"))
    with pytest.raises(ValueError, match="expand_init"):
        TrainConfig(expand_init="sparkle")
    with pytest.raises(ValueError, match="> 1"):
        ExpandSpec(hidden=0.5)
    with pytest.raises(ValueError, match="> 1"):
        parse_factor("1x")
    with pytest.raises(ValueError, match="whole factor"):
        expand_model(_model(_cfg()), ExpandSpec(hidden=1.5, init="copy"))
    with pytest.raises(ValueError, match="hidden=F"):
        parse_expand("width=2x")
    assert parse_expand("hidden=2x, expert=1.5") == {"hidden": 2.0, "expert": 1.5}
    with pytest.raises(ConfigError, match="expand_at"):
        TrainConfig(steps=10, expand_at=10, expand_hidden=2.0)
    with pytest.raises(ConfigError, match="expand_at"):
        TrainConfig(steps=10, expand_hidden=2.0)
    with pytest.raises(ConfigError, match="shrink"):
        TrainConfig(steps=10, expand_at=5, expand_expert=0.5)
    run = tmp_path / "run"  # a factor the model cannot take fails before anything is written
    with pytest.raises(ValueError, match="d_model"):  # 32 * 1.3
        train(tiny_model(), tiny_train(corpus, expand_at=2, expand_hidden=1.3), run, progress=False)
    assert not run.exists()


def test_axis_bookkeeping():
    a = Axis(4, 12, blocks=2)  # [g0 g1 | u0 u1] -> [g0 g1 . . . . | u0 u1 . . . .]
    assert a.old_to_new().tolist() == [0, 1, 6, 7]
    assert a.source().tolist() == [0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3]
    assert a.counts().tolist() == [3.0] * 12
    assert a.new_intervals() == [(2, 6), (8, 12)]
    assert not math.isnan(float(a.counts().sum()))


def test_offline_expand_then_resume_equals_in_loop_expansion(corpus, tmp_path):
    from moelab.train.expand_run import expand_run

    kw = dict(steps=7, expand_at=3, expand_expert=2.0, expand_init="copy", expand_state="symmetric")
    inloop, small, grown = tmp_path / "inloop", tmp_path / "small", tmp_path / "grown"
    train(tiny_model(), tiny_train(corpus, **kw), inloop, progress=False)
    train(tiny_model(), tiny_train(corpus, steps=7), small, progress=False, stop_after=3)
    res = expand_run(small, grown, inner=2.0, init="copy", state="symmetric")
    assert res.step == 3 and res.new.moe.experts.ffn_hidden_size == 64
    assert not (small / "model.safetensors").exists()  # the source run is untouched
    train(None, None, grown, resume=True, progress=False)
    a, b = _losses(inloop), _losses(grown)
    for (_, x), (_, y) in zip(a, b, strict=True):
        assert x == pytest.approx(y, rel=1e-6, abs=1e-6)
    wa, wb = load_file(inloop / "model.safetensors"), load_file(grown / "model.safetensors")
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=1e-5, atol=1e-6)


def test_cli_expand_bad_inputs_exit_2_and_write_nothing(corpus, tmp_path):
    from typer.testing import CliRunner

    from moelab.cli import app

    finished = tmp_path / "finished"
    train(tiny_model(), tiny_train(corpus, checkpoint_every=0, steps=2), finished, progress=False)
    runner = CliRunner()
    out = tmp_path / "out"
    bare = tmp_path / "bare"  # a run folder whose checkpoints (optimizer state) are gone
    bare.mkdir()
    for f in finished.iterdir():
        if f.is_file():
            (bare / f.name).write_bytes(f.read_bytes())
    cases = [
        ([str(bare), "--hidden", "2x", "--out", str(out)], "optimizer state"),
        ([str(finished), "--hidden", "2x", "--out", str(out)], "last step"),
        ([str(finished), "--hidden", "0.5x", "--out", str(out)], "> 1"),
        ([str(tmp_path / "nope"), "--hidden", "2x", "--out", str(out)], "run.json"),
    ]
    for args, msg in cases:
        r = runner.invoke(app, ["expand", *args])
        assert r.exit_code == 2, r.output
        assert msg in r.output
        assert not out.exists()
    r = runner.invoke(app, ["train", "--data", str(corpus), "--out", str(out), "--steps", "5",
                            "--expand-at", "2", "--expand", "hidden=1.3x"])  # fmt: skip
    assert r.exit_code == 2 and "not a whole number" in r.output and not out.exists()
    r = runner.invoke(app, ["train", "--out", str(out), "--expand", "width=2"])
    assert r.exit_code == 2 and "hidden=F" in r.output


def test_a_second_expansion_splits_the_shards_again():
    m = _model(_cfg()).float()
    tc = TrainConfig(lr=1e-2)
    opt = build_optimizer(m, tc)
    _step(m, opt)
    e1 = expand_live(m, opt, ExpandSpec(hidden=2, init="copy"), tc, step=1, calib_ids=None, seed=0)
    _step(e1.model, e1.optimizer, step=1)
    e2 = expand_live(
        e1.model, e1.optimizer, ExpandSpec(inner=2, init="copy"), tc, step=2, calib_ids=None, seed=0
    )
    torch.testing.assert_close(e2.model(IDS).logits, e1.model(IDS).logits, rtol=0, atol=1e-5)
    # every entry of every parameter is covered by exactly one shard
    for name, p in e2.model.named_parameters():
        cover = torch.zeros(p.shape, dtype=torch.int64)
        for g in e2.optimizer.layout:
            for n, region in g["shards"]:
                if n == name:
                    sl = tuple(slice(a, b) for a, b in region) if region else ()
                    cover[sl] += 1
        assert bool((cover == 1).all()), name
    before = {n: p.detach().clone() for n, p in e2.model.named_parameters()}
    _step(e2.model, e2.optimizer, step=2)
    for n, p in e2.model.named_parameters():
        assert not torch.equal(before[n], p.detach()), f"{n} was not updated"


def test_tied_logit_scale_survives_save_load_and_folds_into_hf_export(tmp_path):
    from moelab.interop.hf import hf_state, model_from_hf_state
    from moelab.models import load_model, save_model

    torch.manual_seed(0)
    m = MoETransformer(ModelConfig.tiny(vocab_size=64, tie_embeddings=True))
    e = expand_model(m, ExpandSpec(hidden=2)).model
    assert e.cfg.logit_scale == 0.5
    ids = IDS % 64
    want = e(ids).logits
    torch.testing.assert_close(want, m(ids).logits, rtol=0, atol=1e-5)
    save_model(e, tmp_path / "m")
    back = load_model(tmp_path / "m")
    assert back.cfg.logit_scale == 0.5
    torch.testing.assert_close(back(ids).logits, want, rtol=0, atol=0)
    # Hugging Face has no logit scale: the export folds it into the final norm (exact)
    hf, tensors, _ = hf_state(e)
    imported, _ = model_from_hf_state(hf, tensors)
    assert imported.cfg.logit_scale == 1.0
    torch.testing.assert_close(imported(ids).logits, want, rtol=0, atol=1e-6)


def test_an_expansion_too_large_for_memory_fails_before_training(corpus, tmp_path):
    run = tmp_path / "run"
    kw = dict(steps=6, expand_at=3, expand_expert=10_000_000.0)
    with pytest.raises(ValueError, match="needs about"):
        train(tiny_model(), tiny_train(corpus, **kw), run, progress=False)
    assert not run.exists()
