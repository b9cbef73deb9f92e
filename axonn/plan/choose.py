"""The one grid chooser: the predicted-fastest grid of a launch that fits, for an objective.

`grid: auto` in training, `--grid auto` in `memorize eval` and `memorize scan`, every dry run and the
Slurm writer ask this function, so the same model, launch and objective always get the same grid:

- `Train`: one optimizer step of the config as written (sequence, global batch, micro-batch,
  activation checkpointing, precision, LoRA adapters, the LM head's chunking) priced by
  `model.predict`, whose memory counts weights, gradients and AdamW state; a caller may add bytes a
  grid must also hold (a run that scores its model in place);
- `Inference`: scoring `windows` sequences of `width` tokens (one forward each, `suffix` positions'
  logits) priced by `evaluation.eval_time`, whose memory counts weights and activations only, with no
  optimizer state: an evaluation fits where training of the same model may not.

Candidates are the grids whose every dimension divides what the engine shards (`valid_grids`);
`check` lets the caller refuse more (the real model's config, the batch split) with its own message.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from axonn.plan.evaluation import eval_memory, eval_time
from axonn.plan.hardware import Hardware
from axonn.plan.memory import Adapters
from axonn.plan.model import predict
from axonn.plan.search import valid_grids
from axonn.plan.shapes import ModelShape
from axonn.plan.volumes import Grid, default_mode
from memorize_core import ConfigError, fail

GiB = 2**30


@dataclass(frozen=True)
class Train:
    """Training objective: one optimizer step of `batch` rows of `seq` tokens."""

    seq: int
    batch: int
    micro_batch: Callable[[Grid], int] | None = None  # rows per rank per micro-batch on a grid
    checkpoint: bool = False
    precision: str = "bf16"
    adapters: Adapters | None = None
    loss_chunk: int | str = 0
    extra_bytes: Callable[[Grid], float] | None = None  # what else the grid must hold (in-place scoring)
    # per-example clipping (model.predict): True / "ghost" the norm pass and buffers, "materialized"
    # per-example gradients held whole
    example_norms: bool | str = False
    name: str = "train"


@dataclass(frozen=True)
class Inference:
    """Inference objective: `windows` sequences of `width` tokens, `batch` at a time, `suffix` scored."""

    batch: int
    width: int
    suffix: int
    windows: int = 1000
    precision: str = "bf16"
    name: str = "inference"


@dataclass(frozen=True)
class Choice:
    """The chosen grid, its predicted seconds and peak bytes per rank, and the objective's name."""

    grid: tuple[int, int, int, int]
    seconds: float
    bytes: float
    objective: str

    @property
    def chosen_by(self) -> str:
        """What chose it, as the plans print it."""
        return f"the performance model ({self.objective})"


def inference_cost(shape: ModelShape, g: Grid, hw: Hardware, obj: Inference, *, mode: str,
                   gpus_per_node: int) -> tuple[dict[str, float], dict[str, float]]:
    """(rank-0 bytes by category, eval_time's seconds) of scoring `obj` on grid `g`."""
    per_rank = math.ceil(obj.batch / (g.z * g.data))
    mem = eval_memory(shape, g, batch=per_rank, context=obj.width, new=0, seq=obj.suffix, mode=mode,
                      precision=obj.precision, optimizer_state=False)
    mem["kv_cache"] = 0.0  # one forward without a cache
    t = eval_time(shape, g, hw, docs=obj.windows, batch=per_rank, context=obj.width - 1, new=0,
                  gpus_per_node=gpus_per_node, mode=mode, precision=obj.precision)
    return mem, t


def train_cost(shape: ModelShape, g: Grid, hw: Hardware, obj: Train, *, mode: str, gpus_per_node: int,
                headroom: float) -> tuple[float, float]:
    """(predicted step seconds, peak bytes per rank) of the training objective on grid `g`."""
    mb = obj.micro_batch(g) if obj.micro_batch else None
    p = predict(shape, g, obj.seq, obj.batch, hw, gpus_per_node=gpus_per_node, micro_batch=mb,
                checkpoint=obj.checkpoint, headroom=headroom, mode=mode, precision=obj.precision,
                adapters=obj.adapters, loss_chunk=obj.loss_chunk, example_norms=obj.example_norms)
    need = p.memory_gb * GiB
    if obj.extra_bytes is not None:
        need = max(need, obj.extra_bytes(g))  # scoring in place happens after the step, not beside it
    return p.time_s, need


def choose_grid(shape: ModelShape, world: int, gpus_per_node: int, hw: Hardware, objective: Train | Inference,
                *, mode: str | None = None, headroom: float = 0.1,
                check: Callable[[Grid], None] | None = None) -> Choice:
    """The predicted-fastest grid of `world` processes that fits `hw`'s memory for `objective`;
    ConfigError (field --grid, value auto) naming why none does."""
    mode = mode or default_mode(shape)
    train = isinstance(objective, Train)
    batch = objective.batch if train else max(objective.batch, 1)
    usable = hw.memory_bytes * (1.0 - headroom)
    gpn = min(gpus_per_node, world)
    best: Choice | None = None
    least: tuple[float, Grid] | None = None
    reasons: list[str] = []
    for g in valid_grids(shape, world, batch, strict=train, mode=mode):
        if check is not None:
            try:
                check(g)
            except ConfigError as e:
                reasons.append(str(e))
                continue
        if train:
            seconds, need = train_cost(shape, g, hw, objective, mode=mode, gpus_per_node=gpn,
                                        headroom=headroom)
        else:
            mem, t = inference_cost(shape, g, hw, objective, mode=mode, gpus_per_node=gpn)
            seconds, need = t["seconds"], sum(mem.values())
        if least is None or need < least[0]:
            least = (need, g)
        if need <= usable and (best is None or seconds < best.seconds):
            best = Choice((g.x, g.y, g.z, g.data), seconds, need, objective.name)
    if best is not None:
        return best
    if least is None:
        why = reasons[0] if reasons else (f"no (x, y, z, data) of {world} divides the model's heads, hidden, "
                                          f"FFN and vocab and the batch of {batch}")
        raise fail("--grid", "auto", f"no grid of {world} processes can run this "
                   f"{'config' if train else 'evaluation'}: {why}")
    fix = "" if train else "; lower --batch-size or use more GPUs"
    raise fail("--grid", "auto", f"no grid of {world} processes fits {shape.name} in {hw.name} memory "
               f"({'training' if train else 'scoring'}); the smallest needs {least[0] / GiB:.1f} GiB per GPU "
               f"at {least[1]} ({usable / GiB:.1f} GiB usable){fix}")

__all__ = ["Choice", "Inference", "Train", "choose_grid", "inference_cost", "train_cost"]
