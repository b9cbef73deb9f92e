"""Forward-only use of a model on its grid: batch shards, ranks in lockstep, results gathered.

Evaluation runs a sharded model where it lives (evals/scoring.py is the client). Four facts of the
engine make that work, and this module holds them:

- Which rows a rank scores: the batch is split over the Z x data batch shards (`shard_rows`); the
  X and Y ranks of a shard score the same rows, in the same order, and agree bit for bit (their
  activations are replicated and every vocab reduction ends in an all-reduce or all-gather).
- Only Z couples shards inside a forward: every parallel layer all-gathers its Z-split weight over
  Z. Data ranks never talk during a forward. So when shards have different amounts of work (a
  batch that does not divide, data-dependent decoding), the ranks of each Z group step together
  (`Lockstep`): a flag is all-reduced over Z before each forward, and a rank that is done runs a
  one-token forward for every forward a Z peer still runs, so the Z all-gathers pair up.
- `keep_gathered` gathers every Z-split block once and keeps it for the whole evaluation (memory
  of X x Y shards instead of X x Y x Z, and no Z collective per forward: no lockstep either).
- `collect` brings each shard's results to every rank, in input order.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from axonn.engine import engine_of, model_grid
from axonn.grid import ProcessGrid
from memorize_core import fail


def grid_of(model: nn.Module, grid: ProcessGrid | None = None) -> ProcessGrid:
    """The grid to score `model` on: `grid` if given, else the one it is sharded over, else serial.

    A plain model with a grid that splits tensors is refused (only a replica can be batch-sharded)."""
    handle = engine_of(model)
    if grid is None:
        return model_grid(model)
    if handle is None and grid.x * grid.y * grid.z > 1:
        raise fail("grid", ",".join(map(str, grid.dims)), "splits tensors but the model is not "
                   "parallelized; pass a model from axonn.parallelize (or a grid of 1,1,1,D)")
    if handle is not None and handle.grid is not grid and handle.grid.dims != grid.dims:
        raise fail("grid", ",".join(map(str, grid.dims)), "is not the grid the model is sharded "
                   f"over ({','.join(map(str, handle.grid.dims))}); leave grid unset")
    return grid


def shard_rows(n: int, grid: ProcessGrid) -> list[int]:
    """The indices of n items this rank's batch shard scores: every shards-th item from its index."""
    return list(range(grid.batch_shard_index, n, grid.batch_shards))


class Lockstep:
    """Keeps the ranks of a Z group stepping together through forwards of different counts.

    Call `step()` before each real forward and `drain()` when this rank has no work left; `filler`
    runs one cheap forward (it only has to reach every Z-gathered layer once, in model order)."""

    def __init__(self, grid: ProcessGrid, filler: Callable[[], None], *, coupled: bool = True) -> None:
        self.grid, self.filler = grid, filler
        self.on = coupled and grid.z > 1
        self.fillers = 0  # filler forwards this rank ran (cost of the imbalance)

    def _any(self, active: bool) -> bool:
        flag = torch.tensor([1 if active else 0], dtype=torch.int32, device=self.grid.device)
        self.grid.comm.all_reduce(flag, "z", op="max")
        return bool(flag.item())

    def step(self) -> None:
        """This rank is about to run a real forward (its Z peers run one too, real or filler)."""
        if self.on:
            self._any(True)

    def drain(self) -> None:
        """This rank is done: run fillers until every rank of its Z group is done."""
        if not self.on:
            return
        while self._any(False):
            self.filler()
            self.fillers += 1


@contextmanager
def keep_gathered(model: nn.Module, enabled: bool = True) -> Iterator[int]:
    """Hold every Z-split weight block gathered inside the block (yields the bytes held; 0 if none)."""
    handle = engine_of(model)
    if not enabled or handle is None or handle.grid.z == 1:
        yield 0
        return
    held = handle.scheduler.hold_gathered()
    try:
        yield held
    finally:
        handle.scheduler.release_gathered()


def collect(grid: ProcessGrid, rows: Sequence[int], values: Sequence[Any], n: int) -> list[Any]:
    """Every shard's (rows, values) put back in input order, on every rank: a list of n values.

    One rank per batch shard (X = Y = 0) contributes; the others hold the same values."""
    if len(rows) != len(values):
        raise ValueError(f"{len(rows)} rows but {len(values)} values")
    if not grid.distributed or grid.batch_shards == 1:
        out: list[Any] = [None] * n
        for i, v in zip(rows, values):
            out[i] = v
        return out
    mine = (list(rows), list(values)) if grid.x_rank == 0 and grid.y_rank == 0 else None
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    out = [None] * n
    for part in parts:
        if part is not None:
            for i, v in zip(*part):
                out[i] = v
    return out
