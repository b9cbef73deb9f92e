"""From `--grid X,Y,Z,D` (or `auto`) to the run's ProcessGrid, validated before any collective.

A run's grid is decided in one place, `resolve_grid`: the grid a caller passes in as is, else the
`--grid` text (`grid_spec`: it wins over the config's `grid` key) resolved once the model is built
(`auto` asks the planner about that model; X,Y,Z,D must divide its shapes). A single process that
asks for no split trains on `ProcessGrid.serial()` (the 1x1x1x1 grid: no process group, every
collective a no-op); anything else initialises torch.distributed.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

import axonn
from axonn.grid import ProcessGrid, launch_env, parse_grid, validate_grid_for_model
from axonn.plan import auto_grid
from axonn.trainer import resolve_device
from memorize_core import fail

if TYPE_CHECKING:
    from memorization.config import RunConfig

SERIAL = ("", "1,1,1,1", "1,1,1", "1")


def launched_world_size() -> int:
    """World size announced by torchrun / srun / MPI (1 when started as a plain process)."""
    return launch_env().world_size


def wants_grid(spec: str | None) -> bool:
    """True when the run must go through the engine (a non-trivial grid or a multi-process launch)."""
    return (spec or "") not in SERIAL or launched_world_size() > 1


def grid_dims(spec: str, model_config: Any, *, seq: int, global_batch: int,
              mode: str) -> tuple[int, int, int, int]:
    """Resolve 'auto' with the performance model, parse X,Y,Z,D, and check it fits the model."""
    world = launched_world_size()
    if spec == "auto":
        hardware = "h100" if torch.cuda.is_available() else "local"
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("SLURM_NTASKS_PER_NODE", world)))
        dims = auto_grid(model_config, world, max(1, per_node), seq, global_batch, hardware)
    else:
        dims = parse_grid(spec)
    if dims[0] * dims[1] * dims[2] * dims[3] != world:
        raise fail("--grid", ",".join(map(str, dims)), f"x*y*z*data must equal the {world} launched "
                   "processes; launch with torchrun "
                   f"--nproc-per-node {dims[0] * dims[1] * dims[2] * dims[3]} "
                   "or change the grid")
    validate_grid_for_model(dims, model_config, mode=mode)
    return dims


def make_grid(spec: str, model_config: Any, *, seq: int, global_batch: int, mode: str = "easy",
              timeout_s: float = 60.0) -> ProcessGrid:
    """Validate on every rank (no collective), then initialise torch.distributed and the grid.

    `timeout_s` bounds every blocking collective (trainer.collective_timeout_s)."""
    dims = grid_dims(spec, model_config, seq=seq, global_batch=global_batch, mode=mode)
    if not torch.cuda.is_available():
        # gloo ranks share the CPU: one thread each unless the user said otherwise
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local)))
    return axonn.init(*dims, timeout_s=timeout_s)


def grid_spec(arg: str | None, cfg: RunConfig) -> str:
    """The run's grid as written: `--grid` (`arg`) wins over the config's `grid` key."""
    return cfg.grid if arg is None else arg


def requested_grid(cfg: RunConfig, *, spec: str | None = None, grid: ProcessGrid | None = None
                   ) -> tuple[tuple[int, int, int, int] | None, bool]:
    """What is known before the model is built: (the grid's X,Y,Z,D, or None for `auto`; whether the
    run goes through torch.distributed), for checks that must refuse a run before anything loads."""
    if isinstance(grid, ProcessGrid):
        return grid.dims, grid.distributed
    text = grid_spec(spec, cfg)
    dims = None if text == "auto" else (1, 1, 1, 1) if text in SERIAL else parse_grid(text)
    return dims, wants_grid(text)


def resolve_grid(cfg: RunConfig, model_config: Any, *, spec: str | None = None,
                 grid: ProcessGrid | None = None) -> ProcessGrid:
    """The run's ProcessGrid (decided here only): `grid` as given; else the serial grid on
    cfg.trainer.device when one process asks for no split; else `spec` (or cfg.grid) checked against
    the model and the launch, torch.distributed initialised (`make_grid`)."""
    if isinstance(grid, ProcessGrid):
        return grid
    text = grid_spec(spec, cfg)
    if not wants_grid(text):
        return ProcessGrid.serial(device=resolve_device(cfg.trainer.device))
    return make_grid(text, model_config, seq=cfg.data.block_len, global_batch=cfg.trainer.batch_size,
                     mode=cfg.parallel_mode, timeout_s=cfg.trainer.collective_timeout_s)


def is_main_process() -> bool:
    """Rank 0 of the launch (or a plain process): the one that writes reports."""
    return launch_env().rank == 0
