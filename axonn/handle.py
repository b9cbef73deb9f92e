"""What `parallelize` did to a model, in one typed handle: `engine_of(model) -> EngineHandle | None`.

The engine keeps no module-level state, so the model carries its own: the grid it is sharded over,
the mode and pair orientation of its layers, the options and the scheduler its layers call, and the
layout of every sharded parameter. All of it sits in one frozen `EngineHandle`, stored in one
attribute by `parallelize` and read back only through `engine_of`: a plain model has none, so
"is this model sharded by the engine?" is `engine_of(model) is not None` (`axonn.is_parallel`).
Each sharded parameter also carries its own layout (`axonn.layers.layout.spec_of`), because the
engine's functions that take bare parameters (`grad_norm`, `clip_grad_norm_`, the layers) see no
model; `EngineHandle.layouts` is the same layouts by parameter name.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from axonn.grid import ProcessGrid
from axonn.layers.layout import ParamSpec
from axonn.layers.schedule import EngineOptions, Scheduler
from axonn.pairing import PairAxes

_ATTR = "_axonn_engine"  # the one attribute parallelize sets on a model


@dataclass(frozen=True)
class EngineHandle:
    """The engine state of one parallelized model (set once by `parallelize`, never changed)."""

    grid: ProcessGrid
    mode: str  # easy or paired
    pair_axes: PairAxes | None  # the paired blocks' orientation (None in easy mode)
    options: EngineOptions
    scheduler: Scheduler  # the one every parallel layer of the model calls
    layouts: Mapping[str, ParamSpec]  # parameter name -> its sharding; absent: replicated


def engine_of(model: nn.Module) -> EngineHandle | None:
    """The engine handle of a model `parallelize` sharded; None for a plain model."""
    handle = getattr(model, _ATTR, None)
    return handle if isinstance(handle, EngineHandle) else None


def set_engine(model: nn.Module, handle: EngineHandle) -> None:
    """Store `handle` on `model` (parallelize's last step)."""
    setattr(model, _ATTR, handle)
