"""Tiny MoE models and calibration batches for the compression tests."""

from __future__ import annotations

import pytest
import torch

from moelab.core.config import ExpertsConfig, MoEConfig, RouterConfig
from moelab.data import ByteTokenizer
from moelab.models import ModelConfig, MoETransformer, save_model


def tiny_model(
    *, E: int = 6, k: int = 2, d: int = 16, layers: int = 2, seed: int = 0, **router
) -> MoETransformer:
    """A float64 tiny MoE LM with visible routing (init_std 0.3)."""
    torch.manual_seed(seed)
    shared = router.pop("shared_expert_size", 0)
    cfg = ModelConfig(
        vocab_size=37,
        d_model=d,
        n_layers=layers,
        n_heads=2,
        max_seq_len=32,
        init_std=0.3,
        dense_ffn_size=24,
        moe=MoEConfig(
            router=RouterConfig(num_experts=E, top_k=k, **router),
            experts=ExpertsConfig(hidden_size=d, ffn_hidden_size=12, shared_expert_size=shared),
        ),
    )
    return MoETransformer(cfg).double().eval()


def random_batches(n: int = 3, B: int = 2, S: int = 8, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 37, (B, S), generator=g) for _ in range(n)]


@pytest.fixture
def model():
    return tiny_model()


@pytest.fixture
def make_model():
    return tiny_model


@pytest.fixture
def make_batches():
    return random_batches


@pytest.fixture
def cli_model(tmp_path):
    """A saved one-layer byte-level model folder and a calibration text file."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=256, d_model=32, n_layers=1, n_heads=2, max_seq_len=64,
        moe=MoEConfig(router=RouterConfig(num_experts=4, top_k=2),
                      experts=ExpertsConfig(hidden_size=32, ffn_hidden_size=32)),
    )  # fmt: skip
    folder = tmp_path / "run"
    save_model(MoETransformer(cfg), folder)
    ByteTokenizer().save(folder)
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    return folder, text
