"""Vocab-parallel cross-entropy for logits whose vocabulary is split over Y, honouring ignore_index.

The parallel LM head returns logits of shape [..., vocab/Y] (this rank's vocab slice), wrapped in
`VocabShardedLogits` so that slicing/reshaping keeps the marker and so that a plain softmax, argmax or
F.cross_entropy on them fails loudly instead of silently using 1/Y of the vocabulary.  With Y = 1 the
logits are full and unmarked.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from axonn.grid import ProcessGrid
from axonn.layers.functions import GatherLastDim
from memorize_core import IGNORE_INDEX

_REFUSED = {F.cross_entropy, F.log_softmax, F.softmax, F.nll_loss, torch.argmax, torch.Tensor.argmax,
            torch.softmax, torch.log_softmax, torch.Tensor.softmax, torch.Tensor.log_softmax,
            torch.topk, torch.Tensor.topk}


class VocabShardedLogits(torch.Tensor):
    """Logits holding only this rank's vocab slice (split over the grid's Y axis)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if func in _REFUSED:
            raise RuntimeError(
                f"{getattr(func, '__name__', func)} on vocab-sharded logits would see only this rank's "
                "vocab slice; use axonn.cross_entropy(logits, targets, grid) or "
                "axonn.gather_logits(logits, grid) first")
        return super().__torch_function__(func, types, args, kwargs or {})


def mark_vocab_sharded(logits: torch.Tensor, grid: ProcessGrid) -> torch.Tensor:
    """Wrap LM-head output as VocabShardedLogits when the vocab is split (Y > 1)."""
    return logits.as_subclass(VocabShardedLogits) if grid.y > 1 else logits


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(torch.Tensor) if isinstance(t, VocabShardedLogits) else t


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    # softmax sums over the vocabulary: bf16/fp16 would lose the loss; fp64 stays fp64
    return t.float() if t.element_size() < 4 else t


def gather_logits(logits: torch.Tensor, grid: ProcessGrid) -> torch.Tensor:
    """Full-vocab logits from vocab-sharded ones (all-gather over Y; differentiable)."""
    if not isinstance(logits, VocabShardedLogits):
        return logits
    return GatherLastDim.apply(_plain(logits), grid.comm, "y", grid.y_rank)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token CE over logits split along the vocab over Y (all-reduces: one max, one sum)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, grid: ProcessGrid,
                ignore_index: int) -> torch.Tensor:
        comm = grid.comm
        n_local = logits.shape[-1]
        start = grid.y_rank * n_local
        logits = _at_least_fp32(logits)
        gmax = logits.max(dim=-1).values
        comm.all_reduce(gmax, "y", op="max")
        shifted = logits - gmax.unsqueeze(-1)
        exp = shifted.exp()
        local_t = targets - start
        valid = targets != ignore_index
        own = (local_t >= 0) & (local_t < n_local) & valid
        idx = torch.where(own, local_t, torch.zeros_like(local_t))
        picked = shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * own
        sums = torch.stack([exp.sum(dim=-1), picked])
        comm.all_reduce(sums, "y")  # [sum of exp, target logit] over the vocab slices in one call
        loss = (sums[0].log() - sums[1]) * valid
        ctx.save_for_backward(exp.div_(sums[0].unsqueeze(-1)), idx, own, valid)
        return loss

    @staticmethod
    def backward(ctx: Any, dloss: torch.Tensor) -> tuple:
        softmax, idx, own, valid = ctx.saved_tensors
        g = dloss * valid
        grad = softmax * g.unsqueeze(-1)
        grad.scatter_add_(-1, idx.unsqueeze(-1), (-g * own).unsqueeze(-1))
        return grad, None, None, None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, grid: ProcessGrid | None = None,
                  ignore_index: int = IGNORE_INDEX) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of token CE over this rank's non-ignored targets, their count); targets already shifted."""
    loss = token_cross_entropy(logits, targets, grid, ignore_index)
    return loss.sum(), (targets != ignore_index).sum()


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, grid: ProcessGrid | None = None,
                        ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Per-token CE, flattened to [N] (0 where the target is ignored); targets already shifted.

    Summing it over any subset of positions gives that subset's loss from one softmax, e.g. the
    supervised and the goldfish-dropped tokens of a batch.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree; "
                         "pass logits[:, :-1] with labels[:, 1:]")
    targets = targets.reshape(-1)
    if isinstance(logits, VocabShardedLogits):
        if not isinstance(grid, ProcessGrid):
            raise ValueError("these logits are vocab-sharded over Y: "
                             "pass the grid to axonn.token_cross_entropy")
        return VocabParallelCrossEntropy.apply(_plain(logits).reshape(-1, logits.shape[-1]), targets, grid,
                                               ignore_index)
    flat = _at_least_fp32(logits.reshape(-1, logits.shape[-1]))
    return F.cross_entropy(flat, targets, ignore_index=ignore_index, reduction="none")
