#!/usr/bin/env python
"""Write the sbatch script of a memorize job for a Slurm cluster, and submit it.

    python scripts/slurm.py --cluster perlmutter|frontier|alps|generic --nodes N --config CONFIG
        [--grid auto|X,Y,Z,D] [--time HH:MM:SS] [--account A] [--dry-run] [-- overrides...]

Before anything is written the job is dry-run (memorization/train/dryrun.py) on nodes x GPUs per node
with the cluster's hardware preset: the grid is the performance model's pick (or yours, checked),
the model must shard evenly and fit in memory. The script holds the cluster's #SBATCH lines, CPU/GPU
binding and NCCL/RCCL environment (configs/clusters.yaml: data, no per-cluster code), the
rendezvous on the first node, W&B offline files on scratch, and the srun line with --resume auto,
so a requeued job continues from its newest checkpoint. --dry-run prints the script and submits
nothing; otherwise it is written (--script) and given to sbatch. Bad input: one line, exit 2,
nothing written or submitted. docs/cluster.md walks through it.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from axonn.config import load_yaml
from memorize_core import ConfigError, fail

TABLE = Path(__file__).resolve().parents[1] / "configs" / "clusters.yaml"
TIME = re.compile(r"^(\d+-)?\d{1,2}:\d{2}:\d{2}$")
REQUEUE_WARNING_S = 300  # USR1 this long before the walltime ends: requeue, resume from a checkpoint


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are ConfigErrors (one line, exit 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{message}; see --help")


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    p = _Parser(prog="slurm.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster", required=True, help="a cluster of configs/clusters.yaml")
    p.add_argument("--nodes", type=int, required=True, help="nodes of the allocation")
    p.add_argument("--config", required=True, help="a train config or an experiment config (kind:)")
    p.add_argument("--grid", default="auto", help="X,Y,Z,D or auto (the performance model's pick)")
    p.add_argument("--time", default=None, help="walltime HH:MM:SS (default: the cluster's)")
    p.add_argument("--account", default=None, help="project account to charge")
    p.add_argument("--dry-run", action="store_true", help="print the script; write and submit nothing")
    p.add_argument("--gpus-per-node", type=int, default=None, help="default: the cluster's")
    p.add_argument("--hardware", default=None, help="axonn-plan preset (default: the cluster's)")
    p.add_argument("--out", default=None, help="run folder on the cluster (default: scratch)")
    p.add_argument("--script", default=None, help="where to write the script (default slurm/...)")
    p.add_argument("--venv", default=os.environ.get("VIRTUAL_ENV"),
                   help="virtualenv to activate on the nodes (default: the active one, if any)")
    p.add_argument("--port", type=int, default=29500, help="rendezvous port on the first node")
    p.add_argument("--sbatch-arg", action="append", default=[], help="extra #SBATCH option (repeat)")
    p.add_argument("--srun-arg", action="append", default=[], help="extra srun option (repeat)")
    return p


def load_clusters(path: Path = TABLE) -> dict[str, dict[str, Any]]:
    """The per-cluster table."""
    return yaml.safe_load(path.read_text())


def _seconds(t: str) -> int:
    days, _, hms = t.rpartition("-")
    h, m, s = (int(x) for x in hms.split(":"))
    return (int(days) if days else 0) * 86400 + h * 3600 + m * 60 + s


def check_time(t: str, nodes: int, caps: list, cluster: str) -> None:
    """HH:MM:SS (or D-HH:MM:SS) within the cluster's cap for this many nodes."""
    if not TIME.match(t):
        raise fail("--time", t, "write the walltime as HH:MM:SS (or D-HH:MM:SS), e.g. --time 06:00:00")
    for max_nodes, cap in caps:
        if max_nodes is None or nodes <= max_nodes:
            if cap is not None and _seconds(t) > _seconds(cap):
                raise fail("--time", t, f"{cluster} caps jobs of {nodes} nodes at {cap}; ask for at most "
                           "that (a requeued job resumes from its checkpoint)")
            return


