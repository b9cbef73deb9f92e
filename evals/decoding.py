"""Fixed-length decoding with the KV cache: batched greedy and beam search, no EOS stopping.

Memorization evals compare a fixed-length continuation with the true suffix, so both decoders
always emit exactly `max_new_tokens` tokens and ignore EOS. They drive the model's forward pass
by hand (prefill once, then one token per step through the KV cache) instead of calling
`model.generate`: that skips generate's per-step bookkeeping for features these evals never use
(logits processors, stopping criteria, mask/input re-preparation, a host sync per step to test for
finished sequences) and lets the cache be preallocated (evals/kv_cache.py).

On a sharded model they run on every rank of its grid (evals/scoring.py): the prefixes are split
over the batch shards, the greedy token is a distributed argmax over the vocab-split logits, beam
search a distributed top-k, and the KV cache holds the heads this rank computes. Each public
function returns the whole batch's tokens on every rank; the `_local` ones decode this rank's rows.
"""
from __future__ import annotations

import copy

import torch

from axonn.grid import ProcessGrid
from evals._model import evaluating
from evals.kv_cache import preallocated_cache
from evals.scoring import Scorer
from memorize_core import fail


def _check(prefixes: torch.Tensor, max_new_tokens: int, num_beams: int = 1) -> None:
    if not isinstance(prefixes, torch.Tensor) or prefixes.dim() != 2 or prefixes.shape[1] < 1:
        shape = tuple(prefixes.shape) if isinstance(prefixes, torch.Tensor) else type(prefixes).__name__
        raise fail("prefixes", shape, "pass a LongTensor of shape [batch, prefix_len] with prefix_len >= 1")
    if prefixes.dtype != torch.long:
        raise fail("prefixes.dtype", str(prefixes.dtype), "pass token ids as torch.long")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise fail("max_new_tokens", max_new_tokens, "pass an integer >= 0")
    if isinstance(num_beams, bool) or not isinstance(num_beams, int) or num_beams < 1:
        raise fail("num_beams", num_beams, "pass an integer >= 1")


def _run(model: torch.nn.Module, prefixes: torch.Tensor, grid: ProcessGrid | None, width: int,
         local) -> torch.Tensor:
    """Decode this rank's share of the batch with `local(scorer, rows_of_prefixes)`; the whole [B, width]."""
    sc = Scorer(model, grid)
    prefixes = prefixes.to(sc.device)
    rows = sc.rows(prefixes.shape[0])
    with evaluating(model):
        mine = local(sc, prefixes[rows]) if rows else prefixes.new_empty(0, width)
        return sc.collect_rows(rows, mine, prefixes.shape[0])


def greedy_generate(model: torch.nn.Module, prefixes: torch.LongTensor, max_new_tokens: int, *,
                    grid: ProcessGrid | None = None) -> torch.LongTensor:
    """Batched greedy continuation of equal-length prefixes: returns [B, max_new_tokens] new tokens."""
    _check(prefixes, max_new_tokens)
    return _run(model, prefixes, grid, max_new_tokens, lambda sc, p: greedy_local(sc, p, max_new_tokens))


