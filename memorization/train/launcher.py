"""`memorize train CONFIG --nproc-per-node N`: plan the run in this one process, then start torchrun.

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
from memorization.train.dryrun import plan_data
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
    if nproc < 1:
        raise fail("--nproc-per-node", nproc, "must be >= 1")
    inside = [src for src, rank, size, _ in LAUNCHERS if rank in os.environ and size in os.environ]
    if inside:
        raise fail("--nproc-per-node", nproc, f"this process was already started by {inside[0]}; run "
                   "`memorize train CONFIG --nproc-per-node N` from a plain shell (it starts torchrun)")
    data, _ = plan_data(cfg)  # DP-SGD's and eval.mia's row checks, when the data is on this machine
    plan_run(cfg, data, launch=Launch(nproc, nproc, detect_hardware()), spec=grid, out=out,
             overwrite=overwrite, resume=resume, here=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "memorization", *without_flag(argv, "--nproc-per-node")]
    return subprocess.call(cmd)


__all__ = ["launch_train", "without_flag"]
