"""Predict one configuration: step time (compute + exposed communication), memory, flop/s."""
from __future__ import annotations

import dataclasses
from typing import Any

from axonn.plan.collectives import collective_time, group_strides
from axonn.plan.compute import (
    attention_time,
    elementwise_time,
    example_norm_time,
    gemm_time,
    optimizer_time,
)
from axonn.plan.hardware import GiB, Hardware
from axonn.plan.memory import Adapters, adapter_params, head_chunk, local_params, memory_breakdown, norm_kind
from axonn.plan.shapes import ModelShape
from axonn.plan.volumes import Comm, Grid, default_mode, rows_per_rank, step_ops

DTYPE_BYTES = 2  # bf16 activations, weights and gradients on the wire


@dataclasses.dataclass
class Prediction:
    """The model's verdict on one (x, y, z, data) configuration."""

    x: int
    y: int
    z: int
    data: int
    micro_batch: int  # rows per rank per micro-batch
    checkpoint_activations: bool
    mode: str  # paired | easy (axonn.parallelize modes)
    even_batch: bool  # z*data divides the global batch (the engine's shard_batch requires it)
    time_s: float
    compute_s: float
    comm_s: float  # every collective, as if nothing overlapped
    exposed_comm_s: float
    memory_gb: float  # GiB (2**30 bytes), like the capacities vendors quote as "GB"
    capacity_gb: float
    fits: bool
    tflops_per_gpu: float  # model flops (no recompute) per second per GPU
    pct_peak: float
    pflops: float  # sustained model PF/s of the whole job
    comm_by_group: dict[str, float] = dataclasses.field(default_factory=dict)
    memory_by_kind: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def grid(self) -> tuple[int, int, int, int]:
        """(x, y, z, data)."""
        return self.x, self.y, self.z, self.data

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict."""
        return dataclasses.asdict(self)


def model_flops(shape: ModelShape, seq: int, global_batch: int) -> float:
    """Model flops of a step: 6*N*tokens + 12*layers*hidden*seq*tokens (no recompute counted)."""
    tokens = global_batch * seq
    return 6.0 * shape.matmul_params * tokens + 12.0 * shape.layers * shape.hidden * seq * tokens


def _exposed(comms: list[tuple[Comm, float]], wgrad: dict[str, float], fwd_compute: float,
             bwd_compute: float, step_comm: float, n_buckets: int) -> float:
    """Communication left on the critical path of one micro-batch, given the overlap schedule.

    fwd: all-reduces block; the Z all-gathers are prefetched one layer ahead, so all but the
    first hide behind forward compute. bwd: each Y/X all-reduce hides behind its own Linear's
    weight-gradient GEMM; Z all-gathers (prefetched), reduce-scatters (asynchronous) and the
    bucketed data all-reduce share a background stream that hides behind backward compute,
    except the first gather and the last bucket.
    """
    exposed = 0.0
    ag = {"fwd": 0.0, "bwd": 0.0}
    first_ag = {"fwd": 0.0, "bwd": 0.0}
    background = step_comm
    for c, t in comms:
        total = t * c.count
        if c.hide == "blocking":
            exposed += total
        elif c.hide == "wgrad":
            exposed += c.count * max(0.0, t - wgrad.get(c.name, 0.0))
        elif c.hide == "prefetch":
            ag[c.phase] += total
            first_ag[c.phase] = max(first_ag[c.phase], t)
        else:  # background reduce-scatter
            background += total
    exposed += first_ag["fwd"] + max(0.0, ag["fwd"] - first_ag["fwd"] - fwd_compute)
    background += ag["bwd"] - first_ag["bwd"]
    tail = step_comm / n_buckets
    exposed += first_ag["bwd"] + max(tail, background - bwd_compute)
    return exposed


def predict(shape: ModelShape, grid: Grid, seq: int, global_batch: int, hw: Hardware, *,
            gpus_per_node: int | None = None, micro_batch: int | None = None,
            checkpoint: bool = False, overlap: bool = True, headroom: float = 0.1,
            mode: str | None = None, precision: str = "bf16",
            local: float | None = None, loss_chunk: int | str = 0, adapters: Adapters | None = None,
            example_norms: bool | str = False) -> Prediction:
    """Predict step time, memory and throughput of one valid grid (see volumes.check_grid).

    `overlap` is the engine's overlapped schedule (prefetch, background reductions); the time it
    hides only counts on hardware whose collectives do not run on the compute units
    (`hw.hides_comm`; the CPU/gloo `local` profile does not). Memory counts the prefetch buffers
    whenever `overlap` is on; `local` overrides the rank's parameter count (the dry run passes the
    count of the model it sharded), `precision` the activation bytes (memory.PRECISIONS),
    `loss_chunk` the trainer's LM-head setting (trainer.loss_chunk: auto, off/0 full logits, or tokens
    per chunk; resolved for this grid as the trainer does, memory.head_chunk) and
    `adapters` a LoRA run (a frozen base: only the adapters have gradients and optimizer state).
    `example_norms`: per-example gradient clipping by ghost norms (axonn/layers/per_example.py), which
    runs a first backward per micro-batch to measure each example's gradient norm before the clipped one: its
    activation-gradient GEMMs (no weight GEMMs), the attention and element-wise backward, the norm
    GEMMs (compute.example_norm_time) and its collectives (the backward's but the weight reduce-scatter,
    none hidden behind a weight GEMM; the norms' all-reduces over X and Y), the noise such a step adds
    to every trained coordinate, and the norm buffers in memory. `example_norms="materialized"`: the
    norms from per-example gradients held whole (per-sample hooks on a grid that splits no weight): per
    micro-batch the weight-gradient GEMMs again, one gradient per row (of the adapters only with
    `adapters`), written, read for its norm and read for the clipped sum, the noise, and those
    gradients in memory (memory.memory_breakdown's `example_grads`)."""
    mode = mode or default_mode(shape)
    gpn = hw.gpus_per_node if gpus_per_node is None else gpus_per_node
    gpus = grid.size
    rows = rows_per_rank(grid, global_batch)
    mb = micro_batch or rows
    n_micro = rows // mb
    loss_chunk = head_chunk(loss_chunk, -(-shape.vocab // grid.y), mb * (seq - 1))
    gemms, comms, step = step_ops(shape, grid, seq, mb, checkpoint, mode)

    kind = norm_kind(example_norms)
    fwd_c = bwd_c = dgrad_c = wgrad_c = 0.0
    wgrad: dict[str, float] = {}
    for g in gemms:
        t = gemm_time(g.m, g.n, g.k, hw)
        if g.phase == "fwd":
            fwd_c += t * g.count
        else:
            bwd_c += t * g.count
        if g.role == "wgrad":
            wgrad[g.name] = t
            wgrad_c += t * g.count
        elif g.phase == "bwd":
            dgrad_c += t * g.count  # what a backward without weight gradients runs (and recomputes)
    a_f, a_b = attention_time(shape, grid, seq, mb, hw, checkpoint, mode)
    e_f, e_b = elementwise_time(shape, grid, seq, mb, hw, checkpoint, mode, loss_chunk)
    fwd_c += a_f + e_f
    bwd_c += a_b + e_b  # the chunked head's GEMMs are the unchunked head's three (no recompute)

    strides = group_strides(grid.x, grid.y, grid.z, grid.data)
    by_group: dict[str, float] = {}

    def timed(cs: list[Comm], reps: int) -> list[tuple[Comm, float]]:
        out = []
        for c in cs:
            p, stride = strides[c.group]
            n_bytes = c.elems * (c.elem_bytes or DTYPE_BYTES)
            t = collective_time(c.kind, n_bytes, p, stride, gpus, hw, gpn)
            key = f"{c.kind}:{c.group}"
            if t > 0:
                by_group[key] = by_group.get(key, 0.0) + t * c.count * reps
            out.append((c, t))
        return out

    micro_comms = timed(comms, n_micro)
    step_comm = sum(t for _, t in timed(step, 1))
    n_local = local_params(shape, grid, mode) if local is None else local
    n_trained = n_local if adapters is None else adapter_params(shape, grid, adapters, mode)
    norms_c = norms_exposed = 0.0
    if kind == "materialized":  # per-row weight gradients: formed, written, read for norms and the sum
        norms_c = (0.0 if adapters is not None else wgrad_c) + 12.0 * mb * n_trained / hw.hbm_bw
    if kind == "ghost":  # the norm pass: a backward of its own, timed like a forward (no weight GEMM hides)
        norms_c = dgrad_c + a_b + e_b + example_norm_time(shape, grid, seq, mb, hw, mode, adapters)
        passed = [dataclasses.replace(c, phase="fwd") for c in comms
                  if c.phase == "bwd" and c.kind != "reduce_scatter"]
        passed += [Comm("example_norms", "fwd", "all_reduce", axis, mb, 1, "blocking", elem_bytes=8)
                   for axis in ("x", "y")]
        norm_comms = timed(passed, n_micro)
        norms_exposed = (_exposed(norm_comms, {}, norms_c, 0.0, 0.0, 1) if overlap and hw.hides_comm
                         else sum(t * c.count for c, t in norm_comms))
    comm_total = sum(by_group.values())
    if overlap and hw.hides_comm:
        buckets = shape.layers + 1
        per_micro = _exposed(micro_comms, wgrad, fwd_c, bwd_c, 0.0, buckets)
        last = _exposed(micro_comms, wgrad, fwd_c, bwd_c, step_comm, buckets)
        exposed = (n_micro - 1) * per_micro + last + n_micro * norms_exposed
    else:
        exposed = comm_total

    compute = n_micro * (fwd_c + bwd_c + norms_c) + optimizer_time(n_trained, hw)
    if kind:  # N(0, sigma^2 C^2) per trained coordinate: drawn (fp32) and added once per step
        compute += 16.0 * n_trained / hw.hbm_bw
    time_s = compute + exposed
    mem = memory_breakdown(shape, grid, seq, mb, checkpoint, prefetch=overlap, mode=mode,
                           local=n_local, precision=precision, loss_chunk=loss_chunk, adapters=adapters,
                           example_norms=example_norms)
    mem_bytes = sum(mem.values())
    flops = model_flops(shape, seq, global_batch) / time_s
    return Prediction(
        x=grid.x, y=grid.y, z=grid.z, data=grid.data, micro_batch=mb,
        checkpoint_activations=checkpoint, mode=mode,
        even_batch=global_batch % (grid.z * grid.data) == 0, time_s=time_s, compute_s=compute,
        comm_s=comm_total, exposed_comm_s=exposed, memory_gb=mem_bytes / GiB,
        capacity_gb=hw.memory_bytes / GiB,
        fits=mem_bytes <= hw.memory_bytes * (1.0 - headroom),
        tflops_per_gpu=flops / gpus / 1e12, pct_peak=100.0 * flops / gpus / hw.peak_flops,
        pflops=flops / 1e15, comm_by_group=by_group,
        memory_by_kind={k: v / GiB for k, v in mem.items()})