def greedy_local(sc: Scorer, prefixes: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """greedy_generate of this rank's rows (inside `evaluating`; no collect)."""
    batch = prefixes.shape[0]
    out = torch.empty(batch, max_new_tokens, dtype=torch.long, device=prefixes.device)
    if max_new_tokens == 0 or batch == 0:
        return out
    cache = preallocated_cache(sc.model, prefixes.shape[1] + max_new_tokens)
    logits, cache = sc.step(prefixes, cache)
    out[:, 0] = sc.argmax(logits[:, -1])
    out[:, 1:] = _continue(sc, cache, out[:, 0], max_new_tokens - 1)
    return out


def beam_generate(model: torch.nn.Module, prefixes: torch.LongTensor, max_new_tokens: int,
                  num_beams: int, *, grid: ProcessGrid | None = None) -> torch.LongTensor:
    """Beam search maximizing the summed log-probability of exactly max_new_tokens tokens; [B, S]."""
    _check(prefixes, max_new_tokens, num_beams)
    return _run(model, prefixes, grid, max_new_tokens,
                lambda sc, p: beam_local(sc, p, max_new_tokens, num_beams))


def beam_local(sc: Scorer, prefixes: torch.Tensor, max_new_tokens: int, num_beams: int) -> torch.Tensor:
    """beam_generate of this rank's rows (inside `evaluating`; no collect)."""
    if num_beams == 1:
        return greedy_local(sc, prefixes, max_new_tokens)
    device = prefixes.device
    batch, n = prefixes.shape[0], num_beams
    if max_new_tokens == 0 or batch == 0:
        return torch.empty(batch, max_new_tokens, dtype=torch.long, device=device)
    rows = torch.arange(batch, device=device)[:, None] * n
    # Prefill each prefix once, then copy its cache to the n beams.
    cache = preallocated_cache(sc.model, prefixes.shape[1] + max_new_tokens)
    logits, cache = sc.step(prefixes, cache)
    cache.batch_repeat_interleave(n)
    logits = logits[:, -1].float().repeat_interleave(n, dim=0)
    # All beams start identical; only beam 0 may expand at step 0, or the first step would
    # pick n copies of the same token.
    scores = torch.full((batch, n), float("-inf"), device=device)
    scores[:, 0] = 0.0
    seqs = torch.empty(batch, n, 0, dtype=torch.long, device=device)
    for t in range(max_new_tokens):
        logp = sc.log_softmax(logits)  # this rank's vocab columns
        vocab = sc.vocab_size(logits)
        cand = scores[:, :, None] + logp.reshape(batch, n, logp.shape[-1])
        scores, idx = sc.topk(cand, n)  # sorted: beam 0 is always the best so far
        src, tok = idx // vocab, idx % vocab
        seqs = torch.cat([seqs.gather(1, src[:, :, None].expand(-1, -1, seqs.shape[2])),
                          tok[:, :, None]], dim=2)
        if t + 1 == max_new_tokens:
            break
        cache.reorder_cache((rows + src).view(-1))
        logits, cache = sc.step(tok.view(-1, 1), cache)
        logits = logits[:, -1].float()
    return seqs[:, 0]


def _rows_of(cache, rows: torch.Tensor, length: int, *, copy_rows: bool):
    """The cache restricted to batch `rows` and its first `length` positions (a copy if asked)."""
    sub = copy.deepcopy(cache) if copy_rows else cache
    sub.batch_select_indices(rows)
    extra = sub.get_seq_length() - length
    if extra > 0:
        sub.crop(-extra)
    return sub


def _continue(sc: Scorer, cache, last: torch.Tensor, n: int) -> torch.Tensor:
    """n greedy tokens after `last` ([rows]), decoding one position per step from `cache`."""
    out = torch.empty(last.shape[0], n, dtype=torch.long, device=last.device)
    tok = last
    for t in range(n):
        logits, cache = sc.step(tok[:, None], cache)
        tok = sc.argmax(logits[:, -1])
        out[:, t] = tok
    return out


def verified_greedy(model: torch.nn.Module, prefixes: torch.LongTensor, targets: torch.LongTensor, *,
                    grid: ProcessGrid | None = None) -> torch.LongTensor:
    """Greedy continuation of `prefixes`, using the known `targets` as a speculative draft.

    The prefix is prefilled once into a KV cache, which gives every row's first greedy token.
    Rows whose first token already differs from the target (nearly all, for text the model has
    not memorized) simply go on decoding from that cache: no work is wasted on a draft. Rows that
    agree score the rest of their target in ONE forward pass over the cached prefix: wherever greedy
    decoding agrees with the target so far its context *is* the target, so the argmax at the first
    disagreement (or everywhere, for a verbatim match) is already the greedy token; a row that
    diverges at position m continues from its cache cut back to prefix + m tokens. The result
    equals `greedy_generate(model, prefixes, S)`; a memorized suffix costs one pass instead of S.
    """
    _check(prefixes, targets.shape[1] if targets.dim() == 2 else -1)
    if targets.shape[0] != prefixes.shape[0]:
        raise fail("targets", tuple(targets.shape), f"pass one target row per prefix ({prefixes.shape[0]})")
    sc = Scorer(model, grid)
    prefixes, targets = prefixes.to(sc.device), targets.to(sc.device)
    rows = sc.rows(prefixes.shape[0])
    with evaluating(model):
        mine = verified_local(sc, prefixes[rows], targets[rows])
        return sc.collect_rows(rows, mine, prefixes.shape[0])


def verified_local(sc: Scorer, prefixes: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """verified_greedy of this rank's rows (inside `evaluating`; no collect)."""
    batch, p = prefixes.shape
    s = targets.shape[1]
    if s == 0 or batch == 0:
        return targets.clone()
    out = torch.empty(batch, s, dtype=torch.long, device=prefixes.device)
    logits, cache = sc.step(prefixes, preallocated_cache(sc.model, p + s))
    out[:, 0] = sc.argmax(logits[:, -1])
    if s == 1:
        return out
    agree = out[:, 0] == targets[:, 0]
    # (rows, their cache, position of their last known token): decoded on from there
    pending = []
    if agree.any():
        rows = agree.nonzero().squeeze(1)
        vcache = _rows_of(cache, rows, p, copy_rows=not bool(agree.all()))
        pred = sc.argmax(sc.step(targets[rows, :-1], vcache, last_only=False)[0])
        out[rows, 1:] = pred  # pred[:, j] is the greedy token at j + 1 given target[:j + 1]
        wrong = pred != targets[rows, 1:]
        first = torch.where(wrong.any(dim=1), wrong.int().argmax(dim=1) + 1, s)
        for m in sorted(set(first.tolist()) - {s}):
            if m + 1 < s:  # the row knows tokens 0..m; its context is the prefix + target[:m]
                sel = (first == m).nonzero().squeeze(1)
                pending.append((rows[sel], _rows_of(vcache, sel, p + m, copy_rows=True), m))
    if not agree.all():
        rows = (~agree).nonzero().squeeze(1)
        pending.append((rows, _rows_of(cache, rows, p, copy_rows=False), 0))
    for rows, sub, m in pending:
        out[rows, m + 1:] = _continue(sc, sub, out[rows, m], s - m - 1)
    return out
