import pytest
import torch

from moelab.data.tokenizer import ByteTokenizer
from moelab.models import ModelConfig, MoETransformer


@pytest.fixture
def tiny():
    """A tiny causal LM (block 1 dense: its ffn.w_down is 88 → 32) and a byte tokenizer."""
    torch.manual_seed(0)
    tok = ByteTokenizer()
    model = MoETransformer(ModelConfig.tiny(n_layers=2, moe_layers=(0,), vocab_size=tok.vocab_size))
    return model.eval(), tok
