"""The schedule of the engine's collectives (axonn/comm.py counts and runs them): overlap of
communication with compute, one `Scheduler` per parallelized model, switched by `EngineOptions` (the
engine's speed switches, given to `parallelize`).

* Prefetch: the Z all-gather of the next layer's weight starts (asynchronously) as soon as this
  layer's weight is in hand.  The scheduler learns which gather follows which -- keyed by layer,
  phase (forward, forward recomputed inside backward, backward), grad mode and dtype -- so forward,
  backward and activation checkpointing all chain without the model telling it the order.  A
  prefetch whose layer is not the one asked for next, or whose weight changed since (its
  `_version`), is waited for and dropped: a wrong guess costs bytes, never correctness.  Nothing is
  prefetched from backward into the next forward (the optimizer step sits between them).
* Asynchronous reduce-scatter: a layer's weight-gradient reduce-scatter over Z runs while the next
  (earlier) layer computes its backward; it is waited for after that layer's GEMMs and added to
  `.grad` then (tied weights: at the end of backward, so their two contributions are summed first,
  as autograd does); a callback at the end of backward flushes the rest.
* Bucketed gradient all-reduce (`Bucketer`): gradient hooks start the data / batch all-reduces of a
  bucket as soon as its last gradient is ready; `axonn.sync_gradients` waits for them.  A
  bucket's gradients are copied into one flat buffer and become views into it (as with DDP's
  `gradient_as_bucket_view`), so the reduced sums need no copy back; the buffer is not kept
  between steps (no memory beyond the gradients' own once `zero_grad` drops them).

Every switch changes when a collective runs, never what it computes: results are bit-identical.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from axonn.comm import Comm
from axonn.gemm import GemmTuner, default_enabled


@dataclass(frozen=True)
class EngineOptions:
    """Speed switches of the engine (each leaves the numbers unchanged); pass to `parallelize`."""

    prefetch: bool = True            # Z all-gather of the next layer's weight during this layer
    async_grad_reduce: bool = True   # weight-gradient reduce-scatter over Z in the background
    overlap_dx: bool = True          # backward dX all-reduce runs behind the dW GEMM
    bucket_grads: bool = True        # data/batch all-reduces launched by gradient hooks in backward
    bucket_mb: float = 25.0          # gradient all-reduce bucket size (both sync paths)
    gemm_tuning: bool | str = "auto"  # time NN/NT/TN per GEMM shape; "auto": on CUDA only

    @classmethod
    def no_overlap(cls, **kw: Any) -> EngineOptions:
        """Every collective blocking, in program order (the reference path)."""
        base = dict(prefetch=False, async_grad_reduce=False, overlap_dx=False, bucket_grads=False)
        return cls(**{**base, **kw})

    def describe(self) -> dict[str, Any]:
        """The options as a plain dict (for logs and benchmark JSON)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _phase(backward: bool) -> str:
    if backward:
        return "bwd"
    # a forward run inside a backward pass is activation-checkpoint recomputation
    return "recompute" if torch._C._current_graph_task_id() != -1 else "fwd"


