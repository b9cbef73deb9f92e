"""From `--grid X,Y,Z,D` (or `auto`) to an initialised ProcessGrid, validated before any collective."""
from __future__ import annotations

import os
from typing import Any

import torch

from memorize_core import fail

SERIAL = ("", "1,1,1,1", "1,1,1", "1")


def launched_world_size() -> int:
    """World size announced by torchrun / srun / MPI (1 when started as a plain process)."""
    from axonn.grid import launch_env

    return launch_env().world_size


def wants_grid(spec: str | None) -> bool:
    """True when the run must go through the engine (a non-trivial grid or a multi-process launch)."""
    return (spec or "") not in SERIAL or launched_world_size() > 1


def grid_dims(spec: str, model_config: Any, *, seq: int, global_batch: int,
              mode: str) -> tuple[int, int, int, int]:
    """Resolve 'auto' with the performance model, parse X,Y,Z,D, and check it fits the model."""
    from axonn.grid import parse_grid, validate_grid_for_model

    world = launched_world_size()
    if spec == "auto":
        from axonn.plan import auto_grid

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
              timeout_s: float = 60.0):
    """Validate on every rank (no collective), then initialise torch.distributed and the grid.

    `timeout_s` bounds every blocking collective (trainer.collective_timeout_s)."""
    import axonn

    dims = grid_dims(spec, model_config, seq=seq, global_batch=global_batch, mode=mode)
    if not torch.cuda.is_available():
        # gloo ranks share the CPU: one thread each unless the user said otherwise
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local)))
    return axonn.init(*dims, timeout_s=timeout_s)


def is_main_process() -> bool:
    """Rank 0 of the launch (or a plain process): the one that writes reports."""
    from axonn.grid import launch_env

    return launch_env().rank == 0
