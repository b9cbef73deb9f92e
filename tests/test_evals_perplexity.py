"""Token log-probs and the token-weighted held-out loss."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from evals import mean_loss, sequence_logprobs
from memorize_core import ConfigError

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def test_sequence_logprobs_are_next_token_log_softmax(model):
    ids = torch.randint(0, 64, (3, 9), generator=torch.Generator().manual_seed(1))
    lp = sequence_logprobs(model, ids)
    with torch.no_grad():
        want = torch.log_softmax(model(ids).logits.double(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    assert lp.shape == (3, 8)
    assert torch.allclose(lp.double(), want, atol=1e-5)
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0  # right padding: targets 6.. of row 0 are zeroed, earlier ones untouched
    masked = sequence_logprobs(model, ids, mask)
    assert (masked[0, 5:] == 0).all() and torch.allclose(masked[0, :5], lp[0, :5], atol=1e-5)


def test_mean_loss_is_token_weighted_and_matches_hf(model):
    rows = torch.randint(0, 64, (5, 12), generator=torch.Generator().manual_seed(2))
    labels = rows.clone()
    labels[0, 3:] = -100  # uneven supervision: per-batch averaging would be wrong
    labels[2, ::2] = -100
    with torch.no_grad():
        logits = model(rows).logits[:, :-1]
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), labels[:, 1:].reshape(-1),
                                               ignore_index=-100, reduction="sum")
    want = float(ce / (labels[:, 1:] != -100).sum())
    assert mean_loss(model, rows, labels, batch_size=2) == pytest.approx(want, rel=1e-5)
    with torch.no_grad():
        hf = model(rows, labels=labels).loss.item()
    assert mean_loss(model, rows, labels, batch_size=5) == pytest.approx(hf, rel=1e-5)


def test_mean_loss_rejects_bad_labels(model):
    rows = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ConfigError, match="labels"):
        mean_loss(model, rows, torch.full((2, 4), -100))
    with pytest.raises(ConfigError, match="labels"):
        mean_loss(model, rows, torch.zeros(2, 3, dtype=torch.long))
