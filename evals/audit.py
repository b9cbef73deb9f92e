"""One-run privacy audit of DP training (Steinke, Nasr, Jagielski 2023, arXiv 2305.08846).

m audit canaries are each put in the training set independently with probability 1/2
(`draw_inclusion`). After ONE training run every canary gets a score, higher = more likely a
member: by default minus its loss (`score_name="neg_loss"`), or a reference-calibrated loss
(loss under a reference model minus loss under the audited one). The auditor guesses "in" for
the k+ highest scores, "out" for the k- lowest and abstains on the rest; W counts the correct
guesses among r = k+ + k-.

Why a LOWER bound: if training is (eps, delta)-DP, W is (almost) stochastically dominated by
Binomial(r, e^eps / (1 + e^eps)) -- each guess is no better than eps-randomized response. A W
too large for that binomial at confidence 1 - beta REJECTS the claim "the run is (eps, delta)-DP"
for that eps and, a fortiori, for every smaller eps. `eps_lower_bound` is the largest eps so
rejected. A weak attack, a bad score or few canaries give a small bound but never prove privacy:
an audit can only show that privacy is worse than claimed, never certify that it holds.

Without peeking: k+ and k- are fixed from m alone, before the scores are read. Either one
explicit (k+, k-) or, by default, the pre-registered sweep `SWEEP_FRACTIONS`: r = floor(f*m) for
f in {1/50, 1/20, 1/10, 1/5, 1/2, 1}, split k+ = r//2, k- = r - k+, dropping r < 2 and repeats.
With delta > 0 the binomial tail gets the paper's additive 2*m*delta term (`p_value`).
Reporting the best of L candidates is paid for by Bonferroni: each is tested at beta / L, so the
reported bound holds at overall confidence 1 - beta.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import numpy as np
from scipy import special, stats

from memorize_core import fail

SWEEP_FRACTIONS: tuple[float, ...] = (1 / 50, 1 / 20, 1 / 10, 1 / 5, 1 / 2, 1.0)


def _check_int(name: str, value: Any, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lo \
            or (hi is not None and value > hi):
        rng = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise fail(name, value, f"must be an integer {rng}")
    return int(value)


def _check_beta_delta(beta: float, delta: float) -> None:
    if not isinstance(beta, numbers.Real) or not 0.0 < beta < 1.0:
        raise fail("beta", beta, "must be in (0, 1); 0.05 gives a 95% confidence bound")
    if not isinstance(delta, numbers.Real) or not 0.0 <= delta < 1.0:
        raise fail("delta", delta, "must be in [0, 1); use the delta the DP accountant reports")


def p_value(correct: int, guesses: int, eps: float, *, delta: float = 0.0, m: int | None = None) -> float:
    """Upper bound on P[W >= correct] under (eps, delta)-DP (the paper's Theorem 3, computed as Algorithm 2).

    With r guesses, m canaries, q = e^eps / (1 + e^eps) and f(v) = P[Binomial(r, q) >= v]:
    delta = 0 gives f(v) exactly (Theorem 1); delta > 0 gives
        f(v) + 2 m delta max_{i=1..v} (f(v-i) - f(v)) / i,   f(v-i) - f(v) = P[v-i <= Bin(r, q) < v],
    the general theorem's bound as the paper's p-value routine (Corollary 5.4 / App. D in the
    arXiv text) evaluates it; i > v adds nothing since f(v-i) = 1 there. Note m, not r: every
    canary, guessed on or not, spends its delta.
    """
    q = float(special.expit(eps))
    tail = float(stats.binom.sf(correct - 1, guesses, q))
    if delta == 0.0 or correct == 0:
        return min(tail, 1.0)
    # pmf(v-1), pmf(v-2), ..., pmf(0): the cumulative sum is P[v - i <= X < v] for i = 1..v.
    pmf = stats.binom.pmf(np.arange(correct - 1, -1, -1), guesses, q)
    alpha = float(np.max(np.cumsum(pmf) / np.arange(1, correct + 1)))
    return min(tail + 2.0 * m * delta * alpha, 1.0)


def epsilon_lower_bound(correct: int, guesses: int, *, delta: float = 0.0, beta: float = 0.05,
                        m: int | None = None) -> float:
    """Largest eps whose (eps, delta)-DP claim `correct` of `guesses` rejects at level beta (0.0 if none)."""
    guesses = _check_int("guesses", guesses, 0)
    correct = _check_int("correct", correct, 0, guesses)
    _check_beta_delta(beta, delta)
    if delta > 0.0:
        if m is None:
            raise fail("m", m, "pass the number of canaries: the delta term of the bound grows with m")
        m = _check_int("m", m, guesses)
    if guesses == 0 or p_value(correct, guesses, 0.0, delta=delta, m=m) >= beta:
        return 0.0
    # Invariant p(lo) < beta <= p(hi); returning lo keeps the answer on the rejected side. With
    # delta = 0 p is increasing in eps; with delta > 0 any eps with p < beta is a valid rejection
    # and rejecting eps rejects every smaller one, so lo is sound even if p is not monotone.
    lo, hi = 0.0, 1.0
    while p_value(correct, guesses, hi, delta=delta, m=m) < beta:
        lo, hi = hi, 2.0 * hi
        if hi > 1e4:  # p -> 1 as eps grows whenever correct <= guesses; this is only a guard
            return lo
    while hi - lo > 1e-13 * max(1.0, hi):
        mid = 0.5 * (lo + hi)
        if p_value(correct, guesses, mid, delta=delta, m=m) < beta:
            lo = mid
        else:
            hi = mid
    return lo


def draw_inclusion(m: int, seed: int) -> np.ndarray:
    """Membership of m canaries, each True w.p. 1/2 from default_rng(seed); the manifest records (m, seed)."""
    m = _check_int("m", m, 1)
    return np.random.default_rng(seed).random(m) < 0.5


def _order(scores: np.ndarray, tie_seed: int) -> np.ndarray:
    # Ascending by score; ties ordered by a seeded permutation drawn independently of membership,
    # so a tie never leaks the answer (index order could, if canaries were laid out by membership).
    key = np.random.default_rng(tie_seed).permutation(scores.size)
    return np.lexsort((key, scores))


def _validate(scores: Any, included: Any) -> tuple[np.ndarray, np.ndarray]:
    s = np.asarray(scores, dtype=np.float64).ravel()
    inc = np.asarray(included).ravel()
    if inc.dtype != np.bool_:
        raise fail("included", inc.dtype, "pass a bool mask (e.g. draw_inclusion(m, seed))")
    if s.size != inc.size:
        raise fail("scores", f"len {s.size}", f"must match len(included) = {inc.size}")
    if s.size == 0:
        raise fail("scores", "[]", "pass one score per canary")
    if not np.isfinite(s).all():
        raise fail("scores", "non-finite", "scores must be finite; replace NaN/inf losses first")
    return s, inc


def guess_and_count(scores: Sequence[float] | np.ndarray, included: Sequence[bool] | np.ndarray,
                    k_plus: int, k_minus: int, *, tie_seed: int = 0) -> tuple[int, int]:
    """(correct, guesses): "in" for the k_plus highest scores, "out" for the k_minus lowest."""
    s, inc = _validate(scores, included)
    k_plus = _check_int("k_plus", k_plus, 0, s.size)
    k_minus = _check_int("k_minus", k_minus, 0, s.size)
    if k_plus + k_minus > s.size:
        raise fail("guesses", k_plus + k_minus, f"k_plus + k_minus must be <= m = {s.size}")
    order = _order(s, tie_seed)
    top = order[s.size - k_plus:]
    bottom = order[:k_minus]
    return int(inc[top].sum() + (~inc[bottom]).sum()), k_plus + k_minus


def sweep_candidates(m: int, fractions: Sequence[float] = SWEEP_FRACTIONS) -> list[tuple[int, int]]:
    """The pre-registered (k_plus, k_minus) list: r = floor(f*m) split evenly, r < 2 and repeats dropped."""
    out: list[tuple[int, int]] = []
    for f in fractions:
        r = int(math.floor(f * m + 1e-9))
        cand = (r // 2, r - r // 2)
        if r >= 2 and cand not in out:
            out.append(cand)
    return out


class Candidate(NamedTuple):
    k_plus: int
    k_minus: int
    correct: int
    eps_lower_bound: float


@dataclass(frozen=True)
class AuditResult:
    """Outcome of one audit; eps_lower_bound holds at confidence 1 - beta over the whole sweep."""

    m: int
    included: int
    k_plus: int
    k_minus: int
    guesses: int
    correct: int
    eps_lower_bound: float
    beta: float
    delta: float
    score_name: str
    per_candidate_beta: float
    candidates: tuple[Candidate, ...] = field(default_factory=tuple)

    @property
    def confidence(self) -> float:
        return 1.0 - self.beta

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready dict (the candidate table as a list of dicts)."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "candidates"}
        d["confidence"] = self.confidence
        d["candidates"] = [c._asdict() for c in self.candidates]
        return d


def audit(scores: Sequence[float] | np.ndarray, included: Sequence[bool] | np.ndarray, *,
          delta: float = 0.0, beta: float = 0.05,
          guesses: Literal["sweep"] | tuple[int, int] = "sweep",
          fractions: Sequence[float] = SWEEP_FRACTIONS, score_name: str = "neg_loss",
          tie_seed: int = 0) -> AuditResult:
    """Eps lower bound from one run: fixed (k_plus, k_minus), or the Bonferroni-corrected sweep."""
    s, inc = _validate(scores, included)
    _check_beta_delta(beta, delta)
    m = s.size
    if isinstance(guesses, str):
        if guesses != "sweep":
            raise fail("guesses", guesses, 'use "sweep" or a (k_plus, k_minus) pair fixed before scoring')
        cands = sweep_candidates(m, fractions)
        if not cands:
            raise fail("scores", f"len {m}", "the sweep needs m >= 2 canaries")
    else:
        if not isinstance(guesses, Sequence) or len(guesses) != 2:
            raise fail("guesses", guesses, 'use "sweep" or a (k_plus, k_minus) pair')
        cands = [(guesses[0], guesses[1])]
    level = beta / len(cands)
    rows = []
    for kp, km in cands:
        correct, r = guess_and_count(s, inc, kp, km, tie_seed=tie_seed)
        eps = epsilon_lower_bound(correct, r, delta=delta, beta=level, m=m)
        rows.append(Candidate(int(kp), int(km), correct, eps))
    # First maximum: ties go to the earlier (smaller r) candidate, a fixed, outcome-free rule.
    best = max(rows, key=lambda c: c.eps_lower_bound)
    return AuditResult(m=m, included=int(inc.sum()), k_plus=best.k_plus, k_minus=best.k_minus,
                       guesses=best.k_plus + best.k_minus, correct=best.correct,
                       eps_lower_bound=best.eps_lower_bound, beta=float(beta), delta=float(delta),
                       score_name=score_name, per_candidate_beta=level, candidates=tuple(rows))