class Scheduler:
    """Per-model state of the overlapped schedule: prefetched gathers and pending gradient reductions."""

    def __init__(self, comm: Comm, options: EngineOptions, device: torch.device) -> None:
        self.comm, self.options = comm, options
        self.gemm = GemmTuner(enabled=default_enabled(device, options.gemm_tuning))
        self._layers: dict[int, tuple[nn.Parameter, int]] = {}   # layer id -> (weight, rows kept)
        self._users: dict[int, int] = {}                          # id(weight) -> number of layers
        self._next: dict[tuple, tuple] = {}                       # gather key -> the gather after it
        self._last: tuple | None = None
        self._ahead: tuple | None = None                          # (key, version, out, work)
        self._pending: list[tuple[nn.Parameter, torch.Tensor, Any]] = []
        self._held: list[tuple[nn.Parameter, torch.Tensor]] = []  # tied weights: summed at the end
        self._task: int | None = None
        self.bucketer: Bucketer | None = None
        # layer id -> its gathered block, held for a whole evaluation (axonn.inference.keep_gathered)
        self.resident: dict[int, torch.Tensor] = {}
        self.prefetch_hits = 0
        self.prefetch_misses = 0

    def register(self, layer: nn.Module, weight: nn.Parameter, rows: int) -> int:
        """Enrol a layer whose weight is Z-gathered; returns its key for the Functions."""
        key = id(layer)
        self._layers[key] = (weight, rows)
        self._users[id(weight)] = sum(1 for w, _ in self._layers.values() if w is weight)
        return key

    def knows(self, layer: int) -> bool:
        """Whether `layer` was registered (a deep copy of a model has unregistered layers)."""
        return layer in self._layers

    def __deepcopy__(self, memo: dict) -> Scheduler:
        return self  # holds process groups; a copied model's layers are simply not registered

    # -- Z all-gathers -------------------------------------------------------------------------
    def gather(self, layer: int, shard: torch.Tensor, rows: int, dtype: torch.dtype,
               backward: bool = False, *, grad_mode: bool = True) -> torch.Tensor:
        """The full weight block of `layer` (shard cast to `dtype`), prefetching the next one.

        `grad_mode`: whether the layer was called with grad enabled (its caller's mode: inside
        Function.forward grad is always off), so evaluation chains learn their own order."""
        comm = self.comm
        held = self.resident.get(layer)
        if held is not None:
            return held if held.dtype == dtype else held.to(dtype)
        if not self.options.prefetch or comm.size("z") == 1:
            return comm.all_gather(shard.to(dtype), "z", dim=0)[:rows]
        key = (layer, _phase(backward), backward or grad_mode, dtype)
        if self._last is not None and not (self._last[1] == "bwd" and key[1] == "fwd"):
            self._next[self._last] = key
        self._last = key
        w = None
        if self._ahead is not None:
            akey, version, out, work = self._ahead
            self._ahead = None
            work.wait()
            if akey == key and version == self._layers[layer][0]._version:
                w = out[:rows]
                self.prefetch_hits += 1
            else:
                self.prefetch_misses += 1
        if w is None:
            w = comm.all_gather(shard.to(dtype), "z", dim=0)[:rows]
        nxt = self._next.get(key)
        if nxt is not None and nxt[0] in self._layers:
            weight, _ = self._layers[nxt[0]]
            out, work = comm.all_gather_async(weight.detach().to(nxt[3]), "z")
            self._ahead = (nxt, weight._version, out, work)
        return w

    def hold_gathered(self) -> int:
        """Gather every layer's Z-split block once and keep it (forward-only use); returns the bytes held.

        Until `release_gathered`, forwards run without Z collectives; tied layers share one block."""
        by_weight: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for layer, (weight, rows) in self._layers.items():
                if id(weight) not in by_weight:
                    by_weight[id(weight)] = self.comm.all_gather(weight.detach(), "z", dim=0)[:rows]
                self.resident[layer] = by_weight[id(weight)]
        return sum(t.numel() * t.element_size() for t in by_weight.values())

    def release_gathered(self) -> None:
        """Drop the blocks `hold_gathered` kept: forwards gather per layer again."""
        self.resident.clear()

    # -- weight-gradient reduce-scatters -------------------------------------------------------
    def defers_grads(self) -> bool:
        """Whether weight-gradient reduce-scatters run in the background (and .grad is set here)."""
        return self.options.async_grad_reduce and self.comm.size("z") > 1

    def defer(self, layer: int, out: torch.Tensor, work: Any) -> None:
        """Hold a started reduce-scatter of `layer`'s weight gradient until a later wait point."""
        weight, _ = self._layers[layer]
        self._pending.append((weight, out, work))
        task = torch._C._current_graph_task_id()
        if task != -1 and task != self._task:
            self._task = task
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def settle(self) -> None:
        """Wait for the pending reduce-scatters and add them to `.grad` (call after local GEMMs)."""
        pending, self._pending = self._pending, []
        for weight, out, work in pending:
            work.wait()
            if self._users.get(id(weight), 1) > 1:
                self._held.append((weight, out))
            else:
                self._accumulate(weight, out)

    def finish_backward(self) -> None:
        """End of a backward pass: flush reductions; tied weights get their contributions summed."""
        self.settle()
        self._task = None
        held, self._held = self._held, []
        sums: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}
        for weight, g in held:
            prev = sums.get(id(weight))
            sums[id(weight)] = (weight, g if prev is None else prev[1] + g)
        for weight, g in sums.values():
            self._accumulate(weight, g)

    def _accumulate(self, weight: nn.Parameter, g: torch.Tensor) -> None:
        with torch.no_grad():
            if weight.grad is None:
                weight.grad = g
            else:
                weight.grad += g
        if self.bucketer is not None:
            self.bucketer.ready(weight)


