"""Paired tests of two models scored on the same documents: does a mitigation change memorization, in one run?

Both models answer the same documents, so every document is its own control and one seed can already
tell a real change from the noise of which documents happened to be drawn:
  mcnemar            a yes/no per document (exact match): the exact McNemar test, the two-sided binomial
                     test of the discordant documents (one model right, the other wrong) against 1/2
  paired_difference  a number per document (ROUGE-L, loss): the mean of the per-document differences, its
                     percentile bootstrap interval (documents resampled) and the p of a sign-flip
                     permutation test of that mean (every flip up to 13 documents, else 9,999 random ones)
  paired_auc         a membership-inference AUC on the same members and non-members: the difference of the
                     two AUCs, its paired stratified bootstrap interval (one resample of members and one of
                     non-members scores both models) and p from the bootstrap z = diff / sd
  adjust             Benjamini-Hochberg adjusted p-values over a report's tests (scipy)
A test says how sure one run is about these documents; it does not replace seeds (a different draw of
the training corpus and order), which memorization.experiments.replicates averages.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from evals.mia import roc_metrics, roc_on_resamples
from memorize_core import fail

__all__ = ["adjust", "format_test", "mcnemar", "paired_auc", "paired_difference", "sign_flip_p"]

PERMUTATIONS = 9_999  # random sign flips of paired_difference's test above 13 documents (2^13 = 8,192 exact)


def sign_flip_p(d: np.ndarray, seed: int = 0, flips: int = PERMUTATIONS) -> float:
    """Two-sided p of the paired sign-flip permutation test of mean(d): under "no difference" each document's
    difference is as likely negated. Every one of the 2^n flips where there are at most `flips`, else `flips`
    random ones (seeded; p = (k + 1) / (flips + 1) per tail, as scipy.stats.permutation_test counts); p is
    twice the smaller tail, at most 1. Chunks bound memory at any number of documents."""
    d = np.asarray(d, dtype=np.float64)
    n, obs = d.size, float(d.mean())
    # ties within rounding count as ties (scipy's gamma), scaled by the values summed, not by their mean
    tol = 1e-12 * max(1.0, float(np.abs(d).max()))
    le = ge = 0
    exact = n < 63 and 2 ** n <= flips
    total = 2 ** n if exact else flips
    rng = np.random.default_rng(seed)
    chunk = max(1, 4_000_000 // n)
    for start in range(0, total, chunk):
        k = min(chunk, total - start)
        if exact:
            bits = (np.arange(start, start + k)[:, None] >> np.arange(n)) & 1
        else:
            bits = rng.integers(0, 2, (k, n))
        null = (1 - 2 * bits) @ d / n
        le += int((null <= obs + tol).sum())
        ge += int((null >= obs - tol).sum())
    if exact:
        return float(min(1.0, 2 * min(le, ge) / total))
    return float(min(1.0, 2 * (min(le, ge) + 1) / (total + 1)))


def _pair(a: Any, b: Any, names: tuple[str, str]) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(a, dtype=np.float64).ravel()
    y = np.asarray(b, dtype=np.float64).ravel()
    if x.size != y.size:
        raise fail(names[1], f"<{y.size} values>", f"pass one value per document of {names[0]} ({x.size}), "
                   "in the same document order")
    if x.size == 0:
        raise fail(names[0], "[]", "pass at least one document's value")
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise fail(names[0] if not np.isfinite(x).all() else names[1], "non-finite",
                   "every value must be a finite number; drop the documents without one")
    return x, y


def _check_resampling(resamples: Any, seed: Any, confidence: Any) -> None:
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        raise fail("resamples", resamples, "pass an integer >= 1, e.g. 1000")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise fail("seed", seed, "pass an integer seed >= 0, e.g. 0")
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0 < confidence < 1:
        raise fail("confidence", confidence, "pass a level in (0, 1), e.g. 0.95")


def mcnemar(a: Sequence[bool], b: Sequence[bool]) -> dict[str, Any]:
    """Exact McNemar test of two models' yes/no answers on the same documents, in the same order.

    {"n", "rate_a", "rate_b", "diff": rate_a - rate_b, "a_only": documents only `a` gets right,
    "b_only", "p_value"}: p is the two-sided exact binomial test of a_only out of a_only + b_only at 1/2
    (1.0 when no document is discordant: the data cannot tell the models apart)."""
    from scipy.stats import binomtest  # deferred: scipy.stats costs ~0.3 s; only paired reports need it

    x, y = _pair(a, b, ("a", "b"))
    if not np.isin(x, (0.0, 1.0)).all() or not np.isin(y, (0.0, 1.0)).all():
        raise fail("a" if not np.isin(x, (0.0, 1.0)).all() else "b", "non-binary",
                   "pass one yes/no (bool or 0/1) per document, e.g. its exact match")
    a_only = int(((x == 1) & (y == 0)).sum())
    b_only = int(((x == 0) & (y == 1)).sum())
    discordant = a_only + b_only
    p = float(binomtest(a_only, discordant, 0.5).pvalue) if discordant else 1.0
    return {"n": int(x.size), "rate_a": float(x.mean()), "rate_b": float(y.mean()),
            "diff": float(x.mean() - y.mean()), "a_only": a_only, "b_only": b_only, "p_value": p}


def paired_difference(a: Sequence[float], b: Sequence[float], *, resamples: int = 1000, seed: int = 0,
                      confidence: float = 0.95) -> dict[str, Any]:
    """Mean of a - b over documents (same order) with its percentile bootstrap interval and the two-sided
    p of the paired sign-flip permutation test of that mean (`sign_flip_p`: every flip when there are at
    most PERMUTATIONS of them, else PERMUTATIONS random ones, seeded). The interval and the p are about the
    same statistic, the mean; a difference of 0 flips to itself (p = 1.0 when every difference is 0).

    {"n", "mean_a", "mean_b", "diff", "ci": [lo, hi], "p_value"}."""
    x, y = _pair(a, b, ("a", "b"))
    _check_resampling(resamples, seed, confidence)
    d = x - y
    rng = np.random.default_rng(seed)
    chunk = max(1, min(resamples, 4_000_000 // d.size))
    means = np.concatenate([d[rng.integers(0, d.size, (min(chunk, resamples - s), d.size))].mean(axis=1)
                            for s in range(0, resamples, chunk)])
    tail = 100 * (1 - confidence) / 2
    lo, hi = (float(v) for v in np.percentile(means, [tail, 100 - tail]))
    p = 1.0
    if np.any(d != 0):
        p = sign_flip_p(d, seed)
    return {"n": int(d.size), "mean_a": float(x.mean()), "mean_b": float(y.mean()), "diff": float(d.mean()),
            "ci": [lo, hi], "p_value": p}


def paired_auc(members_a: Sequence[float], nonmembers_a: Sequence[float], members_b: Sequence[float],
               nonmembers_b: Sequence[float], *, resamples: int = 1000, seed: int = 0,
               confidence: float = 0.95) -> dict[str, Any]:
    """AUC(a) - AUC(b) of two models' membership scores on the same members and non-members (same orders).

    Each resample draws members and non-members with replacement (each class keeps its size) and scores
    both models on that one draw, so the interval is of the difference on shared documents. p: two-sided,
    from z = diff / sd of the resampled differences (normal), as pROC's bootstrap test; where the resampled
    differences do not vary, 1.0 if the difference is 0 (the models rank every pair alike), else 2 over the
    number of ways to split these documents into members and non-members (every resample shows the same
    difference, e.g. a perfect attack against a constant score: as sure as sets this size can make it).

    {"members", "nonmembers", "auc_a", "auc_b", "diff", "ci": [lo, hi], "p_value"}."""
    pos_a, pos_b = _pair(members_a, members_b, ("members_a", "members_b"))
    neg_a, neg_b = _pair(nonmembers_a, nonmembers_b, ("nonmembers_a", "nonmembers_b"))
    _check_resampling(resamples, seed, confidence)
    auc_a = roc_metrics(pos_a, neg_a)["auc"]
    auc_b = roc_metrics(pos_b, neg_b)["auc"]
    rng = np.random.default_rng(seed)
    chunk = max(1, min(resamples, 4_000_000 // (pos_a.size + neg_a.size)))
    deltas = []
    for start in range(0, resamples, chunk):
        n = min(chunk, resamples - start)
        mi, ni = rng.integers(0, pos_a.size, (n, pos_a.size)), rng.integers(0, neg_a.size, (n, neg_a.size))
        deltas.append(roc_on_resamples(pos_a, neg_a, mi, ni)[0] - roc_on_resamples(pos_b, neg_b, mi, ni)[0])
    delta = np.concatenate(deltas)
    tail = 100 * (1 - confidence) / 2
    lo, hi = (float(v) for v in np.percentile(delta, [tail, 100 - tail]))
    diff = auc_a - auc_b
    sd = float(delta.std(ddof=1)) if delta.size > 1 else 0.0
    if sd > 0:
        p = math.erfc(abs(diff) / sd / math.sqrt(2))  # 2 * (1 - Phi(|z|))
    else:  # never varies: no z; the smallest p any relabelling of these sets could give (none for 0)
        p = 1.0 if diff == 0 else min(1.0, 2 / math.comb(pos_a.size + neg_a.size, pos_a.size))
    return {"members": int(pos_a.size), "nonmembers": int(neg_a.size), "auc_a": auc_a, "auc_b": auc_b,
            "diff": diff, "ci": [lo, hi], "p_value": float(p)}


def adjust(p_values: Sequence[float]) -> list[float]:
    """Benjamini-Hochberg adjusted p-values (scipy.stats.false_discovery_control), in the given order: a
    report that runs many tests marks the ones whose adjusted p is below its level."""
    from scipy.stats import false_discovery_control  # deferred: scipy.stats, as in mcnemar

    if not len(p_values):
        return []
    return [float(v) for v in false_discovery_control(np.asarray(p_values, dtype=np.float64))]


def format_test(test: dict[str, Any] | None, fmt: str = "{:+.3f}", adjusted: float | None = None,
                level: float = 0.05) -> str:
    """A report cell: '+0.120 [+0.050, +0.190] p=0.003*' ('*': the adjusted p, when given, else p, is below
    `level`); an exact McNemar test shows its discordant counts instead of an interval."""
    if not test:
        return ""
    p = test["p_value"]
    star = "*" if (adjusted if adjusted is not None else p) < level else ""
    p_text = f"p={p:.2g}"
    if "a_only" in test:
        return f"{fmt.format(test['diff'])} ({test['a_only']} vs {test['b_only']}) {p_text}{star}"
    lo, hi = test["ci"]
    return f"{fmt.format(test['diff'])} [{fmt.format(lo)}, {fmt.format(hi)}] {p_text}{star}"
