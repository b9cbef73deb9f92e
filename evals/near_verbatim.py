"""Near-verbatim extraction: a lower bound of P(a sampling scheme emits the suffix with at most d changes |
prefix), from a beam search that never leaves that neighbourhood of the true suffix.

A copy with a word or two changed leaks a passage nearly as well as an exact one, and it is what a model
trained with goldfish loss (which never supervises some of a passage's tokens) would emit if it had
learned the rest. Under a decoding scheme (temperature, top-k, top-p: evals/sampling.py) the probability
that a sampled S-token continuation lies within distance d of the true suffix is a sum over the
~C(S, d)(V-1)^d sequences of that neighbourhood: too many to enumerate, and usually too small to estimate
by sampling. Following the idea of bounding near-verbatim risk with a decoding-constrained beam search
(Cooper et al. 2026), paths grow one token per step and are kept per number of changes: the verbatim
path always, and for each e = 1..d the `beams` likeliest paths with exactly e (1 + d * beams paths per
document). They are distinct sequences inside the neighbourhood, so the sum of their probabilities under
the scheme is a LOWER BOUND of the near-verbatim probability however narrow the beam; it is never below
p_z (the exact-copy probability), and a beam that holds the whole neighbourhood gives the exact
probability (tests check both, and against HF sampling). The bound at every d' <= d comes from the same
search (its paths with at most d' changes).

Two distances (`distance`):
- "hamming": tokens substituted in place. Each step a path takes the true token, or spends a change on
  one of the scheme's likeliest other tokens.
- "levenshtein": tokens substituted, inserted or deleted, between the S sampled tokens and the S-token
  suffix. A copy that drops (or adds) a word and then goes on verbatim is 2 edits away, but up to S
  substitutions away: a Hamming bound misses it. Each path carries its edit-distance row to every prefix
  of the suffix; its number of changes is the least distance any completion can reach (never decreasing,
  its exact edit distance at the end), and its candidates are the suffix tokens within d positions (the
  ones that keep it aligned) and the scheme's likeliest others, each token once. The Hamming
  neighbourhood lies inside this one, so with a beam that holds both the edit bound is the larger.

Read with Hayes et al.'s (n, p) test, a lower bound p_d makes 1 - (1 - p_d)^n >= p a conservative verdict.
Cost per scheme: S decode steps of 1 + d * beams paths per document through the KV cache (batched: on
SmolLM2 with 33 paths, 3-6x the greedy decode of the same documents per scheme).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from axonn.grid import ProcessGrid
from evals._model import evaluating
from evals.kv_cache import preallocated_cache
from evals.probabilistic import _finite, check_pairs, check_windows, length_groups
from evals.sampling import Scheme, candidate_logprobs, np_summary
from evals.scoring import Scorer
from memorize_core import NEAR_DISTANCES, fail

DEFAULT_BEAMS = 8


def _check_search(schemes: Sequence[Scheme], max_edits: int, beams: int, distance: str = "hamming") -> None:
    if not schemes:
        raise fail("schemes", list(schemes), "pass at least one sampling scheme, e.g. t=1.0 (greedy has "
                   "no near-verbatim mass: its one output is near the suffix or not)")
    if isinstance(max_edits, bool) or not isinstance(max_edits, int) or max_edits < 1:
        raise fail("max_edits", max_edits, "pass the largest number of changed tokens to count, >= 1")
    if isinstance(beams, bool) or not isinstance(beams, int) or beams < 1:
        raise fail("beams", beams, "pass the paths kept per number of changed tokens, >= 1, e.g. 8")
    if distance not in NEAR_DISTANCES:
        raise fail("distance", distance, "choose hamming (tokens substituted in place) or levenshtein "
                   "(tokens substituted, inserted or deleted)")


def _edit_rows(rows: torch.Tensor, cand: torch.Tensor, truth: torch.Tensor, length: int) -> torch.Tensor:
    """Levenshtein DP rows after appending each candidate: rows [N, S+1] hold D[j] = distance(the path's
    `length` tokens, truth[:j]); returns [N, K, S+1] for the K candidates [N, K] (truth [N, S]).
    D'[0] = length + 1; D'[j] = min(D[j-1] + (x != truth[j-1]), D[j] + 1, D'[j-1] + 1), the last term
    (a run of deletions) as a running minimum: D'[j] = j + min_{k <= j}(E[k] - k)."""
    n, k = cand.shape
    sub = (truth[:, None, :] != cand[:, :, None]).long()  # [N, K, S]
    step = torch.minimum(rows[:, None, :-1] + sub, rows[:, None, 1:] + 1)
    first = torch.full((n, k, 1), length + 1, dtype=rows.dtype, device=rows.device)
    e = torch.cat([first, step], dim=2)
    col = torch.arange(e.shape[2], device=rows.device)
    return torch.cummin(e - col, dim=2).values + col


def _edit_step(top: torch.Tensor, truth: torch.Tensor, rows: torch.Tensor, t: int, band: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One Levenshtein step for paths of t tokens: the candidates [N, K] (the suffix tokens at t + band,
    then the scheme's likeliest `top`), which to drop (a token already offered, so paths stay distinct,
    or a band slot outside the suffix), each candidate's edit rows [N, K, S+1] and its level [N, K]: the
    least edit distance a completion can reach (row + the length difference left, |j - (t + 1)|)."""
    s = truth.shape[1]
    at = t + band
    inside = (at >= 0) & (at < s)
    cand = torch.cat([truth[:, at.clamp(0, s - 1)], top], dim=1)
    ident = cand.clone()  # outside slots get unique negative ids: dropped, and never shadow a real token
    ident[:, :len(band)] = torch.where(inside, ident[:, :len(band)],
                                       -1 - torch.arange(len(band), device=cand.device))
    drop = (ident[:, :, None] == ident[:, None, :]).tril(-1).any(dim=2) | (ident < 0)
    new_rows = _edit_rows(rows, cand, truth, t)
    gap = (torch.arange(s + 1, device=cand.device) - (t + 1)).abs()
    return cand, drop, new_rows, (new_rows + gap).amin(dim=2)


def search(sc: Scorer, prefixes: torch.Tensor, targets: torch.Tensor, scheme: Scheme, max_edits: int,
           beams: int, tick: Callable[[int], Any] | None = None,
           distance: str = "hamming") -> dict[str, torch.Tensor]:
    """The constrained beam search over this rank's rows (inside `evaluating`; call on every Y rank).

    The paths are kept per number of changes: the verbatim one, and the `beams` likeliest with exactly e
    changes for each e = 1..max_edits (one beam for all would fill with paths that spent their changes
    early and cannot swap the one improbable token that comes later). Under `distance="levenshtein"` a
    path's number of changes is the least edit distance any completion of it can reach (its edit-distance
    row to every prefix of the suffix plus the length difference still to make up; at the last token,
    its edit distance to the suffix), which never decreases as the path grows; its candidates are the
    suffix tokens within max_edits positions of it (the ones that can keep it aligned) and the scheme's
    likeliest others, each token once.

    `tick(R)` is called after each suffix position (a progress bar's update).
    Returns {"bound": [R, max_edits + 1] float64 log lower bounds (column d: at most d changes),
    "tokens": [R, S] the likeliest path found, "edits": [R] its changes, "logp": [R] its log-prob}."""
    _check_search([scheme], max_edits, beams, distance)
    r, s = targets.shape
    dev = prefixes.device
    if r == 0 or s == 0:
        zero = torch.zeros(r, max_edits + 1, dtype=torch.float64, device=dev)
        none = torch.zeros(r, dtype=torch.long, device=dev)
        return {"bound": zero, "tokens": targets.clone(), "edits": none, "logp": zero[:, 0].clone()}
    lev = distance == "levenshtein"
    b = 1 + max_edits * beams  # paths per row: slot 0 verbatim, then `beams` per number of changes
    cache = preallocated_cache(sc.model, prefixes.shape[1] + s)
    logits, cache = sc.step(prefixes, cache)
    cache.batch_repeat_interleave(b)
    logits = logits[:, -1].float().repeat_interleave(b, dim=0)  # [R * B, V(/Y)]
    c = min(beams + 1, sc.vocab_size(logits))  # other tokens tried per path: at most `beams` survive
    score = torch.full((r, b), -math.inf, dtype=torch.float64, device=dev)
    score[:, 0] = 0.0  # the verbatim path; the others start empty
    edits = torch.zeros(r, b, dtype=torch.long, device=dev)
    seqs = torch.empty(r, b, 0, dtype=torch.long, device=dev)
    base = torch.arange(r, device=dev)[:, None]
    if lev:
        truth = targets.repeat_interleave(b, dim=0)  # [R * B, S]
        rows = torch.arange(s + 1, device=dev).expand(r * b, -1).contiguous()  # D[j] = j: nothing emitted
        # suffix offsets a path's next token may align to; 0 (the true next token) first, so that the
        # verbatim path keeps it when the suffix repeats a token nearby (later copies are masked)
        band = torch.tensor([0] + [x for a in range(1, max_edits + 1) for x in (-a, a)], device=dev)
    else:
        cost = (torch.arange(c + 1, device=dev) > 0).long()  # column 0 is the true token, the rest change it
    for t in range(s):
        _, top = sc.topk(logits[:, None, :], c)  # the likeliest tokens (temperature keeps the order)
        if lev:
            cand, drop, new_rows, level = _edit_step(top, truth, rows, t, band)
            lp = candidate_logprobs(logits, cand, scheme, sc.grid, sc.sharded_vocab)
            lp.masked_fill_(drop, -math.inf)
            changed = level.view(r, -1)
        else:
            true = targets[:, t].repeat_interleave(b)
            cand = torch.cat([true[:, None], top], dim=1)  # [R * B, C + 1]
            lp = candidate_logprobs(logits, cand, scheme, sc.grid, sc.sharded_vocab)
            lp[:, 1:].masked_fill_(top == true[:, None], -math.inf)  # the true token counts once, as column 0
            changed = (edits.view(-1, 1) + cost).view(r, -1)
        k = cand.shape[1]
        total = (score.view(-1, 1) + lp).view(r, -1)
        vals, picks = [total[:, :1]], [torch.zeros_like(total[:, :1], dtype=torch.long)]  # verbatim
        for e in range(1, max_edits + 1):
            # a level short of paths fills up with -inf picks (possibly another level's: they stay -inf)
            v, i = total.masked_fill(changed != e, -math.inf).topk(beams, dim=1)
            vals.append(v)
            picks.append(i)
        idx = torch.cat(picks, dim=1)
        score, edits = torch.cat(vals, dim=1), changed.gather(1, idx)
        src, col = idx // k, idx % k
        tok = cand.view(r, b, k)[base, src, col]
        seqs = torch.cat([seqs.gather(1, src[:, :, None].expand(-1, -1, t)), tok[:, :, None]], dim=2)
        if lev:
            rows = new_rows.view(r, b * k, s + 1)[base, idx].view(r * b, s + 1)
        if tick is not None:
            tick(r)
        if t + 1 == s:
            break
        cache.reorder_cache((base * b + src).view(-1))
        logits, cache = sc.step(tok.view(-1, 1), cache)
        logits = logits[:, -1].float()
    bound = torch.stack([torch.logsumexp(score.masked_fill(edits > d, -math.inf), dim=1)
                         for d in range(max_edits + 1)], dim=1)
    best = score.argmax(dim=1)
    row = base.squeeze(1)
    return {"bound": bound, "tokens": seqs[row, best], "edits": edits[row, best], "logp": score[row, best]}


def near_verbatim(model: torch.nn.Module, documents: Sequence[Sequence[int]], *, prefix_len: int,
                  suffix_len: int, schemes: Sequence[Scheme], max_edits: int, beams: int = DEFAULT_BEAMS,
                  offsets: Sequence[int] = (0,), ns: Sequence[int] = (1, 10, 100, 1000), p: float = 0.5,
                  batch_size: int = 8, doc_ids: Sequence | None = None, grid: ProcessGrid | None = None,
                  progress: bool = False, distance: str = "hamming") -> dict[str, Any]:
    """Per offset and scheme, the (n, p) summary of each document's near-verbatim lower bound at every
    d <= max_edits (column `d=0` is the verbatim p_z), and one row per scored (offset, document); call on
    every rank of `grid`. `batch_size` documents are searched at once, each with `beams` paths.
    `distance`: "hamming" (d tokens substituted in place) or "levenshtein" (d substitutions, insertions
    or deletions between the S sampled tokens and the S-token suffix: a copy that drops or adds a word
    and then goes on verbatim is 2 edits away, and up to S substitutions away by Hamming).

    Returns {"prefix", "suffix", "schemes", "max_edits", "beams", "distance", "offsets": {"0": {"docs", "np":
    {scheme: np_summary with columns d=0..d=max_edits}, "median_log10": {scheme: {"d=0": the median
    log10 bound, ...}}, "rows"}}}; a row is {"doc", "bound":
    {scheme: [log bound at d=0..max_edits]}, "likeliest": {scheme: {"edits", "logp", "tokens"}}}
    (JSON floats: -inf as None)."""
    offs, ids = check_windows(documents, offsets, prefix_len, suffix_len, batch_size, doc_ids)
    _check_search(schemes, max_edits, beams, distance)
    sc = Scorer(model, grid)
    width = prefix_len + suffix_len
    out: dict[str, Any] = {"prefix": prefix_len, "suffix": suffix_len, "schemes": [s.name for s in schemes],
                           "max_edits": max_edits, "beams": beams, "distance": distance, "offsets": {}}
    keeps = {o: [i for i, d in enumerate(documents) if len(d) >= o + width] for o in offs}
    # one unit per suffix token of a document, decoded on all of its paths; this rank's share (rank 0)
    bar = tqdm(total=sum(len(sc.rows(len(k[b:b + batch_size]))) for k in keeps.values()
                         for b in range(0, len(k), batch_size)) * len(schemes) * suffix_len,
               desc=f"near-verbatim ({1 + max_edits * beams} paths)", unit="tok",
               disable=not (progress and sc.is_main))
    with evaluating(model):
        for o, keep in keeps.items():
            got: dict[str, list[dict[str, Any]]] = {s.name: [] for s in schemes}
            for start in range(0, len(keep), batch_size):
                chunk = keep[start:start + batch_size]
                windows = torch.tensor([[int(t) for t in documents[i][o:o + width]] for i in chunk],
                                       dtype=torch.long, device=sc.device)
                mine = sc.rows(len(chunk))
                for s in schemes:
                    res = search(sc, windows[mine, :prefix_len], windows[mine, prefix_len:], s, max_edits,
                                 beams, tick=bar.update, distance=distance)
                    got[s.name] += sc.collect(mine, _results(res), len(chunk))
            out["offsets"][str(o)] = _offset([ids[i] for i in keep], got, max_edits, ns, p)
    bar.close()
    return out


def _offset(ids: list[Any], got: dict[str, list[dict[str, Any]]], max_edits: int, ns: Sequence[int],
            p: float) -> dict[str, Any]:
    """One offset's result: per scheme the (n, p) summary and median log10 bound at every d, and one row per
    document (`got`: scheme -> each document's search result, in the order of `ids`)."""
    rows = [{"doc": doc, "bound": {n: got[n][j]["bound"] for n in got},
             "likeliest": {n: got[n][j]["likeliest"] for n in got}} for j, doc in enumerate(ids)]
    summary, median = {}, {}
    for n in got:
        cols = {f"d={d}": np.array([-np.inf if r["bound"][d] is None else r["bound"][d]
                                    for r in got[n]], dtype=np.float64) for d in range(max_edits + 1)}
        summary[n] = np_summary(cols, ns, p) if ids else None
        median[n] = {k: _finite(float(np.median(v)) / math.log(10)) if ids else None for k, v in cols.items()}
    return {"docs": len(ids), "np": summary, "median_log10": median, "rows": rows}


def _results(res: dict[str, Any]) -> list[dict[str, Any]]:
    """search's result as one dict per searched row (its bounds, and its likeliest path's edits, tokens
    and log-probability; JSON floats)."""
    return [{"bound": [_finite(x) for x in b.tolist()],
             "likeliest": {"edits": int(e), "tokens": tk.tolist(), "logp": _finite(float(lp))}}
            for b, e, tk, lp in zip(res["bound"], res["edits"], res["tokens"], res["logp"])]


def near_verbatim_pairs(model: torch.nn.Module, prompts: Sequence[Sequence[int]],
                        targets: Sequence[Sequence[int]], *, schemes: Sequence[Scheme], max_edits: int,
                        beams: int = DEFAULT_BEAMS, ns: Sequence[int] = (1, 10, 100, 1000), p: float = 0.5,
                        batch_size: int = 8, doc_ids: Sequence | None = None, grid: ProcessGrid | None = None,
                        distance: str = "hamming") -> dict[str, Any]:
    """near_verbatim for (prompt, target) pairs of any lengths (chat data: each answer from its whole
    prompt), pairs of equal lengths searched together; near_verbatim's result with one offset, "0",
    "prefix": "prompt" and "suffix" the longest target's length. A target of max_edits tokens or fewer
    is left out (every sample lies within that many changes of it; `docs` counts the searched pairs).
    Call on every rank of `grid`."""
    pairs, ids = check_pairs(prompts, targets, doc_ids)
    _check_search(schemes, max_edits, beams, distance)
    sc = Scorer(model, grid)
    keep = [i for i, (_, b) in enumerate(pairs) if len(b) > max_edits]  # a target of d tokens is d edits away
    found: dict[str, dict[int, dict[str, Any]]] = {s.name: {} for s in schemes}
    with evaluating(model):
        for plen, idx in length_groups(pairs, keep):
            for start in range(0, len(idx), batch_size):
                chunk = idx[start:start + batch_size]
                windows = torch.tensor([pairs[i][0] + pairs[i][1] for i in chunk], dtype=torch.long,
                                       device=sc.device)
                mine = sc.rows(len(chunk))
                for s in schemes:
                    res = search(sc, windows[mine, :plen], windows[mine, plen:], s, max_edits, beams,
                                 distance=distance)
                    found[s.name].update(zip(chunk, sc.collect(mine, _results(res), len(chunk))))
    got = {n: [by[i] for i in keep] for n, by in found.items()}
    return {"prefix": "prompt", "suffix": max((len(b) for _, b in pairs), default=0),
            "schemes": [s.name for s in schemes], "max_edits": max_edits, "beams": beams,
            "distance": distance, "offsets": {"0": _offset([ids[i] for i in keep], got, max_edits, ns, p)}}


__all__ = ["DEFAULT_BEAMS", "near_verbatim", "near_verbatim_pairs", "search"]