def command_of(config: str) -> str:
    """`run` for an experiment config (it has `kind:`), else `train`."""
    return "run" if "kind" in load_yaml(config) else "train"


def plan_job(args: argparse.Namespace, overrides: Sequence[str]) -> dict[str, Any]:
    """Validate everything and dry-run the job; the facts the script is written from."""
    clusters = load_clusters()
    if args.cluster not in clusters:
        raise fail("--cluster", args.cluster, f"unknown cluster; choose one of {', '.join(clusters)} "
                   "(or add it to configs/clusters.yaml)")
    c = clusters[args.cluster]
    if args.nodes < 1:
        raise fail("--nodes", args.nodes, "must be >= 1")
    if not 1 <= args.port <= 65535:
        raise fail("--port", args.port, "a TCP port is within 1..65535; pick a free one, e.g. 29500")
    if not Path(args.config).is_file():
        raise fail("--config", args.config,
                   "no such file; pass a YAML under configs/train or configs/experiments")
    time = args.time or c["time"]
    check_time(time, args.nodes, c["time_caps"], args.cluster)
    gpn = args.gpus_per_node if args.gpus_per_node is not None else c["gpus_per_node"]
    if gpn < 1:
        raise fail("--gpus-per-node", gpn, "must be >= 1")
    if not args.dry_run and "{account}" in " ".join(c["sbatch"]) and not args.account:
        raise fail("--account", None, f"{args.cluster} charges a project account; pass --account")
    command = command_of(args.config)
    # deferred: memorization.train.dryrun +2.8 s import (torch, transformers); --help and bad cluster, time,
    # node or account input are answered before it
    from memorization.train.dryrun import dry_run_command  # deferred: +2.8 s import

    world = args.nodes * gpn
    hardware = args.hardware or c["hardware"]
    kw = dict(world=world, gpus_per_node=gpn, hardware=hardware)
    reports = dry_run_command(command, args.config, overrides, grid=args.grid, **kw)
    dims = [reports[0]["grid"][k] for k in ("x", "y", "z", "data")]
    grid = ",".join(map(str, dims))
    models = {(r["model"]["name"], r["model"]["params"]) for r in reports}
    if len(reports) > 1 and args.grid == "auto":
        if len(models) > 1:  # a family of sizes: each run takes the grid the planner picks for its model
            grid = "auto"
        else:  # an experiment's runs of one model share one --grid
            reports = dry_run_command(command, args.config, overrides, grid=grid, **kw)
    seeds = []
    if command == "run":
        from memorization.experiments import load_experiment  # deferred: loaded with dryrun above

        exp = load_experiment(args.config, overrides)[1]
        seeds, replicate = list(exp.replicate.seeds), exp.replicate
        group = exp.base.wandb.group or exp.name
    return {"cluster": c, "time": time, "gpn": gpn, "world": world, "command": command,
            "grid": grid, "reports": reports, "hardware": hardware, "seeds": seeds,
            **({"replicate": replicate, "group": group} if seeds else {})}


