"""The recipe's data: split the chains by episode seed, train the BPE tokenizer, encode."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from moelab.data.tokenizer import Tokenizer, make_tokenizer
from moelab.errors import InvalidValueError
from moelab.methods.agents.chain import ChainStep, read_chains
from moelab.methods.agents.config import ComeConfig
from moelab.methods.agents.tokens import EncodedChain, encode_chain


@dataclass
class AgentData:
    """Train and held-out chains, as text and as ids, with their tokenizer.

    Attributes:
        train_steps, test_steps: the chain steps. train, test: their encodings (same order).
        tokenizer: BPE trained on the training chains; eot_id: its end-of-chain id.
    """

    train_steps: list[ChainStep]
    test_steps: list[ChainStep]
    train: list[EncodedChain]
    test: list[EncodedChain]
    tokenizer: Tokenizer
    eot_id: int


def split_steps(
    steps: Sequence[ChainStep], config: ComeConfig
) -> tuple[list[ChainStep], list[ChainStep]]:
    """Per task (``config.tasks``, or every task in ``steps``), the episodes with the
    ``test_episodes`` highest seeds are held out; of the others at most ``train_episodes``
    (lowest seeds; 0 = all) train.

    Raises:
        ValueError: a task of ``config.tasks`` has no more episodes than ``test_episodes``.
    """
    seeds: dict[str, set[int]] = defaultdict(set)
    for s in steps:
        seeds[s.task].add(s.seed)
    tasks = config.tasks or tuple(seeds)
    test_seeds, train_seeds = {}, {}
    for task in tasks:
        order = sorted(seeds[task])
        if len(order) <= config.test_episodes:
            raise InvalidValueError(
                f"test_episodes: {config.test_episodes} leaves no training episode of {task} "
                f"({len(order)} episodes in the data)"
            )
        test_seeds[task] = set(order[-config.test_episodes :])
        rest = order[: -config.test_episodes]
        train_seeds[task] = set(rest[: config.train_episodes] if config.train_episodes else rest)
    train = [s for s in steps if s.task in tasks and s.seed in train_seeds[s.task]]
    test = [s for s in steps if s.task in tasks and s.seed in test_seeds[s.task]]
    return train, test


def prepare_data(
    config: ComeConfig,
    steps: Sequence[ChainStep] | None = None,
    tokenizer: Tokenizer | None = None,
) -> AgentData:
    """Split, train the tokenizer on the training chains (prompt and target text) and encode.

    Args:
        steps: chains to use instead of reading ``config.data_path`` (tests).
        tokenizer: a trained tokenizer to use instead (a saved run's).
    """
    if steps is None:
        steps = read_chains(config.data_path)
    train_steps, test_steps = split_steps(steps, config)
    if tokenizer is None:
        texts = [s.prompt + s.target for s in train_steps]
        tokenizer = make_tokenizer("bpe", texts, vocab_size=config.vocab_size)
    eot = tokenizer.eot_id
    if eot is None:
        raise InvalidValueError("tokenizer: needs an end-of-text id")

    def enc(ss: list[ChainStep]) -> list[EncodedChain]:
        return [encode_chain(tokenizer, s, eot, config.max_len) for s in ss]

    return AgentData(train_steps, test_steps, enc(train_steps), enc(test_steps), tokenizer, eot)
