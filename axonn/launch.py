"""Where this process sits in the job: rank, world size, local rank and the rendezvous host, read
from the launcher's environment (torchrun, Slurm srun, Open MPI, MPICH; else one process).

`axonn.grid.init` reads it before any rendezvous; memorization.train.parallel asks it for the world size
and the main rank before a grid exists; the watchdog names the launcher in its message.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

from memorize_core import fail

# (source, rank var, size var, local-rank var) of each launcher, in the order they are looked for
LAUNCHERS = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
)


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, read from torchrun, Slurm or MPI variables."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int
    source: str


def _env_int(name: str) -> int:
    raw = os.environ[name]
    try:
        return int(raw)
    except ValueError:
        raise fail(name, raw, "the launcher set a non-integer; check the job environment") from None


def _slurm_master() -> str | None:
    nodes = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodes or shutil.which("scontrol") is None:
        return None
    out = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True)
    first = out.stdout.split()
    return first[0] if out.returncode == 0 and first else None


def launch_env() -> LaunchEnv:
    """Read rank / world size / local rank from torchrun, Slurm srun, or MPI (else: one process)."""
    port = _env_int("MASTER_PORT") if "MASTER_PORT" in os.environ else 29500
    for source, rvar, svar, lvar in LAUNCHERS:
        if rvar in os.environ and svar in os.environ:
            rank, size = _env_int(rvar), _env_int(svar)
            local = _env_int(lvar) if lvar in os.environ else 0
            addr = os.environ.get("MASTER_ADDR") or (_slurm_master() if source == "slurm" else None)
            if addr is None and size > 1:
                raise fail("MASTER_ADDR", None, f"{source} launch without a rendezvous host; "
                           "export MASTER_ADDR=<hostname of rank 0> (and MASTER_PORT)")
            return LaunchEnv(rank, size, local, addr, port, source)
    return LaunchEnv(0, 1, 0, None, port, "single")