def render(args: argparse.Namespace, job: dict[str, Any], overrides: Sequence[str]) -> str:
    """The sbatch script."""
    c, gpn, grid = job["cluster"], job["gpn"], job["grid"]
    fmt = {"account": args.account or "<account>", "gpus_per_node": gpn}
    r = job["reports"][0]
    name = r["name"]
    scratch = _fill(c["scratch"], fmt)
    out = args.out or f"{scratch}/memorize/runs/{name}"
    q = shlex.quote
    k = r["rank0"]
    seeds = job["seeds"]
    lines = [
        "#!/bin/bash",
        f"# memorize {job['command']} {args.config} on {args.cluster}: {args.nodes} node(s) x {gpn} GPUs, "
        f"grid {grid} (x,y,z,data)",
        f"# written by scripts/slurm.py after a dry run on {job['hardware']}: rank 0 needs "
        f"{k['total_bytes'] / 2**30:.1f} of {r['hardware']['usable_bytes'] / 2**30:.1f} GiB usable; "
        f"predicted {r['predicted']['step_s']:.3g} s/step, MFU {r['predicted']['mfu']:.1%}",
        *[f"# {n}" for n in c.get("notes", [])],
        *(_array_header(job, out) if seeds else []),
        f"#SBATCH --job-name=memorize-{name}",
        f"#SBATCH --nodes={args.nodes}",
        f"#SBATCH --ntasks-per-node={gpn}",
        f"#SBATCH --time={job['time']}",
        *[f"#SBATCH {_fill(s, fmt)}" for s in c["sbatch"]],
        "#SBATCH --output=" + ("%x-%A_%a.out" if seeds else "%x-%j.out"),
        "#SBATCH --open-mode=append",  # a requeued job appends to the same log
        "#SBATCH --requeue",
        f"#SBATCH --signal=B:USR1@{REQUEUE_WARNING_S}",
        *[f"#SBATCH {s}" for s in args.sbatch_arg],
        "",
        "set -o pipefail",
        f'cd "${{SLURM_SUBMIT_DIR:-{os.getcwd()}}}"',
        *[f"module load {m}" for m in c["modules"]],
        *([f"source {q(args.venv)}/bin/activate"] if args.venv else []),
        "",
        "# rendezvous: the first node of the allocation hosts rank 0 and the store",
        'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        f"export MASTER_PORT={args.port}",
        *([f"# {args.cluster}: NCCL/RCCL, network and threads (configs/clusters.yaml)"] if c["env"] else []),
        *[f'export {key}="{value}"' for key, value in c["env"].items()],
        "",
        "# runs, caches and W&B's offline files on scratch; afterwards from a login node:",
        '#   wandb sync "$OUT"/wandb/offline-run-*',
        *([f"SEEDS=({' '.join(map(str, seeds))})",
           'SEED="${SEEDS[${SLURM_ARRAY_TASK_ID:?submit this script with sbatch: one array task per seed}]}"',
           f'export OUT="{out}/seed-$SEED"'] if seeds else [f'export OUT="{out}"']),
        f'export MEMORIZE_CACHE="{scratch}/memorize/cache"',
        "export WANDB_MODE=offline",
        'export WANDB_DIR="$OUT"',
        f'export WANDB_CACHE_DIR="{scratch}/memorize/wandb-cache"',
        f'export WANDB_CONFIG_DIR="{scratch}/memorize/wandb-config"',
        "export TOKENIZERS_PARALLELISM=false",
        'mkdir -p "$OUT"',
        "",
        f"# {REQUEUE_WARNING_S} s before the walltime Slurm sends USR1: requeue; the next start resumes",
        "# from the newest sealed checkpoint in $OUT/checkpoints (--resume auto)",
        # an array task requeues itself alone: its own id is ARRAYID_TASK
        "trap 'echo \"[slurm.py] walltime near: requeueing job $SLURM_JOB_ID\" >&2; "
        + ("scontrol requeue \"${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}\"' USR1" if seeds else
           "scontrol requeue \"$SLURM_JOB_ID\"' USR1"),
        "",
        srun_line(args, job, overrides) + (_seed_overrides(job, name) if seeds else "") + " &",
        "pid=$!",
        "rc=0",
        'while kill -0 "$pid" 2>/dev/null; do wait "$pid"; rc=$?; done  # a trapped USR1 interrupts wait',
        'exit "$rc"',
    ]
    return "\n".join(lines) + "\n"


