import math

import torch

from moelab.models import ModelConfig, MoETransformer
from moelab.models.block_diffusion import to_block_diffusion
from moelab.train.diffusion import T_MIN, diffusion_loss_terms, noise_blocks


def test_noise_one_ratio_per_block():
    x0 = torch.arange(16).view(1, 16) % 7
    g = torch.Generator().manual_seed(0)
    xt, masked, t = noise_blocks(x0, 4, 99, g)
    assert torch.equal(xt[masked], torch.full_like(xt[masked], 99))
    assert torch.equal(xt[~masked], x0[~masked])
    tb = t.view(4, 4)
    assert torch.all(tb == tb[:, :1]) and bool((t >= T_MIN).all() and (t <= 1).all())


def test_loss_is_weighted_masked_ce_by_hand():
    torch.manual_seed(0)
    dm = to_block_diffusion(MoETransformer(ModelConfig.tiny(vocab_size=12)), 4).eval()
    x0 = torch.randint(0, 12, (2, 8))
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    with torch.no_grad():
        nats, _, _ = diffusion_loss_terms(dm, x0, g1)
        xt, masked, t = noise_blocks(x0, 4, 12, g2)
        # by hand: run the two-copy input and sum CE/t over masked positions
        from moelab.models.block_diffusion import bd3_training_mask, diffusion_forward

        pos = torch.arange(8)
        logits = diffusion_forward(
            dm, torch.cat([xt, x0], 1), torch.cat([pos, pos]), bd3_training_mask(8, 4)
        ).logits[:, :8]
        want = 0.0
        for b in range(2):
            for i in range(8):
                if masked[b, i]:
                    lp = torch.log_softmax(logits[b, i].double(), -1)[x0[b, i]]
                    want += -lp.item() / t[b, i].item()
    assert math.isclose(nats.item(), want, rel_tol=1e-4)


def test_train_block_diffusion_from_an_ar_run(corpus, tmp_path):
    import json

    import pytest

    from moelab.models import load_model
    from moelab.train.config import ConfigError
    from moelab.train.loop import train

    from .conftest import tiny_model, tiny_train

    ar = tmp_path / "ar"
    train(tiny_model(), tiny_train(corpus, steps=2, eval_every=2), ar, progress=False)
    bd = tmp_path / "bd"
    cfg = tiny_train(
        corpus, steps=4, eval_every=2, init_from=str(ar), objective="block-diffusion", block_size=8
    )
    res = train(None, cfg, bd, progress=False)
    model = load_model(bd)
    assert model.cfg.objective == "block_diffusion" and model.cfg.vocab_size == 257
    assert model.cfg.block_size == 8 and res.final_eval is not None
    lines = [json.loads(x) for x in (bd / "metrics.jsonl").read_text().splitlines()]
    val = [x["bpb"] for x in lines if x["split"] == "val"]
    assert len(val) == 3 and all(math.isfinite(v) and v > 0 for v in val)
    _eval_reports_the_elbo_next_to_the_ar_run(bd, ar)
    with pytest.raises(ConfigError, match="block_size"):
        tiny_train(corpus, objective="block-diffusion", block_size=5)
    with pytest.raises(ConfigError, match="objective"):
        train(None, tiny_train(corpus, init_from=str(bd)), tmp_path / "x", progress=False)


def _eval_reports_the_elbo_next_to_the_ar_run(bd, ar):
    """``moelab eval`` of a diffusion run scores the run it was initialised from on the same
    validation text (the AR model's own causal bits/byte there)."""
    import json

    from typer.testing import CliRunner

    from moelab.cli import app
    from moelab.data import load_tokenizer
    from moelab.models import load_model
    from moelab.train.evaluate import evaluate
    from moelab.train.loop import prepare_data, run_train_config

    res = CliRunner().invoke(app, ["eval", str(bd), "--json", "--tokens", "64"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["reference"]["run"] == str(ar) and "ELBO" in out["note"]
    cfg = run_train_config(bd)
    _, _, val = prepare_data(cfg, load_tokenizer(ar))
    want = evaluate(load_model(ar), val, seq_len=cfg.seq_len, batch_size=16, max_tokens=64)
    got = out["reference"]["overall"]
    assert math.isclose(got["bits_per_byte"], want.overall.bits_per_byte, rel_tol=1e-6)
    assert got["tokens"] == want.overall.tokens
    table = CliRunner().invoke(app, ["eval", str(bd), "--tokens", "64"])
    assert table.exit_code == 0 and f"{want.overall.bits_per_byte:.4f}" in table.output
