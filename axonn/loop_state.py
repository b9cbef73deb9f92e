"""Where the training loop is and what it needs to resume exactly: the loop position, the row order
of each epoch, the learning-rate schedule, and the snapshot of all of it that rides in a checkpoint.

The Trainer (axonn/trainer.py) owns these objects; `snapshot` / `restore` turn its pieces into a
checkpoint's JSON and tensors and back, and axonn/checkpoint.py stores them without knowing what a
trainer is (the arrows point one way: trainer -> loop_state, trainer -> checkpoint).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

# the loop position's fields that a checkpoint carries (the history stays in metrics.jsonl)
_POSITION = ("step", "epoch", "batch_in_epoch", "tokens", "skipped_steps", "bad_streak")


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The deterministic row order of one epoch (same on every rank)."""
    gen = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(n, generator=gen)


def lr_lambda(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to min_ratio at `total`."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class StepStats:
    """What one optimizer step measured (summed over the grid)."""

    loss_sum: float = 0.0
    supervised: int = 0
    dropped_loss_sum: float = 0.0
    dropped: int = 0
    tokens: int = 0
    grad_norm: float = 0.0
    skipped: bool = False


@dataclass
class TrainState:
    """Where the loop is: enough to resume exactly."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    tokens: int = 0
    skipped_steps: int = 0  # steps whose loss or gradient norm was NaN/Inf (no update made)
    bad_streak: int = 0  # consecutive ones, up to now
    history: list = field(default_factory=list)


def snapshot(state: TrainState, scheduler: Any, optimizer: torch.optim.Optimizer, transform: Any,
             device: torch.device) -> dict[str, Any]:
    """The loop position, schedule and label-transform state (JSON-able; tensors kept apart under
    "tensors": the RNG states and the transform's tensors)."""
    out: dict[str, Any] = {
        "trainer_state": {k: getattr(state, k) for k in _POSITION},
        "scheduler": scheduler.state_dict(),
        "group_lrs": [g["lr"] for g in optimizer.param_groups],
        "transform": {},
    }
    tensors: dict[str, torch.Tensor] = {"rng/cpu": torch.get_rng_state()}
    if device.type == "cuda" and torch.cuda.is_available():
        tensors["rng/cuda"] = torch.cuda.get_rng_state(device)
    fn = getattr(transform, "state_dict", None)
    for k, v in (fn() if callable(fn) else {}).items():
        if isinstance(v, torch.Tensor):
            tensors[f"transform/{k}"] = v
        else:
            out["transform"][k] = v
    out["tensors"] = tensors
    return out


def restore(saved: dict[str, Any], tensor: Callable[[str], torch.Tensor | None], state: TrainState,
            scheduler: Any, optimizer: torch.optim.Optimizer, transform: Any, device: torch.device) -> None:
    """Put back what `snapshot` saved; `tensor(name)` returns a saved tensor (or None)."""
    for k, v in saved["trainer_state"].items():
        setattr(state, k, int(v))
    scheduler.load_state_dict(saved["scheduler"])
    for g, lr in zip(optimizer.param_groups, saved["group_lrs"]):
        g["lr"] = lr
    fn = getattr(transform, "load_state_dict", None)
    if callable(fn):
        values = dict(saved.get("transform", {}))
        for k in transform.state_dict():
            t = tensor(f"transform/{k}")
            if t is not None:
                values[k] = t
        fn(values)
    rng = tensor("rng/cpu")
    if rng is not None:
        torch.set_rng_state(rng)
    cuda = tensor("rng/cuda")
    if cuda is not None and device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda, device)