def _array_header(job: dict[str, Any], out: str) -> list[str]:
    """A job array, one task per replicate seed (each a job of its own), and how to average them."""
    seeds, rep = job["seeds"], job["replicate"]
    how = (f" --reference {shlex.quote(rep.reference)}" if rep.reference else "") + (
        f" --confidence {rep.confidence:g}" if rep.confidence != 0.95 else "")
    dirs = " ".join('"' + f"{out}/seed-{s}" + '"' for s in seeds)
    return [f"# replicate.seeds {list(seeds)}: one array task per seed, each the whole experiment in $OUT "
            "(OUT/seed-S); when all have finished, average them:",
            f'#   python -m memorization aggregate {dirs} --out "{out}"{how}',
            f"#SBATCH --array=0-{len(seeds) - 1}"]


def _seed_overrides(job: dict[str, Any], name: str) -> str:
    """What makes an array task one seed's experiment (as replicates.seeded does in one process)."""
    return (' "replicate.seeds=[]" "base.seed=$SEED" "base.trainer.seed=$SEED"'
            f' "name={name}-seed$SEED" {shlex.quote("base.wandb.group=" + job["group"])}')


def _fill(text: str, values: dict[str, Any]) -> str:
    """Replace {name} placeholders only: shell ${VAR:-default} braces stay as they are."""
    for key, value in values.items():
        text = text.replace("{" + key + "}", str(value))
    return text


def srun_line(args: argparse.Namespace, job: dict[str, Any], overrides: Sequence[str]) -> str:
    """The srun line that starts one task per GPU."""
    c = job["cluster"]
    opts = [f"--nodes={args.nodes}", f"--ntasks-per-node={job['gpn']}", "--kill-on-bad-exit=1",
            *c["srun"], *args.srun_arg]
    cmd = ["python", "-m", "memorization", job["command"], shlex.quote(args.config), "--grid", job["grid"],
           "--out", '"$OUT"']
    if job["command"] == "train":
        cmd += ["--resume", "auto"]
    return " ".join(["srun", *opts, *cmd, *(shlex.quote(o) for o in overrides)])


def default_script(args: argparse.Namespace, job: dict[str, Any]) -> Path:
    """slurm/<run name>-<cluster>-<nodes>n.sbatch under the current folder."""
    return Path("slurm") / f"{job['reports'][0]['name']}-{args.cluster}-{args.nodes}n.sbatch"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: 0 (printed or submitted), 2 on bad input (one line), 1 if sbatch fails."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    mine, overrides = argv[:cut], argv[cut + 1:]
    try:
        args = build_parser().parse_args(mine)
        job = plan_job(args, overrides)
        if job["reports"][0]["command"] == "train" and not _checkpoints(args.config, overrides):
            print("slurm.py: warning: trainer.checkpoint_every=0: a requeued job restarts from step 0; "
                  "add -- trainer.checkpoint_every=N", file=sys.stderr)
        text = render(args, job, overrides)
        if args.dry_run:
            sys.stdout.write(text)
            return 0
        if shutil.which("sbatch") is None:
            raise fail("sbatch", None, "not found on PATH; run this on the cluster's login node, or use "
                       "--dry-run to print the script")
        script = Path(args.script) if args.script else default_script(args, job)
    except ConfigError as e:
        print(f"slurm.py: error: {e}", file=sys.stderr)
        return 2
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(text)
    done = subprocess.run(["sbatch", str(script)], capture_output=True, text=True)
    sys.stdout.write(done.stdout)
    if done.returncode:
        print(f"slurm.py: sbatch failed ({done.returncode}): {done.stderr.strip()}", file=sys.stderr)
        return 1
    print(f"slurm.py: submitted {script}", file=sys.stderr)
    if job["seeds"]:
        print("slurm.py: an array of one task per seed; when every task has finished, average them with the "
              "command in the script's header (python -m memorization aggregate ...)", file=sys.stderr)
    return 0


def _checkpoints(config: str, overrides: Sequence[str]) -> bool:
    """Whether the train config writes periodic checkpoints."""
    from memorization.config import load_run_config  # deferred: +2.8 s import, as dryrun in plan_job

    return load_run_config(config, list(overrides)).trainer.checkpoint_every > 0


if __name__ == "__main__":
    raise SystemExit(main())
