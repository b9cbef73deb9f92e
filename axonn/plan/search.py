"""Enumerate every valid (x, y, z, data), predict each, rank those that fit by step time."""
from __future__ import annotations

from typing import Any

from axonn.plan.calibrate import get_hardware
from axonn.plan.hardware import GiB, Hardware
from axonn.plan.memory import Adapters, get_precision, memory_bytes
from axonn.plan.model import Prediction, predict
from axonn.plan.shapes import ModelShape, load_shape
from axonn.plan.volumes import MODES, Grid, default_mode, grid_problems, rows_per_rank
from memorize_core import ConfigError, fail


def divisors(n: int) -> list[int]:
    """Positive divisors of n, ascending."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def factorizations(n: int) -> list[Grid]:
    """Every ordered (x, y, z, data) with x*y*z*data = n."""
    out = []
    for x in divisors(n):
        for y in divisors(n // x):
            for z in divisors(n // (x * y)):
                out.append(Grid(x, y, z, n // (x * y * z)))
    return out


def valid_grids(shape: ModelShape, gpus: int, global_batch: int, strict: bool = False,
                mode: str | None = None) -> list[Grid]:
    """Grids of `gpus` ranks whose every dimension divides what the engine shards."""
    return [g for g in factorizations(gpus)
            if not grid_problems(shape, g, global_batch, strict, mode)]


def check_inputs(gpus: int, gpus_per_node: int, seq: int, global_batch: int,
                 headroom: float) -> None:
    """Raise ConfigError for impossible sizes."""
    for field, value in (("gpus", gpus), ("gpus_per_node", gpus_per_node), ("seq", seq),
                         ("global_batch", global_batch)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise fail(field, value, "must be a positive integer")
    if gpus > gpus_per_node and gpus % gpus_per_node:
        raise fail("gpus", gpus, f"past one node it must be a multiple of gpus_per_node "
                   f"({gpus_per_node}); use whole nodes")
    if not 0.0 <= headroom < 1.0:
        raise fail("headroom", headroom, "must be a fraction in [0, 1)")


def _largest_fitting(shape: ModelShape, grid: Grid, seq: int, rows: int, checkpoint: bool,
                     budget: float, prefetch: bool, forced: int | None,
                     mode: str, precision: str = "bf16", loss_chunk: int | str = 0,
                     adapters: Adapters | None = None, example_norms: bool | str = False
                     ) -> tuple[int, float]:
    """(micro-batch rows, bytes): the largest micro-batch that fits, else the smallest tried."""
    options = [forced] if forced else sorted(divisors(rows), reverse=True)
    need = 0.0
    for mb in options:
        need = memory_bytes(shape, grid, seq, mb, checkpoint, prefetch, mode, precision, loss_chunk, adapters,
                            example_norms)
        if need <= budget:
            return mb, need
    return options[-1], need


def plan(model: Any, gpus: int, gpus_per_node: int | None, seq: int, global_batch: int,
         hardware: Any, *, checkpoint: bool | None = None, overlap: bool = True,
         headroom: float = 0.1, micro_batch: int | None = None,
         include_unfit: bool = False, strict: bool = False,
         mode: str | None = None, precision: str = "bf16", loss_chunk: int | str = 0,
         adapters: Adapters | None = None, example_norms: bool | str = False) -> list[Prediction]:
    """Predictions for every valid grid, best first; only those that fit unless include_unfit.

    checkpoint None tries with and without activation checkpointing and keeps the faster that
    fits; the micro-batch is the largest divisor of the rows per rank that fits (or `micro_batch`).
    `strict` keeps only grids with no Z padding and an even batch split (volumes.grid_problems);
    `precision` is the trainer's (bf16 autocast on GPUs, fp32 on CPU: memory.PRECISIONS), `loss_chunk`
    its LM-head setting (model.predict; 0: full logits), `adapters` a LoRA run's (memory.Adapters: a
    frozen base, only the adapters trained), `example_norms` per-example clipping (model.predict:
    True / "ghost" by a ghost-norm pass, "materialized" from per-example gradients).
    Ranked: grids that fit first, among them those the engine runs as is (z*data divides the batch),
    each group by step time. Raises ConfigError when nothing is valid or nothing fits.
    """
    shape = load_shape(model)
    mode = mode or default_mode(shape)
    if mode not in MODES:
        raise fail("mode", mode, f"choose one of {', '.join(MODES)}")
    get_precision(precision)
    hw: Hardware = get_hardware(hardware)
    gpn = hw.gpus_per_node if gpus_per_node is None else gpus_per_node
    check_inputs(gpus, gpn, seq, global_batch, headroom)
    grids = valid_grids(shape, gpus, global_batch, strict, mode)
    if not grids:
        raise fail("gpus", gpus, f"no (x, y, z, data) of {gpus} GPUs divides {shape.name}'s "
                   f"heads/hidden/ffn/vocab and global batch {global_batch}; try a power of two"
                   f"{'' if not strict else ' or drop strict'}")
    budget = hw.memory_bytes * (1.0 - headroom)
    modes = [False, True] if checkpoint is None else [checkpoint]
    results: list[Prediction] = []
    least: tuple[float, Grid] | None = None
    for grid in grids:
        rows = rows_per_rank(grid, global_batch)
        if micro_batch and rows % micro_batch:
            continue
        best: Prediction | None = None
        for ckpt in modes:
            mb, need = _largest_fitting(shape, grid, seq, rows, ckpt, budget, overlap, micro_batch,
                                        mode, precision, loss_chunk, adapters, example_norms)
            if least is None or need < least[0]:
                least = (need, grid)
            if need > budget and not include_unfit:
                continue
            p = predict(shape, grid, seq, global_batch, hw, gpus_per_node=gpn, micro_batch=mb,
                        checkpoint=ckpt, overlap=overlap, headroom=headroom, mode=mode,
                        precision=precision, loss_chunk=loss_chunk, adapters=adapters,
                        example_norms=example_norms)
            if best is None or (p.fits, -p.time_s) > (best.fits, -best.time_s):
                best = p
        if best is not None:
            results.append(best)
    if not results:
        if least is None:
            raise fail("micro_batch", micro_batch, "must divide the rows each rank gets "
                       "(global_batch / (z * data)) for some grid")
        need, g = least
        raise ConfigError(
            f"gpus={gpus}: no configuration of {shape.name} fits in {budget / GiB:.1f} GiB per GPU "
            f"({hw.name}, headroom {headroom:.0%}); the smallest needs {need / GiB:.1f} GiB at "
            f"(x, y, z, data)={g.x, g.y, g.z, g.data}; add GPUs, enable checkpointing, lower "
            "--seq / --global-batch, or plan a LoRA run (--lora R)")
    # runnable first: a grid whose z*data does not divide the batch is a prediction the engine refuses
    results.sort(key=lambda p: (not p.fits, not p.even_batch, p.time_s))
    return results


def runnable_batch(rows: list[Prediction], global_batch: int) -> int:
    """The smallest global batch >= `global_batch` that some listed grid's z*data divides."""
    return min(-(-global_batch // (r.z * r.data)) * r.z * r.data for r in rows)
