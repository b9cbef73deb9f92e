"""Fault injection on gloo ranks: a killed or stopped rank makes the others exit, naming it.

Each rank sends its stderr to a file; the victim records when it died. The survivors must exit with
code 3 (watchdog.EXIT_LOST) within the collective timeout, printing one line naming the lost rank.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import grid_trainer

from axonn.grid import ProcessGrid
from axonn.spawn import run_ranks

LIMIT = 6.0  # collective_timeout_s used here (the default is 60)


class _Fault:
    """on_step_end hook: at `step` the victim kills or stops itself (or dies inside the save)."""

    def __init__(self, rank, victim, how, step, logdir):
        self.rank, self.victim, self.how, self.step, self.logdir = rank, victim, how, step, Path(logdir)

    def _die(self):
        (self.logdir / "victim.time").write_text(repr(time.time()))
        if self.how == "stop":  # something must reap it later; nobody else will
            subprocess.Popen(["sh", "-c", f"sleep {LIMIT + 5}; kill -9 {os.getpid()}"])
            os.kill(os.getpid(), signal.SIGSTOP)
        os.kill(os.getpid(), signal.SIGKILL)

    def on_step_end(self, trainer, metrics):
        if self.rank == self.victim and metrics["step"] == self.step and self.how != "save":
            self._die()


def _train_with_fault(rank, world, victim, how, logdir):
    fd = os.open(f"{logdir}/stderr-{rank}.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    import axonn
    from axonn import checkpoint
    from axonn.watchdog import start_watchdog

    grid = axonn.ProcessGrid(world, 1, 1, 1)
    dog = start_watchdog(grid, LIMIT)
    fault = _Fault(rank, victim, how, 3, logdir)
    if how == "save" and rank == victim:  # die after writing this rank's shard of the step-4 save
        real = checkpoint._write_atomic

        def dying(path, write):
            real(path, write)
            if "step-00000004" in str(path) and path.suffix == ".json":
                fault._die()
        checkpoint._write_atomic = dying
    t = grid_trainer(grid, f"{logdir}/ck")
    t.cfg.checkpoint_every, t.total_steps = 2, 50
    t.callbacks.append(fault)
    with dog.guard():
        t.fit()
    dog.stop()
    return "finished"


def _run(tmp_path, world, victim, how):
    t0 = time.time()
    results = run_ranks(_train_with_fault, world, victim, how, str(tmp_path), timeout=LIMIT + 40)
    died = float((tmp_path / "victim.time").read_text())
    for r in results:
        if r.rank == victim:
            continue
        err = (tmp_path / f"stderr-{r.rank}.txt").read_text()
        assert not r.ok and "exit code 3" in r.error, (r.error, err)
        lines = [x for x in err.splitlines() if x.startswith("error:")]
        assert len(lines) == 1 and f"rank {victim} is lost" in lines[0], err
        exited = (tmp_path / f"stderr-{r.rank}.txt").stat().st_mtime
        assert exited - died <= LIMIT + 3, f"rank {r.rank} took {exited - died:.1f}s to exit"
    return time.time() - t0


@pytest.mark.distributed
@pytest.mark.parametrize("world,victim,how", [
    (2, 0, "kill"), (2, 1, "stop"),
    pytest.param(2, 1, "kill", marks=pytest.mark.slow), pytest.param(2, 0, "stop", marks=pytest.mark.slow)])
def test_lost_rank_makes_the_others_exit(tmp_path, world, victim, how):
    _run(tmp_path, world, victim, how)


@pytest.mark.distributed
def test_kill_during_save_keeps_previous_checkpoint(tmp_path):
    from axonn import checkpoint

    _run(tmp_path, 2, 1, "save")
    root = tmp_path / "ck"
    assert checkpoint.latest_complete(root).name == "step-00000002"
    assert (root / ".tmp-step-00000004").exists() and not (root / "step-00000004").exists()
    t = grid_trainer(ProcessGrid.serial())
    t.load_checkpoint(checkpoint.latest_complete(root))  # loads, checksums verified
    assert t.state.step == 2
