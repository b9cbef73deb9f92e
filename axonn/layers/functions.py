"""Autograd Functions of the 3D engine; each backward runs the mirror collective of its forward.

Convention ("replicated activations"): a full-width activation is identical on every rank of its
X and Y groups, and so is its gradient; the batch is sharded over Z x data.  Hence:

  SplitLastDim   fwd: keep my 1/p slice of the last dim     bwd: all-gather the slices
  GatherLastDim  fwd: all-gather along the last dim         bwd: keep my slice
  ParallelMatmul fwd: all-gather W over Z, GEMM,            bwd: all-gather W over Z, dX GEMM +
                      all-reduce the output over the             all-reduce over the output-split
                      input-split axis                           axis, dW GEMM + reduce-scatter over Z
  VocabEmbedding fwd: all-gather W over Z, masked lookup,   bwd: scatter-add dW, reduce-scatter over Z
                      all-reduce over the vocab-split axis       (vocab all-reduce mirrors to identity)

The Functions hold no state beyond `ctx`; the grid's Comm counts every byte.  With a `Scheduler`
(axonn/schedule.py, one per parallelized model) the same collectives run overlapped: Z gathers
prefetched one layer ahead, weight-gradient reduce-scatters finished in the background; without
one (sched=None) every collective blocks in program order.  The local GEMMs go through the
scheduler's GEMM tuner (axonn/gemm.py).

The loss is here too: `VocabParallelCrossEntropy`, per-token CE over logits whose vocabulary is
split over Y, honouring ignore_index.  The parallel LM head returns logits of shape [..., vocab/Y]
(this rank's vocab slice), wrapped in `VocabShardedLogits` so that slicing/reshaping keeps the
marker and so that a plain softmax, argmax or F.cross_entropy on them fails loudly instead of
silently using 1/Y of the vocabulary.  With Y = 1 the logits are full and unmarked.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from axonn.comm import Comm
from axonn.gemm import GemmTuner
from axonn.grid import ProcessGrid
from memorize_core import IGNORE_INDEX

_PLAIN = GemmTuner(enabled=False, persist=False)  # stateless when disabled: the untuned path


def gather_weight(comm: Comm, w_shard: torch.Tensor, rows: int) -> torch.Tensor:
    """All-gather a Z-split weight block and drop the padding rows."""
    return comm.all_gather(w_shard, "z", dim=0)[:rows]


def scatter_weight_grad(comm: Comm, dw: torch.Tensor, local_rows: int) -> Any:
    """Pad a block gradient to Z x local_rows rows and reduce-scatter it over Z: (grad, work)."""
    pad = local_rows * comm.size("z") - dw.shape[0]
    if pad:
        dw = torch.cat([dw, dw.new_zeros((pad,) + tuple(dw.shape[1:]))])
    return comm.reduce_scatter(dw, "z", async_op=True)


def wants_grad(ctx: Any, i: int) -> bool:
    """Whether this backward must produce the gradient of input `i`: needed at forward, and wanted by
    the running backward (an autograd.grad towards activations only, e.g. a pass that measures
    per-example norms, skips the weight GEMM and its Z reduce-scatter)."""
    if not ctx.needs_input_grad[i]:
        return False
    node = ctx.next_functions[i][0]
    return node is None or torch._C._will_engine_execute_node(node)


class SplitLastDim(torch.autograd.Function):
    """Keep this rank's slice of the last dim (no communication); backward all-gathers."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, group: str, index: int) -> torch.Tensor:
        ctx.comm, ctx.group = comm, group
        p = comm.size(group)
        if p == 1:
            return x
        n = x.shape[-1] // p
        return x[..., index * n:(index + 1) * n].contiguous()

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        return ctx.comm.all_gather(dy.contiguous(), ctx.group, dim=-1), None, None, None


class GatherLastDim(torch.autograd.Function):
    """All-gather along the last dim; backward keeps this rank's slice (the gradient is replicated)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, group: str, index: int) -> torch.Tensor:
        ctx.comm, ctx.group, ctx.index = comm, group, index
        return comm.all_gather(x, group, dim=-1)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        p = ctx.comm.size(ctx.group)
        if p == 1:
            return dy, None, None, None
        n = dy.shape[-1] // p
        return dy[..., ctx.index * n:(ctx.index + 1) * n].contiguous(), None, None, None


def compute_dtype(x: torch.Tensor, w: torch.Tensor) -> torch.dtype:
    """The GEMM dtype: the autocast dtype when autocast is on for this device, else the weight's."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind) and w.is_floating_point():
        return torch.get_autocast_dtype(kind)
    return w.dtype


def _gather(comm: Comm, sched: Any, layer: int, w_shard: torch.Tensor, rows: int,
            dtype: torch.dtype, backward: bool = False, grad_mode: bool = True) -> torch.Tensor:
    if sched is not None and sched.knows(layer):
        return sched.gather(layer, w_shard, rows, dtype, backward, grad_mode=grad_mode)
    return gather_weight(comm, w_shard.to(dtype), rows)


def _reduce_weight_grad(comm: Comm, sched: Any, layer: int, dw: torch.Tensor,
                        local_rows: int) -> torch.Tensor | None:
    """Reduce-scatter dW over Z: returned at once, or (scheduled) added to .grad later (None here)."""
    deferred = sched is not None and sched.knows(layer) and sched.defers_grads()
    if deferred:
        sched.settle()  # the previous layer's reduce-scatter ran behind this layer's GEMMs
    dw_shard, work = scatter_weight_grad(comm, dw, local_rows)
    if deferred:
        sched.defer(layer, dw_shard, work)
        return None
    work.wait()
    return dw_shard


