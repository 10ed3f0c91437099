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
    with pytest.raises(ConfigError, match="block_size"):
        tiny_train(corpus, objective="block-diffusion", block_size=5)
    with pytest.raises(ConfigError, match="objective"):
        train(None, tiny_train(corpus, init_from=str(bd)), tmp_path / "x", progress=False)
