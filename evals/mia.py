"""Membership inference scores (MIMIR-style) and their ROC metrics.

Sign convention: every score is oriented so that HIGHER means MORE LIKELY A MEMBER (a training
sequence). Where the usual statistic is "lower = member" (a loss), the score is its negation:
  loss             -mean token NLL                     (= mean token log-prob)
  zlib             -NLL / len(zlib.compress(text))     (MIMIR's NLL-to-zlib-entropy ratio, negated)
  min_k            mean of the lowest k-fraction of token log-probs
  min_k_plus_plus  mean of the lowest k-fraction of (log p(x_t) - mu_t) / sigma_t, where mu_t and
                   sigma_t^2 are the mean and variance of log p(z) for z ~ p(. | x_<t) (Min-K%++)
  ref_ratio        ref-model NLL - target-model NLL   (target loss minus reference loss, negated)
NLL is the mean over the scored tokens 1..L-1 (token 0 has no context). "Lowest k-fraction" is
the int(k * n) smallest of n values, at least one.
"""
from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from sklearn.metrics import roc_auc_score, roc_curve
from tqdm.auto import tqdm

from axonn.grid import ProcessGrid
from evals._model import evaluating, pad_right, scored_seqs
from evals.metrics import ids_text
from evals.scoring import Scorer
from memorize_core import fail

METHODS = ("loss", "zlib", "min_k", "min_k_plus_plus", "ref_ratio")


def min_k_mean(values: np.ndarray | Sequence[float], k: float = 0.2) -> float:
    """Mean of the lowest int(k*n) values (at least one): the Min-K% statistic."""
    v = np.sort(np.asarray(values, dtype=np.float64))
    if v.size == 0:
        raise fail("values", "[]", "pass at least one token score")
    count = max(1, int(v.size * k + 1e-9))  # epsilon: 0.29*100 is 28.999... in floating point
    return float(v[:count].mean())


def _batch_stats(sc: Scorer, batch: list[list[int]],
                 full: bool) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """Per sequence: token log-probs [L-1] and, if full, Min-K%++ z-scores [L-1]."""
    ids, mask = pad_right(batch)
    ids, mask = ids.to(sc.device), mask.to(sc.device)
    tok, z = sc.token_stats(sc.logits(ids, mask)[:, :-1], ids[:, 1:], moments=full)
    tok = tok.cpu().numpy()
    z = None if z is None else z.cpu().numpy()
    return [(tok[i, :len(s) - 1].astype(np.float64),
             None if z is None else z[i, :len(s) - 1].astype(np.float64)) for i, s in enumerate(batch)]


def _per_sequence(model: torch.nn.Module, seqs: list[list[int]], batch_size: int, full: bool,
                  grid: ProcessGrid | None = None,
                  progress: str | None = None) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """_batch_stats of every sequence, each batch shard scoring its share; input order, every rank.
    `progress` names a tqdm bar (sequences/s) on the main rank."""
    sc = Scorer(model, grid)
    # Sorting by length keeps padding (wasted compute) small; every shard gets a spread of lengths.
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    rows = [order[r] for r in sc.rows(len(order))]
    mine: list = []
    bar = tqdm(total=len(rows), desc=progress, unit="seq", disable=not (progress and sc.is_main))
    with evaluating(model), bar:
        for b in range(0, len(rows), batch_size):
            mine += _batch_stats(sc, [seqs[i] for i in rows[b:b + batch_size]], full)
            bar.update(len(rows[b:b + batch_size]))
        return sc.collect(rows, mine, len(seqs))


