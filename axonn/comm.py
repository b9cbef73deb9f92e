"""Every collective the engine runs, counted: bytes and calls per collective kind per process group.

Byte count definition (what `CommStats` records for one call on one rank): the size in bytes of the
*full* buffer of the collective, the one a ring algorithm moves (p-1)/p of:
  all_reduce      the tensor being reduced
  all_gather      the gathered output (p x the input)
  reduce_scatter  the full input (p x the output)
  all_to_all      the input
Collectives over a group of size 1 are skipped and not counted (nothing moves). The performance model
(axonn.plan) predicts time from exactly these numbers.

The schedule of these collectives (overlap with compute: Z prefetch, background reduce-scatter,
gradient buckets) is axonn/schedule.py.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


class CommStats:
    """Bytes and calls per (group name, collective kind); one per grid, reset by the trainer each step."""

    def __init__(self) -> None:
        self._calls: dict[tuple[str, str], int] = defaultdict(int)
        self._bytes: dict[tuple[str, str], int] = defaultdict(int)

    def record(self, group: str, kind: str, nbytes: int) -> None:
        """Count one call of `kind` over `group` moving a buffer of `nbytes` bytes."""
        self._calls[(group, kind)] += 1
        self._bytes[(group, kind)] += int(nbytes)

    def reset(self) -> None:
        """Forget all counts (call at the start of a step)."""
        self._calls.clear()
        self._bytes.clear()

    def snapshot(self) -> dict[str, dict[str, dict[str, int]]]:
        """A copy of the counts: {group: {kind: {"calls": n, "bytes": b}}}."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for (group, kind), calls in sorted(self._calls.items()):
            out.setdefault(group, {})[kind] = {"calls": calls, "bytes": self._bytes[(group, kind)]}
        return out

    def total_bytes(self, group: str | None = None) -> int:
        """Bytes over one group (or all groups when `group` is None)."""
        return sum(b for (g, _), b in self._bytes.items() if group is None or g == group)


class _Done:
    """Stand-in work handle for collectives that had nothing to do."""

    def wait(self) -> bool:
        return True


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
# torch 2.13 renamed the single-tensor collectives; older releases only have the *_tensor names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Comm:
    """Collectives over the named groups of one grid; every call is counted in `self.stats`."""

    def __init__(self, groups: dict[str, Any], sizes: dict[str, int]) -> None:
        self._groups = dict(groups)
        self._sizes = dict(sizes)
        self.stats = CommStats()

    def size(self, group: str | None) -> int:
        """Number of ranks in the named group (None: no group, one rank -- an unsplit side of a layer)."""
        return 1 if group is None else self._sizes[group]

    def _group(self, group: str) -> Any:
        return self._groups[group]

    def all_reduce(self, t: torch.Tensor, group: str | None, op: str = "sum", async_op: bool = False) -> Any:
        """In-place all-reduce of `t` over `group` (None: nothing to sum); a work handle when `async_op`."""
        if self.size(group) == 1:
            return _Done() if async_op else None
        self.stats.record(group, "all_reduce", _nbytes(t))
        work = dist.all_reduce(t, op=_OPS[op], group=self._group(group), async_op=async_op)
        return work if async_op else None

    def all_gather(self, t: torch.Tensor, group: str, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's `t` along `dim` (rank order of the group)."""
        p = self._sizes[group]
        if p == 1:
            return t
        t = t.contiguous()
        out = torch.empty((p * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        self.stats.record(group, "all_gather", _nbytes(out))
        _all_gather_single(out, t, group=self._group(group))
        if dim % t.dim() == 0:
            return out
        # Gathered along dim 0 as [p * d0, ...]; move the rank axis next to `dim` and merge them.
        d = dim % t.dim()
        out = out.view((p,) + tuple(t.shape)).movedim(0, d)
        shape = list(t.shape)
        shape[d] *= p
        return out.reshape(shape)

    def all_gather_async(self, t: torch.Tensor, group: str) -> tuple[torch.Tensor, Any]:
        """Start a dim-0 all-gather in the background: (output buffer, work); wait before reading."""
        p = self._sizes[group]
        if p == 1:
            return t, _Done()
        t = t.contiguous()
        out = torch.empty((p * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        self.stats.record(group, "all_gather", _nbytes(out))
        work = _all_gather_single(out, t, group=self._group(group), async_op=True)
        return out, work

    def reduce_scatter(self, t: torch.Tensor, group: str, async_op: bool = False) -> Any:
        """Sum `t` over the group and keep this rank's 1/p slice of dim 0 (returns it, or (it, work))."""
        p = self._sizes[group]
        if p == 1:
            return (t, _Done()) if async_op else t
        t = t.contiguous()
        out = torch.empty((t.shape[0] // p,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        self.stats.record(group, "reduce_scatter", _nbytes(t))
        work = _reduce_scatter_single(out, t, group=self._group(group), async_op=async_op)
        return (out, work) if async_op else out

    def all_to_all(
        self, t: torch.Tensor, group: str, in_splits: list[int], out_splits: list[int]
    ) -> torch.Tensor:
        """Exchange dim-0 slices of sizes `in_splits`; receive `out_splits` (gloo-safe single-tensor form)."""
        if self._sizes[group] == 1:
            return t
        t = t.contiguous()
        out = torch.empty((sum(out_splits),) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        self.stats.record(group, "all_to_all", _nbytes(t))
        dist.all_to_all_single(out, t, out_splits, in_splits, group=self._group(group))
        return out
