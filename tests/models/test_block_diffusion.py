import pytest
import torch

from moelab.models import ModelConfig, MoETransformer
from moelab.models.block_diffusion import (
    PrefixKV,
    bd3_training_mask,
    block_causal_mask,
    diffusion_forward,
    to_block_diffusion,
)


def _ar(seed=0):
    torch.manual_seed(seed)
    return MoETransformer(ModelConfig.tiny(vocab_size=20, max_seq_len=32)).eval()


def test_block_causal_mask_matches_hand_rule():
    b = 3
    pos = torch.arange(7)
    m = block_causal_mask(pos, pos, b)
    blocks = [0, 0, 0, 1, 1, 1, 2]
    for i in range(7):
        for j in range(7):
            assert bool(m[i, j]) == (blocks[j] <= blocks[i])
    # inside a block: bidirectional (0 sees 2); across: causal (2 does not see 3)
    assert m[0, 2] and not m[2, 3] and m[6, 0]


def test_bd3_training_mask_pattern():
    S, b = 4, 2
    m = bd3_training_mask(S, b)
    blk = [0, 0, 1, 1]
    for i in range(2 * S):
        for j in range(2 * S):
            qi, kj = i % S, j % S
            if i < S and j < S:  # noised -> noised: same block only
                want = blk[kj] == blk[qi]
            elif i < S:  # noised -> clean: strictly earlier blocks
                want = blk[kj] < blk[qi]
            elif j < S:  # clean -> noised: never
                want = False
            else:  # clean -> clean: block-causal
                want = blk[kj] <= blk[qi]
            assert bool(m[i, j]) == want, (i, j)
    with pytest.raises(ValueError, match="multiple of block_size"):
        bd3_training_mask(5, 2)


def test_block_size_one_equals_causal_model_and_mask_token_added():
    ar = _ar()
    dm = to_block_diffusion(ar, 1).eval()
    assert dm.cfg.vocab_size == 21 and dm.cfg.mask_token_id == 20
    assert torch.allclose(dm.embed.weight[20], ar.embed.weight.mean(0))
    ids = torch.randint(0, 20, (2, 9))
    pos = torch.arange(9)
    with torch.no_grad():
        ref = ar(ids).logits
        out = diffusion_forward(dm, ids, pos, block_causal_mask(pos, pos, 1)).logits
    assert torch.allclose(out[..., :20], ref, atol=1e-5)
    assert torch.all(out[..., 20] == 0)


def test_prefix_cache_equals_full_forward():
    dm = to_block_diffusion(_ar(1), 4).eval()
    ids = torch.randint(0, 21, (1, 12))
    pos = torch.arange(12)
    with torch.no_grad():
        full = diffusion_forward(dm, ids, pos, block_causal_mask(pos, pos, 4)).logits
        prefix = PrefixKV()
        for j in range(3):
            p = pos[4 * j : 4 * j + 4]
            mask = block_causal_mask(p, pos[: 4 * j + 4], 4)
            out = diffusion_forward(
                dm, ids[:, 4 * j : 4 * j + 4], p, mask, prefix=prefix, store=True
            ).logits
            assert torch.allclose(out, full[:, 4 * j : 4 * j + 4], atol=1e-5)
    assert prefix.length == 12


def test_causal_path_refuses_diffusion_model_and_reverse():
    ar = _ar()
    dm = to_block_diffusion(ar, 4)
    with pytest.raises(ValueError, match="no causal"):
        dm(torch.zeros(1, 4, dtype=torch.long))
    pos = torch.arange(4)
    with pytest.raises(ValueError, match="block-diffusion path needs"):
        diffusion_forward(ar, torch.zeros(1, 4, dtype=torch.long), pos, torch.ones(4, 4).bool())
    with pytest.raises(ValueError, match="already"):
        to_block_diffusion(dm, 4)


def test_config_roundtrip_and_old_configs_load():
    d = ModelConfig.tiny().to_dict()
    d.pop("objective"), d.pop("block_size")
    assert ModelConfig.from_dict(d).objective == "causal"
    with pytest.raises(ValueError, match="objective"):
        ModelConfig.tiny(objective="mlm")
