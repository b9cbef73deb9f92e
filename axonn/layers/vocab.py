"""Reductions over logits whose vocabulary is split over Y, for scoring without gathering the vocabulary.

The parallel LM head leaves each Y rank with its contiguous slice [y_rank * V/Y, (y_rank + 1) * V/Y)
of the vocabulary (`VocabShardedLogits`).  Evaluation needs five things from such logits, each
costing one or two small collectives over Y instead of an all-gather of [.., V]:

  vocab_argmax      the greedy token: (max, lowest id at the max) per rank, all-gathered, and the
                    global winner picked with the ties broken toward the lower id, as `argmax` does
  vocab_logsumexp   log sum_v exp(logit_v): global max (all-reduce max), then sum of exp (all-reduce sum)
  vocab_pick        the logit of a given (global) token id: the owning rank's value, all-reduce sum
  vocab_reduce      a sum over the vocabulary (e.g. the moments of log p for Min-K%++): all-reduce sum
  vocab_topk        the k best (value, global flat index) over [.., n * V] candidates laid out as
                    n beams x V tokens (beam search): local top-k, all-gathered, global top-k

Every function takes plain logits too (serial, or Y = 1): then it is the plain torch operation, with
no collective.  Inputs are float32 or wider (the callers cast first): sums over the vocabulary in
bf16 would lose the scores.
"""
from __future__ import annotations

import torch

from axonn.grid import ProcessGrid
from axonn.layers.functions import VocabShardedLogits, _plain


def _split(logits: torch.Tensor, grid: ProcessGrid) -> tuple[torch.Tensor, bool]:
    """(plain tensor, whether its last dim is this rank's vocab slice)."""
    sharded = isinstance(logits, VocabShardedLogits) and grid.y > 1
    return _plain(logits), sharded


def vocab_argmax(logits: torch.Tensor, grid: ProcessGrid) -> torch.Tensor:
    """argmax over the (possibly Y-split) last dim as global ids; ties go to the lower id, as torch.argmax."""
    x, sharded = _split(logits, grid)
    if not sharded:
        return x.argmax(dim=-1)
    n = x.shape[-1]
    val, idx = x.max(dim=-1)  # CPU and CUDA max return the first index of the maximum
    glob = (idx + grid.y_rank * n).double()  # ids below 2**53 are exact in float64
    both = torch.stack([val.double(), glob], dim=-1).unsqueeze(0)  # [1, ..., 2]
    every = grid.comm.all_gather(both.contiguous(), "y", dim=0)  # [Y, ..., 2], in vocab order
    vals, ids = every[..., 0], every[..., 1]
    best = vals.max(dim=0).values
    # ranks holding the maximum: the lowest rank among them owns the lowest id (slices are ordered)
    first = (vals == best.unsqueeze(0)).to(torch.int8).argmax(dim=0)
    return ids.gather(0, first.unsqueeze(0)).squeeze(0).long()


def vocab_logsumexp(logits: torch.Tensor, grid: ProcessGrid) -> torch.Tensor:
    """log sum exp over the whole vocabulary of (possibly Y-split) logits: shape logits.shape[:-1]."""
    x, sharded = _split(logits, grid)
    if not sharded:
        return torch.logsumexp(x, dim=-1)
    gmax = x.max(dim=-1).values
    grid.comm.all_reduce(gmax, "y", op="max")
    total = (x - gmax.unsqueeze(-1)).exp().sum(dim=-1)
    grid.comm.all_reduce(total, "y")
    return total.log() + gmax


def vocab_pick(logits: torch.Tensor, ids: torch.Tensor, grid: ProcessGrid) -> torch.Tensor:
    """logits[..., ids] for global token ids `ids` (shape logits.shape[:-1])."""
    x, sharded = _split(logits, grid)
    if not sharded:
        return x.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    n = x.shape[-1]
    local = ids - grid.y_rank * n
    own = (local >= 0) & (local < n)
    picked = x.gather(-1, torch.where(own, local, torch.zeros_like(local)).unsqueeze(-1)).squeeze(-1)
    picked = picked * own
    grid.comm.all_reduce(picked, "y")  # exactly one slice owns each id
    return picked


def vocab_reduce(partial: torch.Tensor, grid: ProcessGrid, sharded: bool) -> torch.Tensor:
    """Sums over the vocabulary from this rank's partial sums over its slice (in place; stack several
    partial sums to reduce them in one call)."""
    if sharded and grid.y > 1:
        grid.comm.all_reduce(partial, "y")
    return partial


def vocab_topk(scores: torch.Tensor, k: int, grid: ProcessGrid, sharded: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of [B, n, V(/Y)] candidate scores over (beam, token): (values [B, k], flat ids beam * V + token).

    Sorted best first (torch.topk on whole logits; split over Y, equal scores go to the lower flat id)."""
    scores = _plain(scores)
    b, n, local = scores.shape
    flat = scores.reshape(b, n * local)
    if not (sharded and grid.y > 1):
        return flat.topk(k, dim=-1)
    vocab = local * grid.y
    vals, idx = flat.topk(min(k, n * local), dim=-1)
    beam, tok = idx // local, idx % local + grid.y_rank * local
    glob = (beam * vocab + tok).double()
    both = torch.stack([vals.double(), glob], dim=0).unsqueeze(0)  # [1, 2, B, k]
    every = grid.comm.all_gather(both.contiguous(), "y", dim=0)  # [Y, 2, B, k]
    all_vals = every[:, 0].permute(1, 0, 2).reshape(b, -1)
    all_ids = every[:, 1].permute(1, 0, 2).reshape(b, -1).long()
    best, ids = _ordered_topk(all_vals, all_ids, k)
    return best.to(scores.dtype), ids


def _ordered_topk(vals: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values, ties broken toward the lower id (a deterministic top-k)."""
    by_id = ids.argsort(dim=-1, stable=True)
    vals, ids = vals.gather(-1, by_id), ids.gather(-1, by_id)
    order = vals.argsort(dim=-1, descending=True, stable=True)[:, :k]
    return vals.gather(-1, order), ids.gather(-1, order)
