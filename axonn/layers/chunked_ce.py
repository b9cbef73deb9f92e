"""The LM head fused with its cross-entropy, a chunk of tokens at a time: the full [tokens, vocab]
logits never exist, only one [chunk, vocab/Y] block of them.

`ChunkedHeadCrossEntropy` takes the final hidden states (full-width, batch-sharded: the engine's
replicated-activation convention) and the head's weight shard (rows = vocabulary split over Y and
then Z, columns = hidden split over X; a serial nn.Linear head is the 1x1x1x1 case) and returns each
token's CE. Per chunk, forward: logits = h[:, x-slice] @ W^T (all-reduce over X: partial sums over
the hidden slices), then the log-sum-exp of this rank's vocabulary slice reduced over Y (one max,
one [sum-exp, target-logit] all-reduce, as `VocabParallelCrossEntropy`); only the per-token
log-sum-exp (fp32, [tokens]) is kept. Backward recomputes each chunk's logits, forms
softmax - one-hot scaled by the incoming per-token gradient, and runs the two GEMMs of the head's
backward on it: dh (all-reduced over Y once for all chunks, then all-gathered over X, mirroring the
split of h) and dW (accumulated in fp32 over the chunks, reduce-scattered over Z once).

On CUDA the per-chunk element-wise work (max, exp, sum, target pick; softmax - one-hot, the cast)
is one torch.compile'd kernel each way (`_fused`): the [chunk, vocab] block is then read in the
GEMM dtype once per pass instead of being cast, shifted, exponentiated and summed in fp32 passes.

Precision: the GEMMs run in the compute dtype (bf16 under autocast, as the unchunked head), every
softmax sum in fp32 or wider (fp64 stays fp64, so the fp64 tests are exact). ignore_index targets get
loss 0 and no gradient. Cost: one extra head GEMM per step (the recompute) against never writing
or reading the [tokens, vocab] logits, their fp32 copy and their softmax; the trainer pays it only
under a gradient hook that needs each token's loss (else it takes the sum op below).

`ChunkedHeadCrossEntropySum` (`chunked_cross_entropy_sum`) is the same head when only a weighted SUM
of the token losses is backpropagated (the trainer's loss without a per-token gradient hook; goldfish's
kept tokens are the weights): the upstream gradient is then one scalar, known up to that factor at
forward time, so each chunk's softmax - one-hot and its two head-backward GEMMs run right after its
logits, and backward only scales dh and dW and runs the collectives. No recompute: the head costs
the three GEMMs of the unchunked head, and neither the hidden states nor the weight block are kept
for backward.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.utils._triton import has_triton

from axonn.grid import ProcessGrid
from axonn.layers.functions import _at_least_fp32, _gather, _reduce_weight_grad
from memorize_core import IGNORE_INDEX


def _logits(xs: torch.Tensor, w: torch.Tensor, grid: ProcessGrid) -> torch.Tensor:
    """One chunk's logits over this rank's vocabulary slice in the GEMM dtype (all-reduced over X)."""
    y = xs @ w.t()
    grid.comm.all_reduce(y, "x")  # partial sums over the hidden slices, in the GEMM dtype as the head
    return y


def _chunk_stats(y: torch.Tensor, idx: torch.Tensor, own: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum of exp(logit - max), target logit - max, max) of one chunk whose vocabulary is whole (Y = 1)."""
    lf = _at_least_fp32(y)
    gmax = lf.max(dim=-1).values
    shifted = lf - gmax.unsqueeze(-1)
    pick = shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * own
    return shifted.exp().sum(dim=-1), pick, gmax


