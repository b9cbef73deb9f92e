"""`memorize train|run CONFIG --nproc-per-node N`: plan the run (every sub-run of an experiment) in this
one process, then start torchrun.

Under a bare `torchrun` every rank refuses a bad config by itself and torchrun adds its own summary
(a ChildFailedError traceback) below our one line. Here the whole plan (the grid for N processes,
every refusal, the data-dependent DP-SGD and membership checks) runs once before any rank exists, as
`accelerate launch` checks before it spawns: a refused launch is one line and exit 2, and nothing is
started or written. What passes is handed to `python -m torch.distributed.run --standalone` with the
same arguments (less --nproc-per-node), whose exit code this returns.
"""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

from axonn.launch import LAUNCHERS
from memorization.config import RunConfig
from memorization.outputs import check_writable
from memorization.train.dryrun import plan_data, run_configs
from memorization.train.parallel import Launch, detect_hardware
from memorization.train.run_plan import plan_run
from memorize_core import fail


def without_flag(argv: Sequence[str], flag: str) -> list[str]:
    """`argv` less `flag` and its value (`--flag N` or `--flag=N`)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


def launch_train(cfg: RunConfig, argv: Sequence[str], *, nproc: int, out: str, grid: str | None,
                 overwrite: bool, resume: str | None) -> int:
    """Plan `cfg` on `nproc` local processes (ConfigError: a refusal), then run torchrun: its exit code."""
    launch = _launch(nproc)
    data, _ = plan_data(cfg)  # DP-SGD's and eval.mia's row checks, when the data is on this machine
    plan_run(cfg, data, launch=launch, spec=grid, out=out, overwrite=overwrite, resume=resume, here=True)
    return _torchrun(argv, nproc)


def launch_experiment(config: str, overrides: Sequence[str], argv: Sequence[str], *, nproc: int,
                      out: str | None, grid: str | None) -> int:
    """Plan every sub-run of experiment `config` on `nproc` local processes, as `memorize run` checks
    them before its first trains (ConfigError: a refusal), then run torchrun: its exit code."""
    launch = _launch(nproc)
    _, subs = run_configs("run", config, overrides)  # the experiment's own checks, its arms' configs
    if out is not None:
        check_writable("--out", out)
    for sub in subs:
        rc, data = sub if isinstance(sub, tuple) else (sub, None)
        plan_run(rc, data, launch=launch, spec=grid, here=True)
    return _torchrun(argv, nproc)


def _launch(nproc: int) -> Launch:
    """The launch of `nproc` local processes; refused inside a launch (torchrun, srun, MPI)."""
    if nproc < 1:
        raise fail("--nproc-per-node", nproc, "must be >= 1")
    inside = [src for src, rank, size, _ in LAUNCHERS if rank in os.environ and size in os.environ]
    if inside:
        raise fail("--nproc-per-node", nproc, f"this process was already started by {inside[0]}; run "
                   "`memorize train|run CONFIG --nproc-per-node N` from a plain shell (it starts torchrun)")
    return Launch(nproc, nproc, detect_hardware())


def _torchrun(argv: Sequence[str], nproc: int) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "memorization", *without_flag(argv, "--nproc-per-node")]
    return subprocess.call(cmd)


__all__ = ["launch_experiment", "launch_train", "without_flag"]
