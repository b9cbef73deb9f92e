"""Per-rank memory and time of evaluating a sharded model on its grid (extraction, MIA, perplexity).

The dry run puts this next to the training figures: a run scores its model in place after training
(evals/scoring.py), so the evaluation peak is what training left allocated (fp32 weights and, in the
same process, AdamW's two moments; gradients are freed) plus what scoring adds:

  kv_cache     K and V of every layer for `batch` rows of `context + new` positions, on this rank's
               KV heads (paired mode splits them with the query heads; easy mode keeps them all)
  z_buffers    the Z-gathered weight block of the largest layer, twice with the prefetch; or, with
               keep_gathered, every layer's block held at once (params / (X * Y))
  logits       membership inference's [batch, seq, V/Y] fp32 logits, log-probs and probabilities
  activations  the forward's full-width stream and the MLP's widest intermediate, not saved

Time is an estimate for decoding `docs` documents: each batch shard (Z x data) decodes its share in
batches of `batch` rows; a prefill of `context` tokens is compute-bound, each of the `new` decode
steps reads this rank's weights once (memory-bound) and, with a Z split, all-gathers them over Z.
Every document is decoded token by token (the target-verified decoder is faster on memorized ones).
"""
from __future__ import annotations

import math

from axonn.plan.compute import head_split
from axonn.plan.hardware import Hardware
from axonn.plan.memory import Adapters, adapter_params, get_precision, local_params
from axonn.plan.shapes import ModelShape
from axonn.plan.volumes import Grid, default_mode, step_ops


def eval_memory(shape: ModelShape, grid: Grid, *, batch: int, context: int, new: int, seq: int,
                mode: str | None = None, precision: str = "bf16", local: float | None = None,
                keep_gathered: bool = False, optimizer_state: bool = True,
                adapters: Adapters | None = None, trained: float | None = None) -> dict[str, float]:
    """Peak bytes per rank while scoring, by category (see the module docstring); with `adapters` (a
    LoRA run: memory.Adapters) the `local` weights are frozen in their load dtype and only the
    `trained` adapter parameters (default memory.adapter_params) carry optimizer state."""
    mode = mode or default_mode(shape)
    p = get_precision(precision)
    n = local_params(shape, grid, mode) if local is None else float(local)
    weights, state = p.weight * n, p.optimizer * n
    if adapters is not None:
        trained = adapter_params(shape, grid, adapters, mode) if trained is None else float(trained)
        weights, state = adapters.frozen_bytes * n + p.weight * trained, p.optimizer * trained
    split = head_split(shape, grid, mode)
    act = p.activation
    kv = 2.0 * shape.layers * batch * (context + new) * shape.kv_dim / split * act
    largest = max([o * i for _, o, i, _ in shape.block_linears()] + [shape.vocab * shape.hidden])
    if grid.z == 1:
        z_buffers = 0.0
    elif keep_gathered:
        z_buffers = n * grid.z * act
    else:
        z_buffers = 2.0 * largest / (grid.x * grid.y) * act
    tokens = batch * max(seq, context + new)
    stream = 4.0 * shape.hidden + (3 if shape.gated_mlp else 2) * shape.ffn / split
    return {
        "weights": weights,
        "optimizer": state if optimizer_state else 0.0,
        "kv_cache": kv,
        "z_buffers": z_buffers,
        "logits": 3.0 * 4.0 * batch * seq * shape.vocab / grid.y,
        "activations": act * tokens * stream,
    }


def _gather_bw(grid: Grid, hw: Hardware, gpus_per_node: int) -> float:
    """Per-rank bandwidth of a Z all-gather: inside a node, or the node's NICs shared by its ranks."""
    return hw.intra_bw if grid.x * grid.y * grid.z <= gpus_per_node else hw.node_bw / gpus_per_node


def eval_time(shape: ModelShape, grid: Grid, hw: Hardware, *, docs: int, batch: int, context: int,
              new: int, gpus_per_node: int, mode: str | None = None, precision: str = "bf16",
              keep_gathered: bool = False) -> dict[str, float]:
    """Seconds to decode `new` tokens after `context` for `docs` documents, and the decode rate."""
    mode = mode or default_mode(shape)
    act = get_precision(precision).activation
    tensor_params = shape.params / (grid.x * grid.y)  # what one rank multiplies by, per token
    flops_s = hw.peak_flops * hw.gemm_eff
    rows = math.ceil(docs / grid.dim("batch"))  # the busiest batch shard
    batches = math.ceil(rows / batch) if rows else 0
    gather = 0.0
    if grid.z > 1 and not keep_gathered:
        gather = tensor_params * act * (grid.z - 1) / grid.z / _gather_bw(grid, hw, gpus_per_node)
    prefill = 2.0 * tensor_params * batch * context / flops_s + gather
    step = max(2.0 * tensor_params * batch / flops_s, tensor_params * act / hw.hbm_bw) + gather \
        + 2 * shape.layers * hw.intra_lat * (grid.x > 1 or grid.y > 1)
    seconds = batches * (prefill + new * step)
    return {"seconds": seconds, "prefill_s": prefill, "step_s": step, "batches_per_shard": batches,
            "tokens_per_s": docs * new / seconds if seconds else 0.0}


def decode_step_volumes(shape: ModelShape, grid: Grid, batch: int, *, mode: str | None = None,
                        dtype_bytes: int = 2, keep_gathered: bool = False) -> dict[tuple[str, str], int]:
    """Bytes per rank of one decode step (one new token for each of `batch` rows), by (kind, group).

    Counted like axonn.comm.CommStats (the full buffer of each call): the forward's collectives of
    every layer at one token per row (axonn.plan.volumes), the lockstep flag over Z (an int32), and
    the distributed argmax over Y (each rank's (max, id) pair per row in float64, all-gathered).
    With `keep_gathered` the weights are not gathered per step (only the flag crosses Z)."""
    _, comms, _ = step_ops(shape, grid, 1, batch, False, mode or default_mode(shape))
    out: dict[tuple[str, str], int] = {}

    def add(kind: str, group: str, nbytes: int) -> None:
        out[(kind, group)] = out.get((kind, group), 0) + nbytes

    for c in comms:
        if keep_gathered and c.group == "z":
            continue
        if c.phase == "fwd" and c.name != "loss" and grid.dim(c.group) > 1 and c.elems > 0:
            add(c.kind, c.group, c.count * c.elems * (c.elem_bytes or dtype_bytes))
    if grid.z > 1:
        add("all_reduce", "z", 4)
    if grid.y > 1:
        add("all_gather", "y", grid.y * batch * 2 * 8)
    return out
