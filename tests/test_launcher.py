"""`memorize train CONFIG --nproc-per-node N` (memorization/train/launcher.py): the plan runs once in
this process; a refusal is one line and exit 2 with nothing started or written; a plan that passes
runs under torchrun on N ranks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import TINY

from memorization.cli import main
from memorization.train.launcher import without_flag

ROOT = Path(__file__).resolve().parents[1]


def test_without_flag():
    assert without_flag(["train", "c.yaml", "--nproc-per-node", "2", "--grid", "2,1,1,1"],
                        "--nproc-per-node") == ["train", "c.yaml", "--grid", "2,1,1,1"]
    assert without_flag(["--nproc-per-node=4", "x"], "--nproc-per-node") == ["x"]


@pytest.mark.parametrize("overrides,field", [
    (["--grid", "3,1,1,1"], "--grid"),  # 3 ranks' grid on 2 processes
    (["--grid", "1,1,1,2", "trainer.dp.enabled=true", "trainer.dp.noise_multiplier=1",
      "trainer.loss_chunk=1024"],
     "trainer.loss_chunk"),
])
def test_a_refused_launch_is_one_line_and_starts_nothing(capsys, tmp_path, monkeypatch, overrides, field):
    cfg = tmp_path / "t.yaml"
    cfg.write_text(TINY)
    started = []
    monkeypatch.setattr(subprocess, "call", lambda *a, **k: started.append(a) or 0)
    capsys.readouterr()
    code = main(["train", str(cfg), "--out", str(tmp_path / "out"), "--nproc-per-node", "2", *overrides])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and field in err, err
    assert not started and not (tmp_path / "out").exists()


def test_inside_a_launch_it_refuses(capsys, tmp_path, monkeypatch):
    cfg = tmp_path / "t.yaml"
    cfg.write_text(TINY)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train", str(cfg), "--nproc-per-node", "2", "--out", str(tmp_path / "o")]) == 2
    assert "already started by torchrun" in capsys.readouterr().err


@pytest.mark.distributed
def test_a_planned_launch_trains_on_two_ranks(tmp_path):
    cfg = tmp_path / "t.yaml"
    cfg.write_text(TINY)
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    r = subprocess.run([sys.executable, "-m", "memorization", "train", str(cfg), "--out", str(out),
                        "--nproc-per-node", "2", "--grid", "1,1,1,2"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((out / "run.json").read_text())["summary"]
    assert summary["grid"] == "1,1,1,2" and summary["steps"] == 2


@pytest.mark.parametrize("overrides,field", [
    (["--grid", "3,1,1,1"], "--grid"),  # every arm's grid is checked against the 2 processes
    (["base.model.lora.enabled=true", "base.model.lora.r=0"], "model.lora.r"),
])
def test_a_refused_experiment_launch_is_one_line_and_starts_nothing(capsys, tmp_path, monkeypatch, overrides,
                                                                    field):
    """`memorize run CONFIG --nproc-per-node N` plans every sub-run in this process first."""
    started = []
    monkeypatch.setattr(subprocess, "call", lambda *a, **k: started.append(a) or 0)
    capsys.readouterr()
    exp = str(ROOT / "configs/experiments/goldfish-extreme.yaml")
    code = main(["run", exp, "--out", str(tmp_path / "out"), "--nproc-per-node", "2", "base.data.limit=12",
                 *overrides])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and field in err, err
    assert not started and not (tmp_path / "out").exists()


def test_a_planned_experiment_launch_hands_its_arguments_to_torchrun(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(subprocess, "call", lambda cmd, **k: started.append(cmd) or 0)
    argv = ["run", str(ROOT / "configs/experiments/goldfish-extreme.yaml"), "--out", str(tmp_path / "out"),
            "--nproc-per-node", "2", "--grid", "1,1,1,2", "base.data.limit=12"]
    assert main(argv) == 0
    (cmd,) = started
    assert cmd[cmd.index("-m", 3) + 1:] == ["memorization", *without_flag(argv, "--nproc-per-node")]
    assert "--nproc-per-node=2" in cmd and not (tmp_path / "out").exists()
