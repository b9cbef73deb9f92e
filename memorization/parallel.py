"""From `--grid X,Y,Z,D` (or `auto`) to the run's ProcessGrid, validated before any collective.

A run's grid is decided here: `run_dims` reads the grid a caller passes in, else the `--grid` text
(`grid_spec`: it wins over the config's `grid` key; `auto` asks the planner about the run's model),
memorization.checks.check_run checks those X,Y,Z,D against the model and the launch (no collective),
and `resolve_grid` makes the ProcessGrid: a single process that asks for no split trains on
`ProcessGrid.serial()` (the 1x1x1x1 grid: no process group, every collective a no-op); anything else
initialises torch.distributed.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

import axonn
from axonn.grid import ProcessGrid, parse_grid
from axonn.launch import launch_env
from axonn.plan import auto_grid
from axonn.trainer import resolve_device

if TYPE_CHECKING:
    from memorization.config import RunConfig

SERIAL = ("", "1,1,1,1", "1,1,1", "1")


def launched_world_size() -> int:
    """World size announced by torchrun / srun / MPI (1 when started as a plain process)."""
    return launch_env().world_size


def wants_grid(spec: str | None) -> bool:
    """True when the run must go through the engine (a non-trivial grid or a multi-process launch)."""
    return (spec or "") not in SERIAL or launched_world_size() > 1


def grid_spec(arg: str | None, cfg: RunConfig) -> str:
    """The run's grid as written: `--grid` (`arg`) wins over the config's `grid` key."""
    return cfg.grid if arg is None else arg


def run_world(grid: ProcessGrid | None = None) -> int:
    """The processes a run trains on: the given grid's, else the launch's (1 for a plain process)."""
    return grid.world_size if isinstance(grid, ProcessGrid) else launched_world_size()


def run_dims(cfg: RunConfig, model_config: Any, *, spec: str | None = None,
             grid: ProcessGrid | None = None) -> tuple[int, int, int, int]:
    """The run's X,Y,Z,D before anything is built: `grid`'s; else `spec` (the --grid text, or cfg.grid)
    parsed, `auto` asking the planner about this model on the launched processes. Whether it fits the
    model and the launch is memorization.checks.check_run's question."""
    if isinstance(grid, ProcessGrid):
        return grid.dims
    text = grid_spec(spec, cfg)
    world = launched_world_size()
    if text == "auto":
        hardware = "h100" if torch.cuda.is_available() else "local"
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("SLURM_NTASKS_PER_NODE", world)))
        return auto_grid(model_config, world, max(1, per_node), cfg.data.block_len, cfg.trainer.batch_size,
                         hardware)
    return (1, 1, 1, 1) if text in SERIAL else parse_grid(text)


def resolve_grid(cfg: RunConfig, dims: tuple[int, int, int, int], *, spec: str | None = None,
                 grid: ProcessGrid | None = None) -> ProcessGrid:
    """The run's ProcessGrid (decided here only), once check_run passed `dims`: `grid` as given; else
    the serial grid on cfg.trainer.device when one process asks for no split; else torch.distributed
    initialised on `dims` (every collective bounded by trainer.collective_timeout_s)."""
    if isinstance(grid, ProcessGrid):
        return grid
    if not wants_grid(grid_spec(spec, cfg)):
        return ProcessGrid.serial(device=resolve_device(cfg.trainer.device))
    if not torch.cuda.is_available():
        # gloo ranks share the CPU: one thread each unless the user said otherwise
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local)))
    return axonn.init(*dims, timeout_s=cfg.trainer.collective_timeout_s)


def is_main_process() -> bool:
    """Rank 0 of the launch (or a plain process): the one that writes reports."""
    return launch_env().rank == 0