class ParallelMatmul(torch.autograd.Function):
    """y = x @ W.T for a Z-split weight block; x is split over `in_group`, y over `out_group`.

    Under autocast the shard is cast before the Z all-gather (half the bytes) and both passes run
    in the autocast dtype with explicit casts, so backward needs no autocast state; the weight
    gradient is reduce-scattered in the parameter's dtype (fp32 master weights stay fp32)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w_shard: torch.Tensor, comm: Comm, in_group: str,
                out_group: str, rows: int, sched: Any = None, layer: int = 0,
                grad_mode: bool = True) -> torch.Tensor:
        dtype = compute_dtype(x, w_shard)
        gemm = sched.gemm if sched is not None else _PLAIN
        with torch.autocast(x.device.type, enabled=False):
            w = _gather(comm, sched, layer, w_shard, rows, dtype, grad_mode=grad_mode)
            xs = x.to(dtype)
            y = gemm.linear(xs, w)
        comm.all_reduce(y, in_group)  # partial sums over the input slices
        # Backward needs the input and the block in the compute dtype: keep the cast input (not the
        # fp32 one: half the bytes, no second cast) and, where nothing is gathered (Z = 1), the cast
        # block too, as autocast's weight cache does; a Z-split block is re-gathered in backward.
        keep_w = comm.size("z") == 1
        ctx.save_for_backward(xs, w_shard, w if keep_w else None)
        ctx.comm, ctx.in_group, ctx.out_group, ctx.rows, ctx.dtype = comm, in_group, out_group, rows, dtype
        ctx.sched, ctx.layer, ctx.x_dtype = sched, layer, x.dtype
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        xs, w_shard, w = ctx.saved_tensors
        comm, dtype, sched = ctx.comm, ctx.dtype, ctx.sched
        gemm = sched.gemm if sched is not None else _PLAIN
        overlap_dx = sched is None or sched.options.overlap_dx
        if w is None:  # Z-split: re-gather instead of keeping the gathered block alive since forward
            w = _gather(comm, sched, ctx.layer, w_shard, ctx.rows, dtype, backward=True)
        dy = dy.to(dtype)  # no forced copy: the GEMMs take strided operands, reshape copies if it must
        dx, work = None, None
        if ctx.needs_input_grad[0]:
            dx = gemm.matmul(dy, w).to(ctx.x_dtype)
            # async: the all-reduce runs behind the dW GEMM below
            work = comm.all_reduce(dx, ctx.out_group, async_op=overlap_dx)
        dw_shard = None
        if wants_grad(ctx, 1):
            dw = gemm.mm(dy.reshape(-1, dy.shape[-1]).t(), xs.reshape(-1, xs.shape[-1])).to(w_shard.dtype)
            dw_shard = _reduce_weight_grad(comm, sched, ctx.layer, dw, w_shard.shape[0])
        if work is not None:
            work.wait()
        return dx, dw_shard, None, None, None, None, None, None, None


class VocabEmbedding(torch.autograd.Function):
    """Lookup in a vocab-split (rows over `vocab_group`), Z-split table; partial rows summed."""

    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, w_shard: torch.Tensor, comm: Comm, vocab_group: str,
                rows: int, vocab_start: int, padding_idx: int | None, sched: Any = None,
                layer: int = 0, grad_mode: bool = True) -> torch.Tensor:
        w = _gather(comm, sched, layer, w_shard, rows, w_shard.dtype, grad_mode=grad_mode)
        ctx.whole = comm.size(vocab_group) == 1 and padding_idx is None
        if ctx.whole:  # one vocab shard owns every token: no mask to apply (same bits, less work)
            out = torch.nn.functional.embedding(ids, w)
            ctx.save_for_backward(ids, ids)
            ctx.comm, ctx.rows, ctx.local_rows = comm, rows, w_shard.shape[0]
            ctx.w_shape = (rows, w_shard.shape[1])
            ctx.sched, ctx.layer = sched, layer
            return out
        local = ids - vocab_start
        mask = (local >= 0) & (local < rows)
        local = torch.where(mask, local, torch.zeros_like(local))
        out = torch.nn.functional.embedding(local, w) * mask.unsqueeze(-1).to(w.dtype)
        comm.all_reduce(out, vocab_group)  # exactly one vocab shard owns each token
        if padding_idx is not None:  # the serial nn.Embedding never updates the padding row
            p = padding_idx - vocab_start
            mask = mask & (local != p) if 0 <= p < rows else mask
        ctx.save_for_backward(local, mask)
        ctx.comm, ctx.rows, ctx.local_rows = comm, rows, w_shard.shape[0]
        ctx.w_shape = (rows, w_shard.shape[1])
        ctx.sched, ctx.layer = sched, layer
        return out

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        if not wants_grad(ctx, 1):
            return (None,) * 10
        local, mask = ctx.saved_tensors
        dw = dy.new_zeros(ctx.w_shape)
        if ctx.whole:
            dw.index_add_(0, local.reshape(-1), dy.reshape(-1, dy.shape[-1]))
        else:
            dw.index_add_(0, local[mask], dy[mask])
        dw_shard = _reduce_weight_grad(ctx.comm, ctx.sched, ctx.layer, dw, ctx.local_rows)
        return None, dw_shard, None, None, None, None, None, None, None, None


# -- vocab-parallel cross-entropy -------------------------------------------------------------------

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
