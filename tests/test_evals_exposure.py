"""Exposure (secret sharer): rank definition on an enumerable space, skew-normal extrapolation."""
import math

import numpy as np
import pytest
import torch
from scipy import stats
from transformers import LlamaConfig, LlamaForCausalLM

from evals import (
    exposure_extrapolated,
    exposure_rank,
    group_exposure,
    sequence_log_perplexity,
    sequence_logprobs,
)
from memorize_core import ConfigError

torch.set_num_threads(1)


def test_exposure_rank_definition():
    logppl = np.random.default_rng(0).permutation(100).astype(float)  # secret s -> log-perplexity
    canary = int(np.flatnonzero(logppl == 3.0)[0])
    others = np.delete(logppl, canary)
    # Three secrets (log-ppl 0, 1, 2) beat the canary: rank 4 of 100.
    assert exposure_rank(3.0, others, 100) == pytest.approx(math.log2(100) - 2)
    assert exposure_rank(-1.0, others, 100) == pytest.approx(math.log2(100))  # the most likely secret
    assert exposure_rank(1e9, others, 100) == pytest.approx(0.0)  # the least likely


def test_exposure_rank_ties_and_sampling():
    # A tie counts as ahead of the canary: rank 1 + 2 = 3.
    assert exposure_rank(5.0, [5.0, 4.0, 9.0], 4) == pytest.approx(2 - math.log2(3))
    # A sample of 99 candidates from a space of 10,000 with 9 ahead: rank 1 + 9 * 9999 / 99.
    sample = np.r_[np.zeros(9), np.full(90, 10.0)]
    assert exposure_rank(1.0, sample, 10_000) == pytest.approx(math.log2(10_000) - math.log2(910.0))
    with pytest.raises(ConfigError, match="space_size=3"):
        exposure_rank(1.0, [1.0, 2.0, 3.0], 3)  # candidates + canary exceed the space


def test_group_exposure_sums_each_group_and_ranks_it():
    # Secrets 00, 01, 10, 11 with p = .4, .2, .3, .1: by first digit the groups hold .6 and .4, by the
    # second .7 and .3.
    secrets, p = ["00", "01", "10", "11"], np.array([0.4, 0.2, 0.3, 0.1])
    bits = -np.log2(p)
    first, second = [s[0] for s in secrets], [s[1] for s in secrets]
    assert group_exposure(bits, first, 0) == pytest.approx((1.0, 1, 2))
    assert group_exposure(bits, first, 3) == pytest.approx((0.0, 2, 2))
    # "01" is third of four in full, but its second digit is the second guess of two.
    assert exposure_rank(bits[1], np.delete(bits, 1), 4) == pytest.approx(2 - math.log2(3))
    assert group_exposure(bits, second, 1) == pytest.approx((0.0, 2, 2))
    assert group_exposure(bits, second, 2) == pytest.approx((1.0, 1, 2))
    # One candidate per group is plain exposure; a tie between groups counts as ahead.
    for i in range(4):
        full = exposure_rank(bits[i], np.delete(bits, i), 4)
        assert group_exposure(bits, secrets, i)[0] == pytest.approx(full)
    assert group_exposure(-np.log2([0.25, 0.25, 0.25, 0.25]), first, 0)[1] == 2
    with pytest.raises(ConfigError, match="keys"):
        group_exposure(bits, first[:3], 0)
    with pytest.raises(ConfigError, match="target"):
        group_exposure(bits, first, 4)


def test_extrapolated_close_to_exact_on_normal_sample():
    sample = np.random.default_rng(1).normal(50.0, 5.0, 20_000)
    canary = 40.0  # two standard deviations below the mean
    exact = exposure_rank(canary, sample, sample.size + 1)
    extrap = exposure_extrapolated(canary, sample)
    assert extrap == pytest.approx(exact, abs=0.15)
    assert extrap == pytest.approx(-math.log2(stats.norm.cdf(-2.0)), abs=0.15)
    with pytest.raises(ConfigError, match="sample_logppls"):
        exposure_extrapolated(1.0, [1.0, 2.0])


def test_exposure_of_a_two_digit_secret_on_a_model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg)
    prompt, digits = [40, 41, 42, 43], list(range(10, 20))  # "the secret is" + digit tokens
    space = [prompt + [digits[a], digits[b]] for a in range(10) for b in range(10)]
    logppl = sequence_log_perplexity(model, space, spans=(4, 6), batch_size=32)
    # By hand: -log2 p(d1 | prompt) - log2 p(d2 | prompt, d1) for every secret.
    lp = sequence_logprobs(model, torch.tensor(space)).double().numpy()
    want = -(lp[:, 3] + lp[:, 4]) / math.log(2)
    assert np.allclose(logppl, want, atol=1e-5)
    canary = 37
    rank = 1 + int((np.delete(want, canary) <= want[canary]).sum())
    assert exposure_rank(logppl[canary], np.delete(logppl, canary), 100) == pytest.approx(
        math.log2(100) - math.log2(rank))
    # Per-sequence spans and the default span (every token but the first) on ragged sequences.
    ragged = [space[0], space[1][:5]]
    per = sequence_log_perplexity(model, ragged, spans=[(4, 6), (4, 5)])
    assert per == pytest.approx([want[0], -lp[1, 3] / math.log(2)], abs=1e-5)
    full = sequence_log_perplexity(model, ragged)
    assert full[1] == pytest.approx(-lp[1, :4].sum() / math.log(2), abs=1e-5)
    with pytest.raises(ConfigError, match=r"spans\[0\]"):
        sequence_log_perplexity(model, ragged, spans=(0, 3))
