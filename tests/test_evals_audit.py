"""One-run privacy audit (Steinke et al. 2023): the binomial eps bound, guessing, the sweep, validity."""
import json
import math

import numpy as np
import pytest
from scipy import stats

from evals.audit import (
    SWEEP_FRACTIONS,
    audit,
    draw_inclusion,
    epsilon_lower_bound,
    guess_and_count,
    p_value,
    sweep_candidates,
)
from memorize_core import ConfigError


def _closed_form_all_correct(r: int, beta: float) -> float:
    q = beta ** (1.0 / r)  # P[Bin(r, q) >= r] = q^r = beta
    return math.log(q / (1.0 - q))


def _grid_bound(w: int, r: int, beta: float) -> float:
    # Independent brute force: the largest grid eps whose upper tail is still below beta.
    grid = np.linspace(0.0, 10.0, 100_001)
    q = 1.0 / (1.0 + np.exp(-grid))
    rejected = grid[stats.binom.sf(w - 1, r, q) < beta]
    return float(rejected.max()) if rejected.size else 0.0


@pytest.mark.parametrize("r", [1, 5, 20, 100, 1000])
@pytest.mark.parametrize("beta", [0.05, 0.01])
def test_all_correct_matches_closed_form(r, beta):
    # Clipped at 0: with r = 1 (or r = 5 at beta = 0.01) even all-correct is no evidence at all.
    expected = max(0.0, _closed_form_all_correct(r, beta))
    assert epsilon_lower_bound(r, r, beta=beta) == pytest.approx(expected, abs=1e-9)


@pytest.mark.parametrize("w,r", [(70, 100), (90, 100), (15, 20), (480, 500), (60, 100)])
def test_general_count_matches_grid_scan(w, r):
    eps = epsilon_lower_bound(w, r)
    assert eps == pytest.approx(_grid_bound(w, r, 0.05), abs=2e-4)
    if eps > 0:  # the boundary: upper tail equals beta there
        assert stats.binom.sf(w - 1, r, 1 / (1 + math.exp(-eps))) == pytest.approx(0.05, rel=1e-6)


def test_chance_monotone_and_more_guesses():
    assert epsilon_lower_bound(50, 100) == 0.0
    assert epsilon_lower_bound(500, 1000) == 0.0
    assert epsilon_lower_bound(0, 0) == 0.0
    bounds = [epsilon_lower_bound(w, 200) for w in range(0, 201)]
    assert all(a <= b for a, b in zip(bounds, bounds[1:]))
    assert bounds[-1] > bounds[180] > bounds[150] > 0.0
    # Same 80% accuracy, ten times the guesses: the binomial concentrates, the bound grows.
    assert epsilon_lower_bound(800, 1000) > epsilon_lower_bound(80, 100) > epsilon_lower_bound(8, 10)


def test_delta_term_matches_paper_formula():
    # delta = 0 is exactly the binomial bound; the delta > 0 p-value against a hand loop.
    assert epsilon_lower_bound(90, 100, delta=0.0, m=1000) == epsilon_lower_bound(90, 100)
    m, r, v, eps, delta = 1000, 100, 80, 0.7, 1e-5
    q = math.exp(eps) / (1 + math.exp(eps))
    f = [stats.binom.sf(u - 1, r, q) for u in range(0, v + 1)]
    alpha = max((f[v - i] - f[v]) / i for i in range(1, v + 1))
    assert p_value(v, r, eps, delta=delta, m=m) == pytest.approx(f[v] + 2 * m * delta * alpha, rel=1e-9)
    b0 = epsilon_lower_bound(90, 100)
    b1 = epsilon_lower_bound(90, 100, delta=1e-6, m=1000)
    b2 = epsilon_lower_bound(90, 100, delta=1e-4, m=1000)
    assert b0 >= b1 >= b2 >= 0.0 and b0 - b2 > 1e-3
    assert p_value(90, 100, b2, delta=1e-4, m=1000) == pytest.approx(0.05, rel=1e-6)


def test_guess_and_count_and_ties():
    inc = np.array([True, False, True, False, True, False])
    scores = np.array([5.0, 0.0, 4.0, 1.0, 3.0, 2.0])
    assert guess_and_count(scores, inc, 3, 3) == (6, 6)
    assert guess_and_count(-scores, inc, 2, 1) == (0, 3)
    assert guess_and_count(scores, inc, 0, 0) == (0, 0)
    # All tied: which canaries get guessed follows the seeded permutation, not the index order.
    flat = np.zeros(200)
    inc2 = draw_inclusion(200, 3)
    a = guess_and_count(flat, inc2, 50, 50, tie_seed=1)
    assert a == guess_and_count(flat, inc2, 50, 50, tie_seed=1)
    assert len({guess_and_count(flat, inc2, 50, 50, tie_seed=t) for t in range(10)}) > 1


def test_draw_inclusion_seeded():
    a = draw_inclusion(10_000, 7)
    assert a.dtype == np.bool_ and a.shape == (10_000,)
    np.testing.assert_array_equal(a, draw_inclusion(10_000, 7))
    assert not np.array_equal(a, draw_inclusion(10_000, 8))
    assert abs(a.mean() - 0.5) < 0.02