def score_sequences(model: torch.nn.Module, seqs: Sequence[Sequence[int]], *, tokenizer: Any = None,
                    ref_model: torch.nn.Module | None = None, k: float = 0.2,
                    batch_size: int = 8, grid: ProcessGrid | None = None, progress: str | None = None,
                    starts: Sequence[int] | None = None) -> dict[str, np.ndarray]:
    """Per-sequence membership scores (higher = member) for each method; ref_ratio needs ref_model.

    A sharded model (and reference) is scored on its grid, on every rank (evals/scoring.py). zlib
    compresses `tokenizer.decode(ids)` (UTF-8) when a tokenizer is given, else the space-joined
    ids. The reference model must share the target model's tokenizer (it scores the same ids).

    `starts` (one per sequence): score only tokens start..L-1 of each, in the context of all before
    them: a chat response given its prompt, the tokens a fine-tune trained on. Every statistic (and
    zlib's text) then reads those tokens only. None = every token but the first (zlib: the whole text).
    """
    seqs = scored_seqs(seqs)
    if isinstance(k, bool) or not isinstance(k, (int, float)) or not 0 < k <= 1:
        raise fail("k", k, "pass a fraction in (0, 1], e.g. 0.2")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise fail("batch_size", batch_size, "pass an integer >= 1")
    first = _starts(seqs, starts)
    stats = [(lp[s - 1:], z[s - 1:]) for (lp, z), s in
             zip(_per_sequence(model, seqs, batch_size, True, grid, progress), first)]
    nll = np.array([-lp.mean() for lp, _ in stats])
    texts = seqs if starts is None else [s[f:] for s, f in zip(seqs, first)]  # without starts: the whole text
    zlen = np.array([len(zlib.compress((tokenizer.decode(t) if tokenizer is not None
                                        else ids_text(t)).encode("utf-8"))) for t in texts])
    scores = {
        "loss": -nll,
        "zlib": -nll / zlen,
        "min_k": np.array([min_k_mean(lp, k) for lp, _ in stats]),
        "min_k_plus_plus": np.array([min_k_mean(z, k) for _, z in stats]),
    }
    if ref_model is not None:
        ref = _per_sequence(ref_model, seqs, batch_size, False, grid, progress and f"{progress} (reference)")
        scores["ref_ratio"] = np.array([-lp[f - 1:].mean() for (lp, _), f in zip(ref, first)]) - nll
    return scores


def _starts(seqs: list[list[int]], starts: Sequence[int] | None) -> list[int]:
    """score_sequences' first scored token of each sequence, checked: 1 <= start < len."""
    if starts is None:
        return [1] * len(seqs)
    out = [int(v) for v in starts]
    if len(out) != len(seqs):
        raise fail("starts", f"<{len(out)} starts>", f"pass one start per sequence ({len(seqs)} sequences)")
    for i, (v, s) in enumerate(zip(out, seqs)):
        if not 1 <= v < len(s):
            raise fail(f"starts[{i}]", v, f"need 1 <= start < {len(s)} (the sequence's length): at least one "
                       "scored token, and token 0 has no context")
    return out


def _tpr_at(fpr: np.ndarray, tpr: np.ndarray, target: float) -> float:
    ok = fpr <= target + 1e-12
    return float(tpr[ok].max()) if ok.any() else 0.0


def roc_metrics(member_scores: np.ndarray | Sequence[float],
                nonmember_scores: np.ndarray | Sequence[float]) -> dict[str, float]:
    """ROC AUC and the largest TPR with FPR <= 1% and <= 0.1% (members are the positive class)."""
    pos = np.asarray(member_scores, dtype=np.float64).ravel()
    neg = np.asarray(nonmember_scores, dtype=np.float64).ravel()
    for name, arr in (("member_scores", pos), ("nonmember_scores", neg)):
        if arr.size == 0:
            raise fail(name, "[]", "pass at least one score for each class")
        if not np.isfinite(arr).all():
            raise fail(name, "non-finite", "scores must be finite numbers; drop NaN/inf entries")
    y = np.r_[np.ones(pos.size), np.zeros(neg.size)]
    s = np.r_[pos, neg]
    # drop_intermediate=False keeps every threshold so the TPR@FPR lookup sees all points.
    fpr, tpr, _ = roc_curve(y, s, drop_intermediate=False)
    return {
        "auc": float(roc_auc_score(y, s)),
        "tpr_at_1pct_fpr": _tpr_at(fpr, tpr, 0.01),
        "tpr_at_0.1pct_fpr": _tpr_at(fpr, tpr, 0.001),
    }


