"""Token log-probabilities and held-out loss of a causal LM (on its grid when sharded: evals/scoring.py)."""
from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from axonn.grid import ProcessGrid
from evals._model import evaluating, pad_right, scored_seqs
from evals.kv_cache import preallocated_cache
from evals.scoring import Scorer
from memorize_core import IGNORE_INDEX, fail


def _check_ids(field: str, ids: torch.Tensor) -> None:
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] < 2:
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise fail(field, shape, "pass a LongTensor [batch, length] with length >= 2")


def sequence_logprobs(model: torch.nn.Module, input_ids: torch.LongTensor,
                      attention_mask: torch.Tensor | None = None, *,
                      grid: ProcessGrid | None = None) -> torch.Tensor:
    """Log-prob of each actual next token, [B, T-1] float32 on CPU.

    Entry t scores token t+1. Pad on the right: positions whose target token has
    attention_mask 0 are set to 0.0, so callers must use the mask (or lengths) to ignore them.
    """
    _check_ids("input_ids", input_ids)
    sc = Scorer(model, grid)
    rows = sc.rows(input_ids.shape[0])
    ids = input_ids[rows].to(sc.device)
    mask = attention_mask[rows].to(sc.device) if attention_mask is not None else None
    with evaluating(model):
        lp = _logprobs(sc, ids, mask) if rows else ids.new_zeros(0, ids.shape[1] - 1, dtype=torch.float32)
        return sc.collect_rows(rows, lp.cpu(), input_ids.shape[0])


