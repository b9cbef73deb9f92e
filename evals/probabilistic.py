"""Extraction beyond greedy: (n, p)-discoverable extraction at several offsets, one forward per window.

For each document and each offset o, the window is doc[o : o + P + S]: the P-token prefix starting
o tokens into the document and the S-token suffix after it (o = 0 is the usual document-start probe;
verbatim recall is known to fall for prefixes away from the start of a context). One teacher-forced
forward per window (evals/scan.py) gives greedy exact match and, per decoding scheme
(evals/sampling.py), log p_z = log P(the scheme emits exactly the suffix | the prefix). A window is
(n, p)-extractable when 1 - (1 - p_z)^n >= p (Hayes et al. 2024): a user sampling n times gets the
suffix verbatim with probability at least p. Documents shorter than o + P + S are left out at that
offset (each offset's `docs` says how many were scored).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from axonn.grid import ProcessGrid
from evals.sampling import Scheme, np_summary
from evals.scan import score_windows
from evals.scoring import Scorer
from memorize_core import fail


def check_windows(documents: Sequence[Sequence[int]], offsets: Sequence[int], prefix_len: int,
                  suffix_len: int, batch_size: int, doc_ids: Sequence | None) -> tuple[list[int], list[Any]]:
    """(the sorted distinct offsets, one id per document) of a per-window evaluation; ConfigError naming
    the bad argument."""
    offs = _check(offsets, prefix_len, suffix_len, batch_size)
    ids = list(range(len(documents))) if doc_ids is None else list(doc_ids)
    if len(ids) != len(documents):
        raise fail("doc_ids", f"<{len(ids)} ids>", f"pass one id per document ({len(documents)})")
    return offs, ids


def _check(offsets: Sequence[int], prefix_len: int, suffix_len: int, batch_size: int) -> list[int]:
    for name, v in (("prefix_len", prefix_len), ("suffix_len", suffix_len), ("batch_size", batch_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise fail(name, v, "pass an integer >= 1")
    if not offsets:
        raise fail("offsets", list(offsets), "pass at least one offset, e.g. [0, 16, 32]")
    for i, o in enumerate(offsets):
        if isinstance(o, bool) or not isinstance(o, int) or o < 0:
            raise fail(f"offsets[{i}]", o, "an offset is a number of tokens >= 0 into the document")
    return sorted(set(offsets))


def sampled_extraction(model: torch.nn.Module, documents: Sequence[Sequence[int]], *, prefix_len: int,
                       suffix_len: int, schemes: Sequence[Scheme], offsets: Sequence[int] = (0,),
                       ns: Sequence[int] = (1, 10, 100, 1000), p: float = 0.5, batch_size: int = 32,
                       doc_ids: Sequence | None = None, grid: ProcessGrid | None = None) -> dict[str, Any]:
    """Per offset: greedy exact-match rate, the (n, p) summary per scheme (evals.sampling.np_summary, the
    greedy row included) and each scored window's log p_z; call on every rank of `grid`.

    Returns {"prefix", "suffix", "schemes", "offsets": {"0": {"docs", "exact_match_rate", "np", "rows"}}}
    where rows are {"doc", "logpz": {"greedy": ..., scheme name: ...}} (JSON floats: -inf as None)."""
    offs, ids = check_windows(documents, offsets, prefix_len, suffix_len, batch_size, doc_ids)
    sc = Scorer(model, grid)
    width = prefix_len + suffix_len
    out: dict[str, Any] = {"prefix": prefix_len, "suffix": suffix_len, "schemes": [s.name for s in schemes],
                           "offsets": {}}
    for o in offs:
        keep = [i for i, d in enumerate(documents) if len(d) >= o + width]
        cols: dict[str, list[np.ndarray]] = {}
        for b in range(0, len(keep), batch_size):
            chunk = keep[b:b + batch_size]
            rows = [[int(t) for t in documents[i][o:o + width]] for i in chunk]
            windows = torch.tensor(rows, dtype=torch.long)
            scores = score_windows(model, windows, prefix_len, schemes=schemes, scorer=sc)
            for key, v in scores.items():
                if key == "exact_match" or key.startswith("logpz"):
                    cols.setdefault(key, []).append(np.asarray(v))
        got = {k: np.concatenate(v) for k, v in cols.items()}
        em = got.get("exact_match", np.zeros(0, dtype=bool))
        by_scheme = {s.name: got.get(f"logpz/{s.name}", np.zeros(0)) for s in schemes}
        rows = [{"doc": ids[i], "logpz": {"greedy": _finite(0.0 if em[j] else -np.inf),
                                         **{n: _finite(v[j]) for n, v in by_scheme.items()}}}
                for j, i in enumerate(keep)]
        out["offsets"][str(o)] = {"docs": len(keep),
                                  "exact_match_rate": float(em.mean()) if len(keep) else None,
                                  "np": (np_summary(by_scheme, ns, p, greedy=em.astype(bool))
                                         if keep else None),
                                  "rows": rows}
    return out


def check_pairs(prompts: Sequence[Sequence[int]], targets: Sequence[Sequence[int]],
                doc_ids: Sequence | None) -> tuple[list[tuple[list[int], list[int]]], list[Any]]:
    """(the (prompt, target) pairs as int lists, one id per pair) of a per-pair evaluation; ConfigError
    naming the bad argument (one target and one id per prompt, a token in each)."""
    if len(prompts) != len(targets):
        raise fail("targets", f"<{len(targets)} targets>",
                   f"pass one target per prompt ({len(prompts)} prompts)")
    ids = list(range(len(prompts))) if doc_ids is None else list(doc_ids)
    if len(ids) != len(prompts):
        raise fail("doc_ids", f"<{len(ids)} ids>", f"pass one id per pair ({len(prompts)})")
    pairs = [([int(t) for t in a], [int(t) for t in b]) for a, b in zip(prompts, targets)]
    for i, (a, b) in enumerate(pairs):
        if not a or not b:
            raise fail(f"{'prompts' if not a else 'targets'}[{i}]", [],
                       "every prompt and target needs at least one token")
    return pairs, ids


def length_groups(pairs: Sequence[tuple[list[int], list[int]]], which: Sequence[int]
                  ) -> list[tuple[int, list[int]]]:
    """The pairs `which` grouped by (prompt, target) lengths, as (prompt length, indices): each group is
    one unpadded batch of windows; sorted, so every rank walks them in the same order."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i in which:
        groups.setdefault((len(pairs[i][0]), len(pairs[i][1])), []).append(i)
    return [(plen, idx) for (plen, _), idx in sorted(groups.items())]