def _softmax_grad(y: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, idx: torch.Tensor,
                  own: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """d(sum_i g_i CE_i)/d logits of one chunk: (softmax - one-hot) * g, cast to the GEMM dtype."""
    grad = (_at_least_fp32(y) - lse.unsqueeze(-1)).exp() * g.unsqueeze(-1)
    grad = grad.scatter_add(-1, idx.unsqueeze(-1), (-g * own).unsqueeze(-1))
    return grad.to(dtype)


_FP32_OUT = {"ok": True}  # whether addmm with out_dtype (bf16 GEMM, fp32 C) works on this build


def _accumulate(dw: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """dw += a @ b with dw in fp32 (or wider) and a, b in the GEMM dtype.

    On CUDA one cuBLAS call accumulates into the fp32 C (`addmm(out_dtype=fp32)`, beta = 1); a
    [V, chunk] x [chunk, H] product written in bf16 and added in a second pass would move the whole
    [V, H] block three more times per chunk (~12 ms a step at 1B x 16 chunks)."""
    if a.dtype == dw.dtype:
        dw.addmm_(a, b)
        return
    if dw.is_cuda and _FP32_OUT["ok"]:
        try:
            torch.addmm(dw, a, b, out_dtype=dw.dtype, out=dw)
            return
        except (RuntimeError, TypeError):  # an older build without the dtype overload
            _FP32_OUT["ok"] = False
    dw.add_(a @ b)


_COMPILED: dict[Any, Any] = {}  # fn -> its torch.compile'd twin; None once a compile failed


def _fused(fn: Any, device: torch.device) -> Any:
    """`fn` compiled into one kernel per chunk on CUDA (the [chunk, V] block is read once in the
    GEMM dtype instead of five fp32 passes); the eager `fn` elsewhere, or after a failed compile."""
    if device.type != "cuda" or not has_triton() or _COMPILED.get(fn, 0) is None:
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=False)

    def call(*args: Any) -> Any:
        try:
            return _COMPILED[fn](*args)
        except Exception as e:  # noqa: BLE001 -- any compiler failure: run eagerly, say so once
            warnings.warn(f"chunked cross-entropy: torch.compile of {fn.__name__} failed "
                          f"({type(e).__name__}); running it eagerly", stacklevel=2)
            _COMPILED[fn] = None
            return fn(*args)
    return call


def _operands(h: torch.Tensor, w_shard: torch.Tensor, targets: torch.Tensor, grid: ProcessGrid, rows: int,
              dtype: torch.dtype, ignore_index: int, sched: Any, layer: int, grad_mode: bool) -> tuple:
    """(the gathered weight block in the GEMM dtype, this rank's hidden slice in it, each target's
    local index / ownership / validity, the softmax accumulation dtype) of one head call."""
    w = _gather(grid.comm, sched, layer, w_shard, rows, dtype, grad_mode=grad_mode)
    x = h
    if grid.x > 1:  # this rank's slice of the hidden dim (the head's input split, SplitLastDim)
        n = h.shape[-1] // grid.x
        x = h[..., grid.x_rank * n:(grid.x_rank + 1) * n]
    n_local = w.shape[0]
    idx, own, valid = _target_index(targets, grid.y_rank * n_local, n_local, ignore_index)
    return w, x.to(dtype), idx, own, valid, _at_least_fp32(torch.empty((), dtype=dtype)).dtype


def _chunk_ce(y: torch.Tensor, idx: torch.Tensor, own: torch.Tensor, valid: torch.Tensor,
              grid: ProcessGrid, stats: Any, keep: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(each token's CE, its log-sum-exp) of one chunk's logits `y` over this rank's vocabulary slice
    (reduced over Y); `keep`: leave `y` intact (else an fp32 `y` is shifted and exponentiated in place)."""
    if grid.y == 1:  # the whole vocabulary here: one pass over the chunk's logits
        sum_exp, pick, gmax = stats(y, idx, own)
        sums = torch.stack([sum_exp, pick])
    else:
        lf = _at_least_fp32(y)
        gmax = lf.max(dim=-1).values
        grid.comm.all_reduce(gmax, "y", op="max")
        shifted = lf - gmax.unsqueeze(-1) if keep else lf.sub_(gmax.unsqueeze(-1))
        pick = shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * own
        sums = torch.stack([(shifted.exp() if keep else shifted.exp_()).sum(dim=-1), pick])
        grid.comm.all_reduce(sums, "y")  # [sum of exp, target logit] over the vocab slices, one call
    log_sum = sums[0].log()
    return (log_sum - sums[1]) * valid, log_sum + gmax  # the unchunked CE's exact expression


def _target_index(targets: torch.Tensor, start: int, n_local: int, ignore_index: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(local index of each target, whether this rank's slice owns it, whether it is supervised)."""
    local = targets - start
    valid = targets != ignore_index
    own = (local >= 0) & (local < n_local) & valid
    return torch.where(own, local, torch.zeros_like(local)), own, valid


class ChunkedHeadCrossEntropy(torch.autograd.Function):
    """Per-token CE of (h @ W^T) without the full logits: forward keeps only the log-sum-exp."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, w_shard: torch.Tensor, targets: torch.Tensor,
                grid: ProcessGrid, rows: int, chunk: int, dtype: torch.dtype, ignore_index: int,
                sched: Any = None, layer: int = 0, grad_mode: bool = True) -> torch.Tensor:
        with torch.autocast(h.device.type, enabled=False):
            w, xs, idx, own, valid, acc = _operands(h, w_shard, targets, grid, rows, dtype, ignore_index,
                                                    sched, layer, grad_mode)
            lse = torch.empty(targets.shape[0], dtype=acc, device=h.device)
            loss = torch.empty_like(lse)
            stats = _fused(_chunk_stats, h.device)
            for s in range(0, targets.shape[0], chunk):
                e = min(s + chunk, targets.shape[0])
                loss[s:e], lse[s:e] = _chunk_ce(_logits(xs[s:e], w, grid), idx[s:e], own[s:e], valid[s:e],
                                                grid, stats, keep=False)
        keep_w = grid.comm.size("z") == 1  # nothing to re-gather: keep the cast block, as ParallelMatmul
        ctx.save_for_backward(xs, w_shard, w if keep_w else None, idx, own, valid, lse)
        ctx.grid, ctx.rows, ctx.chunk, ctx.dtype = grid, rows, chunk, dtype
        ctx.sched, ctx.layer, ctx.h_dtype, ctx.h_width = sched, layer, h.dtype, h.shape[-1]
        return loss

    @staticmethod
    def backward(ctx: Any, dloss: torch.Tensor) -> tuple:
        xs, w_shard, w, idx, own, valid, lse = ctx.saved_tensors
        grid, dtype, comm = ctx.grid, ctx.dtype, ctx.grid.comm
        with torch.autocast(xs.device.type, enabled=False):
            if w is None:  # Z-split: re-gather instead of keeping the block alive since forward
                w = _gather(comm, ctx.sched, ctx.layer, w_shard, ctx.rows, dtype, backward=True)
            g = dloss.to(lse.dtype) * valid
            dx = torch.empty(xs.shape, dtype=ctx.h_dtype, device=xs.device)
            # fp32 accumulation of dW over the chunks (fp64 stays fp64)
            dw = torch.zeros(w.shape, dtype=lse.dtype, device=xs.device)
            softmax_grad = _fused(_softmax_grad, xs.device)
            for s in range(0, xs.shape[0], ctx.chunk):
                e = min(s + ctx.chunk, xs.shape[0])
                gd = softmax_grad(_logits(xs[s:e], w, grid), lse[s:e], g[s:e], idx[s:e], own[s:e], dtype)
                dx[s:e] = gd @ w
                _accumulate(dw, gd.t(), xs[s:e])
            comm.all_reduce(dx, "y")  # partial sums over the vocabulary slices
            if grid.x > 1:  # mirror of the forward slice: every X rank gets the full-width gradient
                dx = comm.all_gather(dx.contiguous(), "x", dim=-1)
            dw_shard = _reduce_weight_grad(comm, ctx.sched, ctx.layer, dw.to(w_shard.dtype), w_shard.shape[0])
        return dx, dw_shard, None, None, None, None, None, None, None, None, None


class ChunkedHeadCrossEntropySum(torch.autograd.Function):
    """sum_i weight_i CE_i of (h @ W^T) and the per-token CE (not differentiable), the gradients of the
    sum formed during forward, chunk by chunk (no recompute in backward)."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, w_shard: torch.Tensor, targets: torch.Tensor,
                weights: torch.Tensor | None, grid: ProcessGrid, rows: int, chunk: int, dtype: torch.dtype,
                ignore_index: int, sched: Any = None, layer: int = 0, grad_mode: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # no gradient work where none is asked for (grad off, or an input that needs none: a frozen head)
        need_dx, need_dw = (grad_mode and ctx.needs_input_grad[i] for i in (0, 1))
        with torch.autocast(h.device.type, enabled=False):
            w, xs, idx, own, valid, acc = _operands(h, w_shard, targets, grid, rows, dtype, ignore_index,
                                                    sched, layer, grad_mode)
            g = valid.to(acc) if weights is None else weights.to(acc) * valid
            loss = torch.empty(targets.shape[0], dtype=acc, device=h.device)
            dx = torch.empty(xs.shape, dtype=h.dtype, device=h.device) if need_dx else None
            dw = torch.zeros(w.shape, dtype=acc, device=h.device) if need_dw else None
            stats = _fused(_chunk_stats, h.device)
            softmax_grad = _fused(_softmax_grad, h.device)
            for s in range(0, targets.shape[0], chunk):
                e = min(s + chunk, targets.shape[0])
                y = _logits(xs[s:e], w, grid)
                loss[s:e], lse = _chunk_ce(y, idx[s:e], own[s:e], valid[s:e], grid, stats, keep=True)
                if need_dx or need_dw:  # d(sum_i g_i CE_i)/d logits, then the head's backward GEMMs
                    gd = softmax_grad(y, lse, g[s:e], idx[s:e], own[s:e], dtype)
                    if need_dx:
                        dx[s:e] = gd @ w
                    if need_dw:
                        _accumulate(dw, gd.t(), xs[s:e])
            total = (loss * g).sum()
        ctx.save_for_backward(dx, dw, w_shard)
        ctx.grid, ctx.rows, ctx.sched, ctx.layer = grid, rows, sched, layer
        ctx.mark_non_differentiable(loss)
        return total, loss

    @staticmethod
    def backward(ctx: Any, dtotal: torch.Tensor, _dloss: torch.Tensor | None) -> tuple:
        dx, dw, w_shard = ctx.saved_tensors
        grid, comm = ctx.grid, ctx.grid.comm
        dh = dw_shard = None
        with torch.autocast(w_shard.device.type, enabled=False):
            if dx is not None:
                dh = dx * dtotal.to(dx.dtype)
                comm.all_reduce(dh, "y")  # partial sums over the vocabulary slices
                if grid.x > 1:  # mirror of the forward slice: every X rank gets the full-width gradient
                    dh = comm.all_gather(dh.contiguous(), "x", dim=-1)
            if dw is not None:
                dw_shard = _reduce_weight_grad(comm, ctx.sched, ctx.layer,
                                               (dw * dtotal.to(dw.dtype)).to(w_shard.dtype), w_shard.shape[0])
        return dh, dw_shard, None, None, None, None, None, None, None, None, None, None


def chunked_cross_entropy_sum(h: torch.Tensor, w_shard: torch.Tensor, targets: torch.Tensor,
                              grid: ProcessGrid, chunk: int, *, weights: torch.Tensor | None = None,
                              rows: int | None = None, dtype: torch.dtype | None = None,
                              ignore_index: int = IGNORE_INDEX, sched: Any = None, layer: int = 0
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over tokens of weights * CE, differentiable; each token's CE [N], not differentiable) of
    the head `w_shard` on `h`, `chunk` tokens at a time, the gradient of the sum formed in forward.
    `weights` ([...] as targets, default 1 on every supervised token) are fixed numbers (a mask);
    everything else as `chunked_cross_entropy`."""
    flat, tgt, dtype = _checked(h, w_shard, targets, chunk, dtype)
    wts = None if weights is None else weights.reshape(-1)
    return ChunkedHeadCrossEntropySum.apply(flat, w_shard, tgt, wts, grid,
                                            rows if rows is not None else w_shard.shape[0], chunk, dtype,
                                            ignore_index, sched, layer, torch.is_grad_enabled())


def _checked(h: torch.Tensor, w_shard: torch.Tensor, targets: torch.Tensor, chunk: int,
             dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    """(h flattened to [N, H], targets to [N], the GEMM dtype) after the shape and chunk checks."""
    if chunk < 1:
        raise ValueError(f"chunk={chunk}: tokens per chunk must be >= 1")
    if h.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(h.shape)} and targets {tuple(targets.shape)} disagree; "
                         "pass hidden[:, :-1] with labels[:, 1:]")
    if dtype is None:
        kind = h.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else w_shard.dtype
    return h.reshape(-1, h.shape[-1]), targets.reshape(-1), dtype


def chunked_cross_entropy(h: torch.Tensor, w_shard: torch.Tensor, targets: torch.Tensor,
                          grid: ProcessGrid, chunk: int, *, rows: int | None = None,
                          dtype: torch.dtype | None = None, ignore_index: int = IGNORE_INDEX,
                          sched: Any = None, layer: int = 0) -> torch.Tensor:
    """Per-token CE of the head `w_shard` applied to hidden states `h` ([..., H]; targets [...],
    already shifted), flattened to [N], `chunk` tokens at a time; 0 where the target is ignored.

    `rows`: the vocab rows of the gathered weight block (default: the shard's, no Z split);
    `dtype`: the GEMM dtype (default: the autocast dtype when autocast is on, else the weight's)."""
    flat, tgt, dtype = _checked(h, w_shard, targets, chunk, dtype)
    return ChunkedHeadCrossEntropy.apply(flat, w_shard, tgt, grid,
                                         rows if rows is not None else w_shard.shape[0], chunk, dtype,
                                         ignore_index, sched, layer, torch.is_grad_enabled())
