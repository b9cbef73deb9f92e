"""scripts/slurm.py: sbatch scripts for Perlmutter, Frontier, Alps and any Slurm cluster.

The scripts parse (`bash -n`) and allocate exactly the GPUs their grid uses; bad input is one line,
exit code 2, nothing written or submitted; and the srun line a script holds, run through stand-in
`srun`/`scontrol` (tests/slurm_standin.py) as 2 "nodes" x 2 tasks with the SLURM_* variables a
real srun sets, trains 3 steps at grid 2,1,1,2 with the serial run's per-step losses; a task that
stops (hung, not dead) makes every other task end within the collective timeout, naming it.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from axonn.spawn import free_port

ROOT = Path(__file__).resolve().parents[1]
STANDIN = Path(__file__).resolve().parent / "slurm_standin.py"


def _slurm():
    spec = importlib.util.spec_from_file_location("slurm_script", ROOT / "scripts" / "slurm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SLURM = _slurm()


@pytest.fixture
def bin_dir(tmp_path, monkeypatch):
    """A PATH folder with stand-in srun/scontrol, a recording sbatch, and this interpreter as python."""
    d = tmp_path / "bin"
    d.mkdir()
    for tool in ("srun", "scontrol"):
        (d / tool).write_text(f'#!/bin/sh\nexec "{sys.executable}" "{STANDIN}" {tool} "$@"\n')
        (d / tool).chmod(0o755)
    (d / "sbatch").write_text(f'#!/bin/sh\necho "$@" >> "{tmp_path}/sbatch-calls"\n'
                              'echo "Submitted batch job 42"\n')
    (d / "sbatch").chmod(0o755)
    # a wrapper, not a symlink: a symlinked venv python outside its venv folder finds no pyvenv.cfg and
    # runs as the base interpreter, without the venv's packages
    (d / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (d / "python").chmod(0o755)
    monkeypatch.setenv("PATH", f"{d}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("VIRTUAL_ENV", raising=False)
    return d


def _script(capsys, *argv: str) -> str:
    assert SLURM.main(list(argv)) == 0
    return capsys.readouterr().out


def _allocation(text: str) -> tuple[int, int, tuple[int, ...]]:
    nodes = int(re.search(r"^#SBATCH --nodes=(\d+)$", text, re.M).group(1))
    per_node = int(re.search(r"^#SBATCH --ntasks-per-node=(\d+)$", text, re.M).group(1))
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    grid = tuple(int(v) for v in re.search(r"--grid (\d+,\d+,\d+,\d+)", srun).group(1).split(","))
    assert f"--nodes={nodes}" in srun and f"--ntasks-per-node={per_node}" in srun
    return nodes, per_node, grid


@pytest.mark.parametrize("cluster,nodes,gpus", [("perlmutter", 4, 4), ("frontier", 1, 8), ("alps", 1, 4),
                                                ("generic", 1, 8)])
def test_scripts_parse_and_allocate_the_grid(tmp_path, capsys, bin_dir, cluster, nodes, gpus):
    text = _script(capsys, "--cluster", cluster, "--nodes", str(nodes), "--config",
                   "configs/train/llama-8b-finetune.yaml", "--account", "proj1", "--dry-run")
    path = tmp_path / "job.sbatch"
    path.write_text(text)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    n, per_node, grid = _allocation(text)
    assert (n, per_node) == (nodes, gpus) and grid[0] * grid[1] * grid[2] * grid[3] == nodes * gpus
    table = SLURM.load_clusters()[cluster]
    for key, value in table["env"].items():  # the system's NCCL/RCCL environment
        assert f'export {key}="{value}"' in text
    for module in table["modules"]:
        assert f"module load {module}" in text
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1' in text
    assert "--resume auto" in text and "#SBATCH --requeue" in text and "WANDB_MODE=offline" in text
    assert not (tmp_path / "sbatch-calls").exists()


def test_experiment_config_runs_memorize_run(capsys, bin_dir):
    text = _script(capsys, "--cluster", "generic", "--nodes", "1", "--gpus-per-node", "2", "--config",
                   "configs/experiments/goldfish-extreme.yaml", "--dry-run")
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert " -m memorization run configs/experiments/goldfish-extreme.yaml --grid " in srun
    assert "--resume" not in srun  # experiments reuse finished runs by themselves


def test_submits_with_sbatch(tmp_path, capsys, bin_dir):
    script = tmp_path / "jobs" / "x.sbatch"
    assert SLURM.main(["--cluster", "alps", "--nodes", "1",
                       "--config", "configs/train/llama-8b-finetune.yaml",
                       "--account", "a1", "--script", str(script), "--time", "01:00:00"]) == 0
    assert "#SBATCH --time=01:00:00" in script.read_text()
    assert (tmp_path / "sbatch-calls").read_text().split() == [str(script)]
    assert "Submitted batch job 42" in capsys.readouterr().out


@pytest.mark.parametrize("argv,field", [
    (["--cluster", "summit", "--nodes", "1"], "--cluster='summit'"),
    (["--cluster", "alps", "--nodes", "0"], "--nodes=0"),
    (["--cluster", "alps", "--nodes", "1", "--grid", "1,1,2,1"], "--grid='1,1,2,1'"),
    (["--cluster", "perlmutter", "--nodes", "1"], "--grid='auto'"),  # 8B does not fit 4 x 40 GB
    (["--cluster", "alps", "--nodes", "1", "--grid", "1,1,1,4"], "--grid='1,1,1,4'"),  # whole model per GPU
    (["--cluster", "frontier", "--nodes", "100", "--time", "08:00:00"], "--time='08:00:00'"),
    (["--cluster", "alps", "--nodes", "1", "--time", "8h"], "--time='8h'"),
])
def test_bad_input_is_one_line_and_nothing_happens(tmp_path, capsys, bin_dir, argv, field):
    script = tmp_path / "never.sbatch"
    config = ["--config", "configs/train/llama-8b-finetune.yaml"]
    code = SLURM.main(argv + config + ["--account", "a1", "--script", str(script)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and field in err[0], err
    assert not script.exists() and not (tmp_path / "sbatch-calls").exists()


def test_missing_config_and_bad_model_grid(tmp_path, capsys, bin_dir):
    assert SLURM.main(["--cluster", "alps", "--nodes", "1", "--config", "configs/train/nope.yaml"]) == 2
    assert "--config='configs/train/nope.yaml'" in capsys.readouterr().err
    # 3 does not divide Llama 8B's 32 heads (paired mode splits heads over y)
    assert SLURM.main(["--cluster", "generic", "--nodes", "1", "--gpus-per-node", "3", "--grid", "1,3,1,1",
                       "--config", "configs/train/llama-8b-finetune.yaml", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "grid.y=3" in err and err.count("\n") == 1


# -- the multi-node launch through stand-in srun -----------------------------------------------

OVERRIDES = ["data.limit=16", "data.vocab_size=512", 'data.held_out=""', "eval.extraction=false",
             "wandb.mode=disabled", "trainer.progress=false", "trainer.warmup_steps=0"]


def _job(tmp_path, capsys, out: Path, extra: list[str]) -> tuple[Path, dict]:
    """The generic-cluster script for 2 nodes x 2 tasks at grid 2,1,1,2, and the env sbatch gives it."""
    text = _script(capsys, "--cluster", "generic", "--nodes", "2", "--gpus-per-node", "2",
                   "--grid", "2,1,1,2",
                   "--config", "configs/train/tiny-wiki.yaml", "--out", str(out), "--port", str(free_port()),
                   "--dry-run", "--", *OVERRIDES, *extra)
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    env = dict(os.environ, SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="127.0.0.1,127.0.0.2", SLURM_NNODES="2",
               SLURM_SUBMIT_DIR=str(ROOT), OMP_NUM_THREADS="1", MEMORIZE_CACHE=str(tmp_path / "cache"))
    return script, env


def _losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.distributed
def test_standin_srun_trains_like_serial(tmp_path, capsys, bin_dir, monkeypatch):
    script, env = _job(tmp_path, capsys, tmp_path / "multi", ["trainer.max_steps=3"])
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    multi = _losses(tmp_path / "multi" / "metrics.jsonl")
    summary = json.loads((tmp_path / "multi" / "run.json").read_text())["summary"]
    assert summary["grid"] == "2,1,1,2" and summary["steps"] == 3

    from memorization.cli import main

    monkeypatch.setenv("MEMORIZE_CACHE", str(tmp_path / "cache"))
    assert main(["train", "configs/train/tiny-wiki.yaml", "--out", str(tmp_path / "serial"),
                 *OVERRIDES, "trainer.max_steps=3"]) == 0
    serial = _losses(tmp_path / "serial" / "metrics.jsonl")
    assert len(multi) == len(serial) == 3
    assert multi == pytest.approx(serial, rel=1e-5), (multi, serial)


@pytest.mark.distributed
# ~1 min on 2 cores; default runs cover the verdict (test_watchdog_scale) and exits (test_faults)
@pytest.mark.slow
def test_standin_srun_lost_task_ends_every_task(tmp_path, capsys, bin_dir):
    limit = 6.0
    out = tmp_path / "lost"
    script, env = _job(tmp_path, capsys, out, ["trainer.max_steps=100000",
                                               f"trainer.collective_timeout_s={limit}"])
    env["STANDIN_SRUN_PIDS"] = str(tmp_path / "pids.json")
    job = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    try:
        deadline = time.time() + 240
        metrics = out / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert job.poll() is None and time.time() < deadline, "training did not start"
            time.sleep(0.2)
        victim = json.loads((tmp_path / "pids.json").read_text())["3"]  # the second "node"
        os.kill(victim, signal.SIGSTOP)  # hung, not dead: only the heartbeat can tell
        stopped = time.time()
        _, err = job.communicate(timeout=limit + 60)
        took = time.time() - stopped
    finally:
        if job.poll() is None:
            job.kill()
    # the survivors' lines name rank 3 (never the store host, rank 0, as it leaves); srun's
    # --kill-on-bad-exit may end a survivor before it prints, and wakes the victim to end it
    lost = [line for line in err.splitlines() if line.startswith("error:") and "rank 3 exits" not in line]
    assert job.returncode != 0
    assert lost and all(line.startswith("error: rank 3 is lost") for line in lost), err[-3000:]
    assert took <= limit + 10, f"the job took {took:.1f}s to end after the task stopped"


@pytest.mark.distributed
def test_replicates_become_a_job_array_whose_tasks_the_header_averages(tmp_path, capsys, bin_dir):
    """replicate.seeds [0, 3]: an array of one task per seed (task i runs seed i's whole experiment in
    OUT/seed-S on 1 node x 2 tasks), and the aggregate command in the header averages what they wrote."""
    micro = ["base.data.limit=8", "base.data.vocab_size=300", "base.data.block_len=32",
             "base.data.min_tokens=16", "base.eval.prefix=8", "base.eval.suffix=8", "base.trainer.epochs=2",
             "base.trainer.batch_size=2", "base.model.overrides={hidden_size: 32, num_hidden_layers: 1, "
             "intermediate_size: 64, num_attention_heads: 2, num_key_value_heads: 2}",
             "base.wandb.mode=disabled", "base.trainer.progress=false", "variants=[standard]",
             "replicate.seeds=[0, 3]", "replicate.reference=standard"]
    out = tmp_path / "my runs" / "rep"  # a space in the path
    text = _script(capsys, "--cluster", "generic", "--nodes", "1", "--gpus-per-node", "2",
                   "--grid", "1,1,1,2", "--config", "configs/experiments/goldfish-extreme.yaml",
                   "--out", str(out), "--port", str(free_port()), "--dry-run", "--", *micro)
    assert "#SBATCH --array=0-1" in text and "#SBATCH --output=%x-%A_%a.out" in text
    assert 'scontrol requeue "${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"' in text  # this task alone
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    for task in ("0", "1"):
        env = dict(os.environ, SLURM_JOB_ID=f"77{task}", SLURM_ARRAY_JOB_ID="770", SLURM_ARRAY_TASK_ID=task,
                   SLURM_JOB_NODELIST="127.0.0.1", SLURM_NNODES="1", SLURM_SUBMIT_DIR=str(ROOT),
                   OMP_NUM_THREADS="1", MEMORIZE_CACHE=str(tmp_path / "cache"))
        done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    for seed in (0, 3):
        report = json.loads((out / f"seed-{seed}" / "report.json").read_text())
        assert report["config"]["base"]["seed"] == report["config"]["base"]["trainer"]["seed"] == seed
        assert report["config"]["replicate"]["seeds"] == []  # each task is one seed's experiment
        assert report["config"]["name"] == f"goldfish-extreme-seed{seed}"
        assert report["config"]["base"]["wandb"]["group"] == "goldfish-extreme"
    average = re.search(r"^#   (python -m memorization aggregate .*)$", text, re.M).group(1)
    done = subprocess.run(average, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, MEMORIZE_CACHE=str(tmp_path / "cache")))
    assert done.returncode == 0, done.stderr[-3000:]
    average = json.loads((out / "report.json").read_text())["replicate"]
    assert average["seeds"] == [0, 3] and average["reference"] == "standard"
