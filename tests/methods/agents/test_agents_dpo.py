"""Info-DPO: the DPO loss against a hand computation; information gain on a constructed reward."""

import math

import numpy as np
import pytest
import torch

from moelab.methods.agents.dpo import (
    dpo_loss,
    information_gain,
    reasoning_reward,
    stage_probabilities,
)


def test_dpo_loss_equals_a_hand_computation():
    # margin = (−1 − −2) − (−3 − −2) = 2; β·margin = 1; −log σ(1) = log(1 + e^−1)
    loss = dpo_loss(
        torch.tensor([-1.0, -2.0]),
        torch.tensor([-3.0, -2.0]),
        torch.tensor([-2.0, -2.0]),
        torch.tensor([-2.0, -2.0]),
        beta=0.5,
    )
    # second pair: margin 0 → log 2
    assert float(loss) == pytest.approx((math.log1p(math.exp(-1.0)) + math.log(2.0)) / 2, abs=1e-7)


def test_information_gain_of_a_chain_on_a_constructed_reward_model():
    prompt, parts, function = [1, 2], [[10], [11, 12], [13]], [20, 0]
    # the constructed reward knows P_k from how many reasoning ids precede the response
    table = {2: 0.1, 3: 0.3, 5: 0.35, 6: 0.9}
    seen = []

    def logprob(chains):
        out = []
        for c in chains:
            assert c.ids[c.prompt_len :].tolist() == function  # the response is <af> only
            assert np.all(c.stage[c.prompt_len :] >= 0) and np.all(c.stage[: c.prompt_len] == -1)
            seen.append(c.ids[: c.prompt_len].tolist())
            out.append(math.log(table[c.prompt_len]))
        return torch.tensor(out)

    probs = stage_probabilities(logprob, prompt, parts, function)
    assert probs == pytest.approx([0.1, 0.3, 0.35, 0.9])
    assert seen == [[1, 2], [1, 2, 10], [1, 2, 10, 11, 12], [1, 2, 10, 11, 12, 13]]
    gains = information_gain(probs)
    assert gains == pytest.approx([0.2, 0.05, 0.55])
    assert reasoning_reward(gains) == pytest.approx(0.2 * 0.05 * 0.55)
    # a stage that lowers P is floored at 1e-3
    assert reasoning_reward(information_gain([0.5, 0.4, 0.6, 0.8])) == pytest.approx(
        1e-3 * 0.2 * 0.2
    )