def sampled_pairs(model: torch.nn.Module, prompts: Sequence[Sequence[int]],
                  targets: Sequence[Sequence[int]], *, schemes: Sequence[Scheme],
                  ns: Sequence[int] = (1, 10, 100, 1000), p: float = 0.5, batch_size: int = 32,
                  doc_ids: Sequence | None = None, grid: ProcessGrid | None = None) -> dict[str, Any]:
    """sampled_extraction for (prompt, target) pairs of any lengths (chat data: each answer from its
    prompt): greedy exact match and each scheme's log p_z of the target given the whole prompt, one
    teacher-forced forward per pair (pairs of equal lengths batched together, no padding). Returns
    sampled_extraction's shape with one offset, "0" (from the prompt), "prefix": "prompt" and "suffix" the
    longest target's length; call on every rank of `grid`."""
    _check([0], 1, 1, batch_size)
    pairs, ids = check_pairs(prompts, targets, doc_ids)
    sc = Scorer(model, grid)
    em = np.zeros(len(pairs), dtype=bool)
    logpz = {sch.name: np.zeros(len(pairs)) for sch in schemes}
    for plen, idx in length_groups(pairs, range(len(pairs))):
        for b in range(0, len(idx), batch_size):
            chunk = idx[b:b + batch_size]
            windows = torch.tensor([pairs[i][0] + pairs[i][1] for i in chunk], dtype=torch.long)
            got = score_windows(model, windows, plen, schemes=schemes, scorer=sc)
            em[chunk] = got["exact_match"]
            for name, v in logpz.items():
                v[chunk] = got[f"logpz/{name}"]
    rows = [{"doc": ids[i], "logpz": {"greedy": _finite(0.0 if em[i] else -np.inf),
                                      **{n: _finite(v[i]) for n, v in logpz.items()}}}
            for i in range(len(pairs))]
    return {"prefix": "prompt", "suffix": max((len(b) for _, b in pairs), default=0),  # the longest target
            "schemes": [s.name for s in schemes],
            "offsets": {"0": {"docs": len(pairs), "exact_match_rate": float(em.mean()) if pairs else None,
                              "np": np_summary(logpz, ns, p, greedy=em) if pairs else None, "rows": rows}}}


def _finite(x: float) -> float | None:
    """A log-probability for JSON: -inf (the scheme can never emit the suffix) as None."""
    return float(x) if np.isfinite(x) else None


def np_rates(result: dict[str, Any], offset: int = 0, n: int | None = None) -> dict[str, float]:
    """scheme -> fraction (n, p)-extractable at `offset` (n: the largest computed), of sampled_extraction."""
    at = result["offsets"].get(str(offset))
    if not at or not at["np"]:
        return {}
    summary = at["np"]
    n = n if n is not None else max(summary["ns"])
    return {name: per[f"n={n}"]["fraction"] for name, per in summary["schemes"].items()}


def split_rows(got: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A per-window result (sampled_extraction's, evals.near_verbatim's) as (the summary without rows, one
    row per scored (offset, document) with its offset first), the rows as sampled.jsonl and
    near_verbatim.jsonl hold them."""
    summary = {**got, "offsets": {o: {k: v for k, v in at.items() if k != "rows"}
                                  for o, at in got["offsets"].items()}}
    rows = [{"offset": int(o), **r} for o, at in got["offsets"].items() for r in at["rows"]]
    return summary, rows


__all__ = ["check_pairs", "check_windows", "length_groups", "np_rates", "sampled_extraction", "sampled_pairs",
           "split_rows"]

