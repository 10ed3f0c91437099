import pytest
import torch

from moelab.errors import InvalidValueError
from moelab.methods.editing.metrics import edit_score, token_accuracy


def test_token_accuracy_is_the_mean_over_prompts_of_per_prompt_accuracy():
    predicted = [torch.tensor([1, 2]), torch.tensor([3]), torch.tensor([7, 8, 9, 9])]
    reference = [torch.tensor([1, 5]), torch.tensor([3]), torch.tensor([7, 0, 0, 0])]
    assert token_accuracy(predicted, reference) == pytest.approx(100 * (0.5 + 1 + 0.25) / 3)
    assert edit_score(100.0, 50.0, 75.0, 25.0) == 62.5


def test_mismatched_predictions_are_refused():
    with pytest.raises(InvalidValueError, match="same non-zero number"):
        token_accuracy([torch.tensor([1])], [])
    with pytest.raises(InvalidValueError, match="prompt 0"):
        token_accuracy([torch.tensor([1, 2])], [torch.tensor([1])])
