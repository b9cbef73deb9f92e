"""What the trainer calls around the parallel model: batch sharding, gradient sync, clipping.

Gradient contract: the trainer backprops `loss_sum / global_count` on every rank, where `loss_sum` is
this rank's batch shard only.  The layers already sum the 3D weight gradients over Z (reduce-scatter
in backward); `sync_gradients` then sums what is left -- 3D weights over `data`, every other
parameter (norms, biases that follow full-width outputs, position embeddings) over `batch` (Z x
data) -- so each rank ends with exactly the serial gradient of its piece of every parameter.

It also holds what `parallelize` did to a model, in one typed handle: `engine_of(model) ->
EngineHandle | None`.  The engine keeps no module-level state, so the model carries its own: the
grid it is sharded over, the parallel plan it applied (which module became which layer; the mode and
pair orientation), the options and the scheduler its layers call, and the layout of every sharded
parameter by name. All of it sits in one frozen `EngineHandle`, stored in one attribute by
`parallelize` (`set_engine`) and read back only through `engine_of`: a plain model has none, so "is
this model sharded by the engine?" is `engine_of(model) is not None` (`axonn.is_parallel`).
Everything that needs a parameter's layout (gradient sync, norms, state dicts, checkpoints) takes
the model and reads `layouts_of(model)`: the handle's, or, for a model built from ParallelLinear /
ParallelEmbedding directly, the layouts those layers own.  Nothing is tagged on the parameters themselves.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from axonn.grid import ProcessGrid
from axonn.layers.layout import ParamSpec
from axonn.layers.modules import ParallelEmbedding, ParallelLinear
from axonn.pairing import PairAxes
from axonn.parallel_plan import ParallelPlan
from axonn.schedule import EngineOptions, Scheduler, grad_buckets
from memorize_core import fail

_ATTR = "_axonn_engine"  # the one attribute parallelize sets on a model


@dataclass(frozen=True)
class EngineHandle:
    """The engine state of one parallelized model (set once by `parallelize`, never changed)."""

    grid: ProcessGrid
    mode: str  # easy or paired
    pair_axes: PairAxes | None  # the paired blocks' orientation (None in easy mode)
    plan: ParallelPlan  # which module became which parallel layer (mode and pair_axes are its)
    options: EngineOptions
    scheduler: Scheduler  # the one every parallel layer of the model calls
    # state-dict name -> its sharding, tied aliases included; a name that is absent: replicated
    layouts: Mapping[str, ParamSpec]


def engine_of(model: nn.Module) -> EngineHandle | None:
    """The engine handle of a model `parallelize` sharded; None for a plain model."""
    handle = getattr(model, _ATTR, None)
    return handle if isinstance(handle, EngineHandle) else None


def set_engine(model: nn.Module, handle: EngineHandle) -> None:
    """Store `handle` on `model` (parallelize's last step)."""
    setattr(model, _ATTR, handle)


def module_layouts(model: nn.Module) -> dict[str, ParamSpec]:
    """Every sharded parameter's layout by state-dict name (tied aliases included), from the
    parallel layers that own them."""
    out = {}
    for name, m in model.named_modules(remove_duplicate=False):
        if isinstance(m, (ParallelLinear, ParallelEmbedding)):
            out.update({f"{name}.{key}" if name else key: spec for key, spec in m.layouts().items()})
    return out


def layouts_of(model: nn.Module) -> Mapping[str, ParamSpec]:
    """State-dict name -> layout of every sharded tensor of the model: its handle's, or for a model
    built from parallel layers directly (no parallelize), theirs; {} for a plain model."""
    handle = engine_of(model)
    return handle.layouts if handle is not None else module_layouts(model)


def named_layouts(model: nn.Module) -> Iterator[tuple[str, torch.Tensor, ParamSpec | None]]:
    """(first state-dict name, tensor, layout or None when replicated) of every distinct parameter and
    persistent buffer; a plain model's are all replicated."""
    layouts = layouts_of(model)
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            yield name, t, layouts.get(name)


def param_layouts(model: nn.Module) -> list[tuple[nn.Parameter, ParamSpec | None]]:
    """(parameter, layout or None when replicated) for every distinct parameter, in registration order."""
    layouts = layouts_of(model)
    return [(p, layouts.get(name)) for name, p in model.named_parameters()]


def is_parallel(model: nn.Module) -> bool:
    """True when `axonn.parallelize` has sharded this model (its layers are the engine's)."""
    return engine_of(model) is not None


def model_grid(model: nn.Module, grid: ProcessGrid | None = None) -> ProcessGrid:
    """`grid` if given, else the grid the model is sharded over, else the serial grid on its device
    (the one place a model's grid is looked up)."""
    if grid is not None:
        return grid
    handle = engine_of(model)
    if handle is not None:
        return handle.grid
    first = next(model.parameters(), None)
    return ProcessGrid.serial(device=first.device if first is not None else "cpu")


def batch_shard(grid: ProcessGrid) -> tuple[int, int]:
    """(number of batch slices, this rank's slice index); (1, 0) on the serial grid."""
    return grid.batch_shards, grid.batch_shard_index


def shard_batch(batch: torch.Tensor | Mapping[str, torch.Tensor], grid: ProcessGrid) -> object:
    """This rank's contiguous slice of the rows of a global batch (a tensor or a dict of tensors)."""
    shards, index = batch_shard(grid)
    if shards == 1:
        return batch  # one slice: the batch itself (what a serial run trains on)
    if isinstance(batch, Mapping):
        return {k: shard_batch(v, grid) for k, v in batch.items()}
    rows = batch.shape[0]
    if rows % shards:
        raise fail("batch_size", rows, f"must be a multiple of z*data={shards} so every batch "
                   "shard gets the same number of rows")
    n = rows // shards
    return batch[index * n:(index + 1) * n]


def all_reduce_sum(tensor: torch.Tensor, grid: ProcessGrid, group: str = "batch") -> torch.Tensor:
    """Sum `tensor` in place over a named group of the grid (batch, data, world, x, ...); returns it.

    A tensor on another device than the grid's (CPU metrics under NCCL) takes a round trip."""
    if grid.size(group) == 1:
        return tensor
    if tensor.device != grid.device:
        moved = tensor.to(grid.device)
        grid.comm.all_reduce(moved, group)
        tensor.copy_(moved)
    else:
        grid.comm.all_reduce(tensor, group)
    return tensor


def grad_groups(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> the group `sync_gradients` sums its gradient over (data for 3D weights, else
    batch: Z x data)."""
    return {id(p): spec.grad_group if spec is not None else "batch" for p, spec in param_layouts(model)}


def sync_gradients(model: nn.Module, grid: ProcessGrid | None = None, bucket_mb: float | None = None) -> None:
    """Sum the gradients the layers have not reduced yet (data for 3D weights, Z x data for the rest).

    With `EngineOptions(bucket_grads=True)` the buckets were launched during backward: this waits
    for them.  Otherwise it flattens the same buckets (same order, same size: same bits) and
    all-reduces them now.  `bucket_mb` defaults to the model's EngineOptions.bucket_mb."""
    grid = model_grid(model, grid)
    if grid.world_size == 1 and not is_parallel(model):
        return  # a plain model in one process: nothing to sum
    handle = engine_of(model)
    sched = handle.scheduler if handle is not None else None
    if sched is not None:
        sched.finish_backward()  # no-op unless a backward ended outside autograd's callback
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:  # keep every rank's collective sequence identical
            p.grad = torch.zeros_like(p)
    if sched is not None and sched.bucketer is not None:
        sched.bucketer.wait_all()
        return
    if bucket_mb is None:
        bucket_mb = (handle.options if handle is not None else EngineOptions()).bucket_mb
    groups = grad_groups(model)
    for group, bucket in grad_buckets(params, lambda p: groups[id(p)], grid.sizes, bucket_mb):
        grads = [p.grad for p in bucket]
        flat = _flatten_dense_tensors(grads)
        grid.comm.all_reduce(flat, group)
        for g_old, g_new in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g_old.copy_(g_new)


@contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Backward passes inside do not launch gradient all-reduces (micro-batches before the last)."""
    handle = engine_of(model)
    bucketer = handle.scheduler.bucketer if handle is not None else None
    if bucketer is None:
        yield
        return
    bucketer.enabled = False
    try:
        yield
    finally:
        bucketer.enabled = True


def _sq_norm_sum(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of the pieces' squared L2 norms, in fp64 on `device`: each piece's norm accumulated in
    fp32 (fp64 for fp64 gradients; an fp64 reduction of fp32 values is 2.4x slower on CPU), by torch's
    multi-tensor norm (a few kernel launches on a GPU, not four per parameter), summed in fp64."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    wide = [g for g in grads if g.dtype == torch.float64]
    rest = [g for g in grads if g.dtype != torch.float64]
    for group, dtype in ((wide, torch.float64), (rest, torch.float32)):
        if group:
            norms = torch._foreach_norm(group, 2, dtype=dtype)
            total += torch.stack([n.to(device) for n in norms]).double().square().sum()
    return total


_TENSOR = ("x", "y", "z")


@torch.no_grad()
def grad_norm(model: nn.Module, grid: ProcessGrid | None = None) -> float:
    """Global L2 norm of the model's gradients over the whole grid, each distinct piece counted once.

    Call it after `sync_gradients`: data replicas then hold identical gradients, so each replica
    sums its own tensor group (X x Y x Z) and gets the same bits; no collective over `data`.
    `grid` defaults to the model's (pass it for a plain replica trained over several ranks)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"grad_norm/clip_grad_norm_ take the model (its layouts say which pieces each rank "
                        f"holds), not {type(model).__name__}; pass the nn.Module")
    grid = model_grid(model, grid)
    first = all(grid.coord(d) == 0 for d in _TENSOR)  # counts the replicated parameters
    total = _sq_norm_sum([p.grad for p, spec in param_layouts(model) if p.grad is not None
                          and (spec.counted_here(_TENSOR) if spec is not None else first)], grid.device)
    grid.comm.all_reduce(total, "tensor")
    return float(total.sqrt())


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, grid: ProcessGrid | None = None) -> float:
    """Scale the model's gradients so the global norm (over the grid) is at most `max_norm`; returns
    the norm before."""
    norm = grad_norm(model, grid)
    coef = float(max_norm) / (norm + 1e-6)
    if coef < 1.0:  # every gradient times coef, by torch's multi-tensor kernel on a GPU
        torch._foreach_mul_([p.grad for p in model.parameters() if p.grad is not None], coef)
    return norm