@dataclass
class _Bucket:
    group: str
    params: list[nn.Parameter]
    ready: int = 0
    flat: torch.Tensor | None = None  # this step's buffer (the gradients are views into it)
    work: Any = None

    def gather(self) -> torch.Tensor:
        """Copy the gradients into one new flat buffer and make each gradient a view into it, so
        the all-reduced sums need no copy back; the buffer lives as long as the gradients do."""
        p0 = self.params[0]
        self.flat = torch.empty(sum(p.numel() for p in self.params), dtype=p0.dtype, device=p0.device)
        at = 0
        for p in self.params:
            view = self.flat[at:at + p.numel()].view_as(p)
            at += p.numel()
            if p.grad is None:  # an unused parameter: every rank still sends the same buffer
                view.zero_()
            else:
                view.copy_(p.grad)
            p.grad = view  # frees autograd's tensor: at most one bucket is held twice at a time
        return self.flat


def grad_buckets(params: list[nn.Parameter], group_of: Any, sizes: dict[str, int],
                 bucket_mb: float) -> list[tuple[str, list[nn.Parameter]]]:
    """Buckets (group, params) in reverse parameter order (about the order backward finishes them)."""
    limit = int(bucket_mb * 2**20)
    open_: dict[tuple, list[nn.Parameter]] = {}
    size: dict[tuple, int] = {}
    out: list[tuple[str, list[nn.Parameter]]] = []
    for p in reversed(params):
        group = group_of(p)
        if sizes[group] == 1:
            continue
        k = (group, p.dtype, p.device)
        open_.setdefault(k, []).append(p)
        size[k] = size.get(k, 0) + p.numel() * p.element_size()
        if size[k] >= limit:
            out.append((group, open_.pop(k)))
            size[k] = 0
    out.extend((k[0], ps) for k, ps in open_.items())
    return out


class Bucketer:
    """Starts each gradient bucket's all-reduce when its last gradient arrives during backward."""

    def __init__(self, comm: Comm, buckets: list[tuple[str, list[nn.Parameter]]]) -> None:
        self.comm = comm
        self.buckets = [_Bucket(g, ps) for g, ps in buckets]
        self._of = {id(p): b for b in self.buckets for p in b.params}
        self.enabled = True  # False inside `no_sync` (micro-batches before the last)
        self._hooks = []

    def hook(self, params: list[nn.Parameter], deferred: set[int]) -> None:
        """Register post-accumulate hooks on the params autograd accumulates itself."""
        for p in params:
            if id(p) in self._of and id(p) not in deferred:
                self._hooks.append(p.register_post_accumulate_grad_hook(self.ready))

    def unhook(self) -> None:
        """Remove the hooks (before the model's trainable parameters change and buckets are rebuilt)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def ready(self, p: nn.Parameter) -> None:
        """One gradient is final for this backward: launch its bucket once all of it is."""
        if not self.enabled:
            return
        b = self._of.get(id(p))
        if b is None:
            return
        if b.work is not None:
            raise RuntimeError("a gradient bucket was all-reduced already in this step: with "
                               "EngineOptions(bucket_grads=True) run every micro-batch but the last "
                               "inside `with axonn.engine.no_sync(model):`")
        b.ready += 1
        if b.ready == len(b.params):
            self._launch(b)

    def _launch(self, b: _Bucket) -> None:
        b.work = self.comm.all_reduce(b.gather(), b.group, async_op=True)

    def wait_all(self) -> None:
        """Launch what backward did not (in bucket order) and wait for all: the gradients are
        views into the reduced buffers, so the sums need no copy back."""
        for b in self.buckets:
            if b.work is None:
                self._launch(b)
        for b in self.buckets:
            b.work.wait()
            b.ready, b.flat, b.work = 0, None, None

    def pending(self) -> Iterator[_Bucket]:
        """Buckets whose all-reduce is in flight."""
        return (b for b in self.buckets if b.work is not None)
