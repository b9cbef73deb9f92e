"""Exposure of an inserted canary (Carlini et al. 2019, "The Secret Sharer").

Exposure = log2|R| - log2 rank(canary), where R is the space of possible secrets and the rank
orders the canary among all of R by the model's log-perplexity (rank 1 = lowest). Maximum
exposure log2|R| means the canary is the model's single most likely secret.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Hashable, Sequence

import numpy as np
import torch
from scipy import stats

from axonn.grid import ProcessGrid
from evals._model import pad_right
from evals.perplexity import prefix_continuation_logprobs, sequence_logprobs
from memorize_core import fail

Span = tuple[int, int]


def exposure_rank(canary_logppl: float, candidate_logppls: np.ndarray | Sequence[float],
                  space_size: int) -> float:
    """Exposure log2(space_size) - log2(rank) from the canary's and other candidates' log-perplexities.

    `candidate_logppls` are the other secrets of the space, the canary excluded. With all
    space_size-1 of them the rank is exact: 1 + #candidates ranked at or ahead of the canary.
    With a uniform sample of n < space_size-1 of them the count ahead is scaled by
    (space_size-1)/n. Ties count as ahead of the canary, so ties never inflate exposure.
    """
    c = np.asarray(candidate_logppls, dtype=np.float64).ravel()
    if c.size == 0:
        raise fail("candidate_logppls", "[]", "pass the log-perplexities of at least one other secret")
    if not np.isfinite(c).all() or not math.isfinite(canary_logppl):
        raise fail("candidate_logppls", "non-finite", "log-perplexities must be finite numbers")
    if isinstance(space_size, bool) or not isinstance(space_size, int) or space_size < c.size + 1:
        raise fail("space_size", space_size, f"must be an integer >= len(candidates)+1 = {c.size + 1}; "
                   "candidates must exclude the canary itself")
    ahead = int((c <= canary_logppl).sum())
    rank = 1.0 + ahead * (space_size - 1) / c.size
    return math.log2(space_size) - math.log2(rank)


def group_exposure(logppls: np.ndarray | Sequence[float], keys: Sequence[Hashable], target: int
                   ) -> tuple[float, int, int]:
    """(exposure, rank, groups) of part of a secret: the candidates grouped by `keys` (e.g. their tokens at
    the positions a training loss kept), a group's probability the sum of its members' 2^-logppl, and
    the rank of candidate `target`'s group among all groups (ties ahead, as exposure_rank counts them).

    The attacker's best guess of that part marginalises over the rest, so this is log2(groups) - log2(rank).
    """
    lp = np.asarray(logppls, dtype=np.float64).ravel()
    if len(keys) != lp.size or lp.size == 0:
        raise fail("keys", f"<{len(keys)} keys>", f"pass one key per candidate ({lp.size} log-perplexities)")
    if not np.isfinite(lp).all():
        raise fail("logppls", "non-finite", "log-perplexities must be finite numbers")
    if not 0 <= target < lp.size:
        raise fail("target", target, f"pass a candidate index in [0, {lp.size})")
    members: dict[Hashable, list[float]] = {}
    for key, bits in zip(keys, lp):
        members.setdefault(key, []).append(-bits)
    group_lp = {key: float(np.logaddexp2.reduce(v)) for key, v in members.items()}
    mine = group_lp.pop(keys[target])
    rank = 1 + sum(v >= mine for v in group_lp.values())
    groups = len(group_lp) + 1
    return math.log2(groups) - math.log2(rank), rank, groups


def exposure_extrapolated(canary_logppl: float, sample_logppls: np.ndarray | Sequence[float]) -> float:
    """Exposure -log2 CDF(canary) under a skew-normal fitted to sampled candidates' log-perplexities.

    Useful when R is too large to enumerate (e.g. 9-digit secrets). Returns inf when the fitted
    CDF underflows (a canary far below every plausible candidate).
    """
    s = np.asarray(sample_logppls, dtype=np.float64).ravel()
    if s.size < 10:
        raise fail("sample_logppls", f"<{s.size} values>",
                   "pass at least 10 sampled candidates (thousands fit better)")
    if not np.isfinite(s).all():
        raise fail("sample_logppls", "non-finite", "log-perplexities must be finite numbers")
    a, loc, scale = stats.skewnorm.fit(s)
    log_cdf = float(stats.skewnorm.logcdf(canary_logppl, a, loc=loc, scale=scale))
    return -log_cdf / math.log(2.0)


def _spans(ids_list: list[list[int]], spans: Span | Sequence[Span] | None) -> list[Span]:
    if spans is None:
        out = [(1, len(s)) for s in ids_list]
    elif len(spans) == 2 and all(isinstance(v, numbers.Integral) for v in spans):
        out = [(int(spans[0]), int(spans[1]))] * len(ids_list)
    else:
        out = [(int(sp[0]), int(sp[1])) for sp in spans]
        if len(out) != len(ids_list):
            raise fail("spans", f"<{len(out)} spans>",
                       f"pass one (start, end) per sequence ({len(ids_list)} sequences)")
    for i, ((start, end), s) in enumerate(zip(out, ids_list)):
        if not 1 <= start < end <= len(s):
            raise fail(f"spans[{i}]", (start, end),
                       f"need 1 <= start < end <= {len(s)} (token 0 has no context to be scored from)")
    return out


def sequence_log_perplexity(model: torch.nn.Module, ids_list: Sequence[Sequence[int]], *,
                            spans: Span | Sequence[Span] | None = None,
                            batch_size: int = 64, grid: ProcessGrid | None = None) -> np.ndarray:
    """Per sequence, sum of -log2 p(x_t | x_<t) over token positions t in [start, end).

    `spans` picks the scored tokens: None scores every token but the first; one (start, end) pair
    applies to all sequences (e.g. the positions of the secret digits in "my pin is 1 2 3 4");
    a list gives one pair per sequence. Positions index the token list, so start >= 1. When every
    span starts at the same position after a prefix all sequences share (candidate secrets in one
    template), the prefix is scored once and only the span tokens run per sequence.
    """
    seqs = [[int(t) for t in s] for s in ids_list]
    if not seqs:
        raise fail("ids_list", "[]", "pass at least one token sequence")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise fail("batch_size", batch_size, "pass an integer >= 1")
    windows = _spans(seqs, spans)
    out = np.empty(len(seqs), dtype=np.float64)
    inv_ln2 = 1.0 / math.log(2.0)
    start = windows[0][0]
    if all(w[0] == start for w in windows) and all(s[:start] == seqs[0][:start] for s in seqs):
        # exposure's candidates: one template prefix, many secrets; the prefix runs once (KV cache)
        tails = [s[start:end] for s, (_, end) in zip(seqs, windows)]
        lps = prefix_continuation_logprobs(model, seqs[0][:start], tails, batch_size, grid=grid)
        return np.array([-lp.double().sum().item() * inv_ln2 for lp in lps], dtype=np.float64)
    for b in range(0, len(seqs), batch_size):
        ids, mask = pad_right(seqs[b:b + batch_size])
        lp = sequence_logprobs(model, ids, mask, grid=grid).double().numpy()
        for j, (start, end) in enumerate(windows[b:b + batch_size]):
            # lp[:, t-1] is the log-prob of token t.
            out[b + j] = -lp[j, start - 1:end - 1].sum() * inv_ln2
    return out
