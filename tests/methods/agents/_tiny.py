"""The tiny model and data settings the agents tests share (toy chains, d = 32, 2 layers)."""

from moelab.methods.agents.toy import TOY_TASKS

TINY = dict(
    tasks=TOY_TASKS,
    test_episodes=4,
    vocab_size=320,
    max_len=160,
    d_model=32,
    n_layers=2,
    n_heads=2,
    ffn_size=64,
    batch_size=8,
)