def _logprobs(sc: Scorer, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    lp, _ = sc.token_stats(sc.logits(ids, mask)[:, :-1], ids[:, 1:])
    return lp if mask is None else lp.masked_fill(mask[:, 1:] == 0, 0.0)


def mean_loss(model: torch.nn.Module, rows: torch.LongTensor, labels: torch.LongTensor,
              batch_size: int = 8, *, grid: ProcessGrid | None = None) -> float:
    """Token-weighted mean next-token cross-entropy (nats) over labels != -100.

    HF convention: labels are aligned with rows and shifted here, so labels[:, t] is the target
    predicted from rows[:, :t]; labels[:, 0] is never scored. Equals `model(rows, labels=labels).loss`
    pooled over all supervised tokens (not averaged per batch).
    """
    _check_ids("rows", rows)
    if not isinstance(labels, torch.Tensor) or labels.shape != rows.shape:
        shape = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise fail("labels", shape, f"pass a tensor with the same shape as rows {tuple(rows.shape)}")
    _check_batch(batch_size)
    sc = Scorer(model, grid)
    mine = sc.rows(rows.shape[0])
    sums: list[tuple[float, int]] = []
    with evaluating(model):
        for b in range(0, len(mine), batch_size):
            idx = mine[b:b + batch_size]
            tgt = labels[idx, 1:].to(sc.device)
            sums += _row_nll(sc, rows[idx].to(sc.device), None, tgt, tgt != IGNORE_INDEX)
        every = sc.collect(mine, sums, rows.shape[0])
    total, count = sum(v for v, _ in every), sum(c for _, c in every)
    if count == 0:
        raise fail("labels", "all -100", "no supervised token; leave some labels unmasked")
    return total / count


def _check_batch(batch_size: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise fail("batch_size", batch_size, "pass an integer >= 1")


def _row_nll(sc: Scorer, ids: torch.Tensor, mask: torch.Tensor | None, targets: torch.Tensor,
             valid: torch.Tensor) -> list[tuple[float, int]]:
    """Per row of one batch: the summed next-token CE (float64) over `valid` targets, and their count."""
    safe = torch.where(valid, targets, torch.zeros_like(targets))
    lp, _ = sc.token_stats(sc.logits(ids, mask)[:, :-1], safe)
    nll = (-lp.double() * valid).sum(dim=1).cpu()
    return [(float(v), int(c)) for v, c in zip(nll, valid.sum(dim=1).cpu())]


def corpus_loss(model: torch.nn.Module, seqs: Sequence[Sequence[int]], batch_size: int = 8, *,
                grid: ProcessGrid | None = None, progress: str | None = None) -> dict[str, float | int]:
    """Token-weighted mean next-token cross-entropy (nats) and perplexity over ragged sequences.

    Every token after a sequence's first is scored once, so `scored_tokens` = tokens - docs. Returns
    {docs, tokens, scored_tokens, loss, perplexity}; equals mean_loss on the same rows, unpadded.
    `progress` names a tqdm bar (documents/s) on the main rank.
    """
    seqs = scored_seqs(seqs)
    _check_batch(batch_size)
    # Length-sorted batches keep padding (wasted compute) small; the sum does not depend on order.
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    sc = Scorer(model, grid)
    rows = [order[r] for r in sc.rows(len(order))]
    sums: list[tuple[float, int]] = []
    bar = tqdm(total=len(rows), desc=progress, unit="doc", disable=not (progress and sc.is_main))
    with evaluating(model), bar:
        for b in range(0, len(rows), batch_size):
            ids, mask = pad_right([seqs[i] for i in rows[b:b + batch_size]])
            ids, mask = ids.to(sc.device), mask.to(sc.device)
            sums += _row_nll(sc, ids, mask, ids[:, 1:], mask[:, 1:].bool())
            bar.update(len(rows[b:b + batch_size]))
        every = sc.collect(rows, sums, len(seqs))
    total, count = sum(v for v, _ in every), sum(c for _, c in every)
    loss = total / count
    return {"docs": len(seqs), "tokens": sum(len(s) for s in seqs), "scored_tokens": count,
            "loss": loss, "perplexity": math.exp(loss)}


def continuation_scores(model: torch.nn.Module, pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
                        batch_size: int = 8, *, grid: ProcessGrid | None = None,
                        progress: Any = None) -> list[tuple[float, bool]]:
    """Per (context ids, continuation ids): log p(continuation | context) in nats, and whether greedy
    decoding from the context reproduces the continuation token for token.

    The model reads context + continuation[:-1] once; each continuation token is scored at the
    position before it (the lm-eval `loglikelihood` contract). On a sharded model the pairs are split
    over the batch shards and the vocabulary is reduced, never gathered (evals/scoring.py).
    `progress(n_pairs, n_tokens)` is called after each of this rank's batches.
    """
    seqs: list[list[int]] = []
    conts: list[int] = []
    for i, (ctx, cont) in enumerate(pairs):
        if len(ctx) < 1 or len(cont) < 1:
            raise fail(f"pairs[{i}]", (len(ctx), len(cont)), "needs at least one context and one "
                       "continuation token")
        seqs.append([int(t) for t in ctx] + [int(t) for t in cont])
        conts.append(len(cont))
    _check_batch(batch_size)
    # Longest first, so a too-large batch fails at once and padding stays small.
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    sc = Scorer(model, grid)
    rows = [order[r] for r in sc.rows(len(order))]
    mine: list[tuple[float, bool]] = []
    with evaluating(model):
        for b in range(0, len(rows), batch_size):
            batch = [seqs[i] for i in rows[b:b + batch_size]]
            ids, mask = pad_right([s[:-1] for s in batch])
            targets, _ = pad_right([s[1:] for s in batch])
            ids, mask, targets = ids.to(sc.device), mask.to(sc.device), targets.to(sc.device)
            logits = sc.logits(ids, mask)
            tok, _ = sc.token_stats(logits, targets)
            greedy = sc.argmax(logits)
            for j, i in enumerate(rows[b:b + batch_size]):
                end = len(seqs[i]) - 1
                span = slice(end - conts[i], end)
                mine.append((float(tok[j, span].double().sum()),
                             bool((greedy[j, span] == targets[j, span]).all())))
            if progress is not None:
                progress(len(batch), int(mask.sum()))
        return sc.collect(rows, mine, len(seqs))


def prefix_continuation_logprobs(model: torch.nn.Module, prefix: Sequence[int],
                                 suffixes: Sequence[Sequence[int]], batch_size: int = 64, *,
                                 grid: ProcessGrid | None = None) -> list[torch.Tensor]:
    """log p(suffix[t] | prefix + suffix[:t]) for many suffixes of ONE shared prefix, [len(suffix)] each.

    The prefix is run once into a KV cache; every batch of suffixes continues from a copy of it, so
    only the suffix tokens go through the model and the LM head (exposure's candidates: a template
    prefix of ~20 tokens and a 3-digit secret cost 4 positions each instead of 20). Equals the
    matching entries of `sequence_logprobs` on prefix + suffix up to float32 rounding.
    """
    prefix = [int(t) for t in prefix]
    suffixes = [[int(t) for t in s] for s in suffixes]
    if not prefix or any(not s for s in suffixes):
        raise fail("prefix/suffixes", (len(prefix), min(map(len, suffixes), default=0)),
                   "need at least one prefix token and one token per suffix")
    _check_batch(batch_size)
    sc = Scorer(model, grid)
    rows = sc.rows(len(suffixes))
    width = max(len(s) for s in suffixes)
    mine: list[torch.Tensor] = []
    with evaluating(model):
        cache = preallocated_cache(model, len(prefix) + width)
        if len(prefix) > 1:  # the last prefix token goes with each suffix: its logits score suffix[0]
            _, cache = sc.step(torch.tensor([prefix[:-1]], device=sc.device), cache)
        for b in range(0, len(rows), batch_size):
            batch = [suffixes[i] for i in rows[b:b + batch_size]]
            ids, _ = pad_right([[prefix[-1]] + s[:-1] for s in batch])
            targets, _ = pad_right(batch)
            ids, targets = ids.to(sc.device), targets.to(sc.device)
            copy = _batched_copy(cache, len(batch))
            logits, _ = sc.step(ids, copy, last_only=False)
            lp, _ = sc.token_stats(logits.float(), targets)
            mine += [lp[j, :len(s)].cpu() for j, s in enumerate(batch)]
        return sc.collect(rows, mine, len(suffixes))


def _batched_copy(cache: Any, batch: int) -> Any:
    """A copy of a batch-1 cache repeated `batch` times (None stays None: nothing cached yet)."""
    if cache is None:
        return None
    out = copy.deepcopy(cache)
    out.batch_repeat_interleave(batch)
    return out