def roc_on_resamples(member_scores: np.ndarray | Sequence[float],
                     nonmember_scores: np.ndarray | Sequence[float], member_idx: np.ndarray,
                     nonmember_idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ROC AUC and TPR@1%FPR of each resample: row b scores members[member_idx[b]]
    vs nonmembers[nonmember_idx[b]]."""
    pos = np.asarray(member_scores, dtype=np.float64).ravel()
    neg = np.asarray(nonmember_scores, dtype=np.float64).ravel()
    # Rank statistic on the shared sorted unique values: a resample is just a histogram over them,
    # so B resamples cost B*U work instead of B sklearn calls.
    values, inverse = np.unique(np.r_[pos, neg], return_inverse=True)
    u = values.size
    pos_bin, neg_bin = inverse[:pos.size], inverse[pos.size:]
    b = member_idx.shape[0]
    rows = np.arange(b)[:, None] * u
    hp = np.bincount((rows + pos_bin[member_idx]).ravel(), minlength=b * u).reshape(b, u).astype(np.float64)
    hn = np.bincount((rows + neg_bin[nonmember_idx]).ravel(),
                     minlength=b * u).reshape(b, u).astype(np.float64)
    n_p, n_n = member_idx.shape[1], nonmember_idx.shape[1]
    # Counts at or above each value (score >= threshold is called a member), as roc_curve does.
    pos_ge = np.cumsum(hp[:, ::-1], axis=1)[:, ::-1]
    neg_ge = np.cumsum(hn[:, ::-1], axis=1)[:, ::-1]
    # P(member > non-member) + P(tie)/2: for each non-member value, members strictly above + half the ties.
    above = pos_ge - hp
    auc = (hn * (above + 0.5 * hp)).sum(axis=1) / (n_p * n_n)
    fpr, tpr = neg_ge / n_n, pos_ge / n_p
    tpr1 = np.where(fpr <= 0.01 + 1e-12, tpr, 0.0).max(axis=1)
    return auc, tpr1


def bootstrap_ci(member_scores: np.ndarray | Sequence[float], nonmember_scores: np.ndarray | Sequence[float],
                 *, resamples: int = 1000, seed: int = 0,
                 confidence: float = 0.95) -> dict[str, list[float]]:
    """Percentile bootstrap CIs of ROC AUC and TPR@1%FPR (members, non-members resampled separately)."""
    roc_metrics(member_scores, nonmember_scores)  # the same input checks
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        raise fail("resamples", resamples, "pass an integer >= 1, e.g. 1000")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise fail("seed", seed, "pass an integer seed, e.g. 0")
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0 < confidence < 1:
        raise fail("confidence", confidence, "pass a level in (0, 1), e.g. 0.95")
    pos = np.asarray(member_scores, dtype=np.float64).ravel()
    neg = np.asarray(nonmember_scores, dtype=np.float64).ravel()
    rng = np.random.default_rng(seed)
    # Stratified: each class keeps its size, so every resample has the original class balance.
    # Chunks bound memory at large score counts; their size depends only on the input sizes.
    chunk = max(1, min(resamples, 4_000_000 // (pos.size + neg.size)))
    aucs, tprs = [], []
    for start in range(0, resamples, chunk):
        b = min(chunk, resamples - start)
        a, t = roc_on_resamples(pos, neg, rng.integers(0, pos.size, (b, pos.size)),
                                rng.integers(0, neg.size, (b, neg.size)))
        aucs.append(a)
        tprs.append(t)
    tail = 100 * (1 - confidence) / 2
    q = [tail, 100 - tail]
    return {"auc_ci": [float(x) for x in np.percentile(np.concatenate(aucs), q)],
            "tpr_at_1pct_fpr_ci": [float(x) for x in np.percentile(np.concatenate(tprs), q)]}


def _check_bootstrap(bootstrap: Any) -> None:
    if isinstance(bootstrap, bool) or not isinstance(bootstrap, int) or bootstrap < 0:
        raise fail("bootstrap", bootstrap, "pass the number of resamples, an integer >= 0 (0 = none)")


def membership_inference(model: torch.nn.Module, members: Sequence[Sequence[int]],
                         nonmembers: Sequence[Sequence[int]], *, tokenizer: Any = None,
                         ref_model: torch.nn.Module | None = None, k: float = 0.2,
                         batch_size: int = 8, bootstrap: int = 0, seed: int = 0,
                         grid: ProcessGrid | None = None,
                         progress: bool = False) -> dict[str, dict[str, Any]]:
    """Score members and non-members with every method: {method: roc_metrics (+ bootstrap CIs)}.

    bootstrap=B > 0 adds `auc_ci` and `tpr_at_1pct_fpr_ci` (95% percentile intervals of B
    stratified resamples). Every method sees the same resamples (same seed), so their intervals
    are paired and comparable.
    """
    if not members or not nonmembers:
        raise fail("members/nonmembers", f"{len(members)}/{len(nonmembers)} sequences",
                   "pass at least one member and one non-member sequence")
    _check_bootstrap(bootstrap)
    scores = score_both(model, members, nonmembers, tokenizer=tokenizer, ref_model=ref_model, k=k,
                        batch_size=batch_size, grid=grid, progress=progress)
    return mia_metrics(*scores, bootstrap=bootstrap, seed=seed)


def score_both(model: torch.nn.Module, members: Sequence[Sequence[int]], nonmembers: Sequence[Sequence[int]],
               *, progress: bool = False, starts: tuple[Sequence[int], Sequence[int]] | None = None,
               **kw: Any) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """score_sequences of the members and of the non-members (`kw` its keywords; bars named for each;
    `starts` the members' and the non-members' first scored tokens, or None)."""
    first = starts or (None, None)
    return (score_sequences(model, members, **kw, starts=first[0],
                            progress="MIA members" if progress else None),
            score_sequences(model, nonmembers, **kw, starts=first[1],
                            progress="MIA non-members" if progress else None))


def score_rows(member_ids: Sequence[Any], nonmember_ids: Sequence[Any], member_scores: dict[str, np.ndarray],
               nonmember_scores: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    """One row per scored document, members first: {"id", "member", <method>: score} (mia.jsonl's rows)."""
    sides = ((member_ids, True, member_scores), (nonmember_ids, False, nonmember_scores))
    return [{"id": doc, "member": member, **{k: float(v[i]) for k, v in got.items()}}
            for ids, member, got in sides for i, doc in enumerate(ids)]


def mia_metrics(member_scores: dict[str, np.ndarray], nonmember_scores: dict[str, np.ndarray], *,
                bootstrap: int = 0, seed: int = 0) -> dict[str, dict[str, Any]]:
    """{method: roc_metrics (+ bootstrap CIs)} of per-method scores (score_sequences' output for each
    class); every method sees the same resamples (same seed), so their intervals are paired."""
    _check_bootstrap(bootstrap)
    if set(member_scores) != set(nonmember_scores):
        raise fail("nonmember_scores", sorted(nonmember_scores), f"must hold the members' methods, "
                   f"{sorted(member_scores)}")
    out: dict[str, dict[str, Any]] = {}
    for method, m in member_scores.items():
        n = nonmember_scores[method]
        out[method] = roc_metrics(m, n)
        if bootstrap:
            out[method].update(bootstrap_ci(m, n, resamples=bootstrap, seed=seed))
    return out