def test_sweep_list_and_bonferroni():
    assert sweep_candidates(1000) == [(10, 10), (25, 25), (50, 50), (100, 100), (250, 250), (500, 500)]
    assert sweep_candidates(60) == [(1, 2), (3, 3), (6, 6), (15, 15), (30, 30)]
    assert sweep_candidates(10) == [(1, 1), (2, 3), (5, 5)]
    rng = np.random.default_rng(0)
    inc = draw_inclusion(1000, 0)
    scores = inc * 0.8 + rng.normal(size=1000)
    res = audit(scores, inc)
    cands = sweep_candidates(1000)
    assert res.per_candidate_beta == pytest.approx(0.05 / len(cands))
    best = 0.0
    for kp, km in cands:
        w, r = guess_and_count(scores, inc, kp, km)
        best = max(best, epsilon_lower_bound(w, r, beta=0.05 / len(cands)))
        # Each candidate pays for the sweep: never above its own uncorrected bound.
        assert epsilon_lower_bound(w, r, beta=0.05 / len(cands)) <= epsilon_lower_bound(w, r)
    assert res.eps_lower_bound == best > 0.0
    table = [(c.k_plus, c.k_minus, c.correct) for c in res.candidates]
    assert (res.k_plus, res.k_minus, res.correct) in table
    d = json.loads(json.dumps(res.as_dict()))
    assert d["guesses"] == res.k_plus + res.k_minus and d["confidence"] == pytest.approx(0.95)
    assert len(d["candidates"]) == len(cands) and d["score_name"] == "neg_loss"
    fixed = audit(scores, inc, guesses=(100, 100), score_name="ref_calibrated")
    assert fixed.per_candidate_beta == 0.05 and fixed.guesses == 200 and fixed.score_name == "ref_calibrated"


def test_perfect_separation_m1000():
    inc = draw_inclusion(1000, 1)
    res = audit(inc.astype(float), inc)
    # r = m cannot be all correct with an even split (507 members here), so r = 500 is the largest
    # all-correct candidate: eps = log(q*/(1-q*)), q* = (beta/6)^(1/500) ~ 4.64 (5.34 at r = 1000).
    assert res.included == 507 and res.candidates[-1].correct == 993
    assert res.guesses == 500 and res.correct == 500
    assert res.eps_lower_bound == pytest.approx(_closed_form_all_correct(500, 0.05 / 6), abs=1e-9)
    assert 4.6 < res.eps_lower_bound < 4.7


def test_random_scores_give_small_bounds():
    small = 0
    for seed in range(20):
        inc = draw_inclusion(1000, seed)
        scores = np.random.default_rng(100 + seed).normal(size=1000)
        small += audit(scores, inc).eps_lower_bound <= 0.2
    assert small >= 19


def test_randomized_response_eps1_is_never_overshot():
    # Each score reveals membership through eps=1 randomized response: the audited mechanism IS
    # 1-DP, so a valid 95% lower bound may exceed 1 in at most ~5% of runs.
    q = math.e / (1 + math.e)
    over, top = 0, 0.0
    for seed in range(100):
        rng = np.random.default_rng(seed)
        inc = draw_inclusion(1000, 10_000 + seed)
        scores = np.where(rng.random(1000) < q, inc, ~inc).astype(float)
        eps = audit(scores, inc, tie_seed=seed).eps_lower_bound
        over += eps > 1.0
        top = max(top, eps)
    assert over <= 5
    assert top > 0.5  # the audit is not vacuous: it does see most of the leak


def test_bad_inputs_name_the_field():
    inc = draw_inclusion(10, 0)
    s = np.arange(10.0)
    cases = [
        (lambda: guess_and_count(s, inc, 6, 5), "guesses="),
        (lambda: audit(s, inc, guesses=(8, 8)), "guesses="),
        (lambda: audit(s, inc, guesses="best"), "guesses="),
        (lambda: audit(s, inc, beta=0.0), "beta="),
        (lambda: audit(s, inc, beta=1.5), "beta="),
        (lambda: epsilon_lower_bound(3, 5, beta=1.0), "beta="),
        (lambda: epsilon_lower_bound(6, 5), "correct="),
        (lambda: epsilon_lower_bound(3, -1), "guesses="),
        (lambda: epsilon_lower_bound(3, 5, delta=1e-5), "m="),
        (lambda: epsilon_lower_bound(3, 5, delta=1e-5, m=4), "m="),
        (lambda: epsilon_lower_bound(3, 5, delta=-1.0, m=10), "delta="),
        (lambda: audit(s[:9], inc), "scores="),
        (lambda: audit(s, inc.astype(int)), "included="),
        (lambda: audit(np.r_[s[:9], np.nan], inc), "scores="),
        (lambda: draw_inclusion(0, 1), "m="),
    ]
    for call, name in cases:
        with pytest.raises(ConfigError, match=name):
            call()
    assert len(SWEEP_FRACTIONS) == 6
