import pytest

from moelab.core.config import ExpertsConfig, LossConfig, MoEConfig, RouterConfig
from moelab.models import ModelConfig
from moelab.train.config import TrainConfig

TEXT = (
    "To be, or not to be, that is the question:\n"
    "Whether 'tis nobler in the mind to suffer\n"
    "The slings and arrows of outrageous fortune,\n"
    "Or to take arms against a sea of troubles\n"
)


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(4):
        (folder / f"doc{i}.txt").write_text((TEXT * (3 + i)).replace("be", f"be{i}"))
    return folder


def tiny_model(expert_bias=False, load_balance="switch"):
    return ModelConfig(
        vocab_size=256,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=32,
        moe=MoEConfig(
            router=RouterConfig(
                num_experts=4, top_k=2, expert_bias=expert_bias, bias_update_rate=0.01
            ),
            experts=ExpertsConfig(hidden_size=32, ffn_hidden_size=32),
            losses=LossConfig(load_balance=load_balance),
        ),
    )


def tiny_train(corpus, **kw):
    base = dict(
        data=str(corpus),
        max_bytes_per_domain=None,
        val_fraction=0.25,
        seq_len=16,
        batch_size=2,
        steps=6,
        warmup_steps=2,
        eval_every=3,
        eval_tokens=64,
        checkpoint_every=2,
        log_every=1,
        lr=3e-3,
    )
    base.update(kw)
    return TrainConfig(**base)
