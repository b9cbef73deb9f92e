"""A vocab-parallel nn.Embedding: table [vocab, hidden] cut like an LM-head weight (so they can tie).

Rows (vocab) are split over Y and then Z, columns (hidden) over X.  Forward: all-gather the block
over Z, look up the tokens this Y-rank owns (zeros elsewhere), all-reduce over Y, all-gather the
hidden slices over X -> full-width embeddings on every X/Y rank.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from axonn.grid import ProcessGrid
from axonn.layers.functions import GatherLastDim, VocabEmbedding
from axonn.layers.layout import spec_of
from axonn.layers.linear import _local_param, weight_spec


class ParallelEmbedding(nn.Module):
    """Token embedding whose table is sharded over X, Y and Z (the same layout as the LM head)."""

    def __init__(self, grid: ProcessGrid, num_embeddings: int, embedding_dim: int, *,
                 padding_idx: int | None = None, weight: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.grid = grid
        self.scheduler: Any = None  # set by parallelize (axonn.layers.schedule.Scheduler)
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        spec = weight_spec(grid, num_embeddings, embedding_dim, "easy")
        self.weight = _local_param(weight, spec, spec.local_shape, grid.device, dtype)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}, "
                f"local={tuple(self.weight.shape)}")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Full-width embeddings of `ids` (identical on the X/Y ranks of a batch shard)."""
        g = self.grid
        spec = spec_of(self.weight)
        if self.scheduler is not None:
            self.scheduler.grad_mode = torch.is_grad_enabled()
        rows = spec.block_rows
        out = VocabEmbedding.apply(ids, self.weight, g.comm, "y", rows, g.y_rank * rows, self.padding_idx,
                                   self.scheduler, id(self))
        return GatherLastDim.apply(out, g.comm, "x", g.x_rank) if g.x > 1 else out
