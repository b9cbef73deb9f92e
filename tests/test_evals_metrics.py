"""Hand-checked cases for the per-sequence memorization metrics."""
import pytest
import torch

from evals.metrics import exact_match, ids_text, longest_common_prefix, rouge_l, token_accuracy
from memorize_core import ConfigError


def test_token_accuracy_counts_matching_positions():
    assert token_accuracy([1, 2, 3, 4], [1, 2, 0, 4]) == 0.75
    assert token_accuracy([9, 9, 9, 9], [1, 2, 3, 4]) == 0.0
    # A short generation: missing positions are wrong; extra generated tokens are ignored.
    assert token_accuracy([1, 2], [1, 2, 3, 4]) == 0.5
    assert token_accuracy([1, 2, 3, 4, 5], [1, 2, 3, 4]) == 1.0
    assert token_accuracy(torch.tensor([[1, 0, 3]]), torch.tensor([1, 2, 3])) == pytest.approx(2 / 3)


def test_token_accuracy_empty_target_is_config_error():
    with pytest.raises(ConfigError, match="target"):
        token_accuracy([1], [])


def test_longest_common_prefix():
    assert longest_common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert longest_common_prefix([5, 2, 3], [1, 2, 3]) == 0  # later agreement does not count
    assert longest_common_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert longest_common_prefix([1, 2], [1, 2, 3]) == 2
    assert longest_common_prefix(torch.tensor([7, 8, 9]), [7, 8, 0]) == 2


def test_exact_match():
    assert exact_match([1, 2, 3], [1, 2, 3]) is True
    assert exact_match(torch.tensor([1, 2, 3]), [1, 2, 3]) is True
    assert exact_match([1, 2, 4], [1, 2, 3]) is False
    assert exact_match([1, 2], [1, 2, 3]) is False


def test_rouge_l_hand_checked():
    # LCS("a b c d", "a c d e") = "a c d": P = R = 3/4.
    assert rouge_l("a b c d", "a c d e") == pytest.approx(0.75)
    # LCS = 3, P = 3/3, R = 3/6 -> F = 2PR/(P+R) = 2/3.
    assert rouge_l("the cat sat", "the cat sat on the mat") == pytest.approx(2 / 3)
    assert rouge_l("x y z", "x y z") == 1.0
    assert rouge_l("p q", "r s") == 0.0


def test_rouge_l_on_space_joined_ids():
    # LCS("1 2 3", "1 3 2") has length 2 -> P = R = F = 2/3.
    assert ids_text([1, 2, 3]) == "1 2 3"
    assert rouge_l(ids_text([1, 2, 3]), ids_text([1, 3, 2])) == pytest.approx(2 / 3)
