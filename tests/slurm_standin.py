"""Stand-ins for Slurm's `srun` and `scontrol` on one machine, for the multi-node launch tests.

    python slurm_standin.py srun [--nodes=N] [--ntasks-per-node=T] [--kill-on-bad-exit=1] ... CMD ARGS
    python slurm_standin.py scontrol show hostnames LIST | scontrol requeue JOBID

`srun` starts N x T copies of CMD, each with the SLURM_* variables a real srun gives a task
(SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID, SLURM_NTASKS, SLURM_NNODES, SLURM_NTASKS_PER_NODE,
SLURMD_NODENAME, ...; node n is the n-th host of SLURM_JOB_NODELIST) and the caller's environment,
as srun propagates it. Like srun, it waits for every task; with --kill-on-bad-exit=1 the first task
to exit non-zero gets the others killed, and srun exits with that code. Options it does not model
(binding, GPUs) are accepted and ignored; tasks are ended the way slurmstepd ends a step (SIGCONT
and SIGTERM, SIGKILL after KILL_WAIT_S). If STANDIN_SRUN_PIDS names a file, the tasks' pids are
written there as JSON {rank: pid} so a test can stop or kill one.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

KILL_WAIT_S = 2.0  # Slurm's KillWait (30 s by default), shortened for tests


def hostnames(nodelist: str) -> list[str]:
    """Expand a Slurm node list: "a,b", "nid[001-003,007]"."""
    out = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", nodelist):
        m = re.match(r"^(.*)\[(.*)\]$", part)
        if not m:
            out.append(part)
            continue
        prefix, ranges = m.groups()
        for r in ranges.split(","):
            a, _, b = r.partition("-")
            for i in range(int(a), int(b or a) + 1):
                out.append(f"{prefix}{str(i).zfill(len(a))}")
    return out


def _options(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """srun's options (--key=value / --flag / -N n / -n n) and the command after them."""
    opts: dict[str, str] = {}
    i = 0
    short = {"-N": "nodes", "-n": "ntasks", "-c": "cpus-per-task"}
    while i < len(argv) and argv[i].startswith("-"):
        a = argv[i]
        if a in short:
            opts[short[a]] = argv[i + 1]
            i += 2
            continue
        key, _, value = a.lstrip("-").partition("=")
        opts[key] = value or "1"
        i += 1
    return opts, argv[i:]


def srun(argv: list[str]) -> int:
    """Run the tasks; the exit code of the first failing task (0 when all succeed)."""
    opts, cmd = _options(argv)
    nodes = hostnames(os.environ.get("SLURM_JOB_NODELIST", "localhost"))
    n_nodes = int(opts.get("nodes", os.environ.get("SLURM_NNODES", len(nodes))))
    per_node = int(opts.get("ntasks-per-node") or int(opts.get("ntasks", n_nodes)) // n_nodes)
    total = n_nodes * per_node
    kill_on_bad = opts.get("kill-on-bad-exit", "0") != "0" or "K" in opts
    procs = []
    for node in range(n_nodes):
        for local in range(per_node):
            rank = node * per_node + local
            env = {k: v for k, v in os.environ.items()
                   if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
            env.update(SLURM_PROCID=str(rank), SLURM_LOCALID=str(local), SLURM_NODEID=str(node),
                       SLURM_NTASKS=str(total), SLURM_NPROCS=str(total), SLURM_NNODES=str(n_nodes),
                       SLURM_STEP_NUM_TASKS=str(total), SLURM_STEP_NUM_NODES=str(n_nodes),
                       SLURM_NTASKS_PER_NODE=str(per_node),
                       SLURM_TASKS_PER_NODE=f"{per_node}(x{n_nodes})",
                       SLURM_STEP_NODELIST=",".join(nodes[:n_nodes]),
                       SLURMD_NODENAME=nodes[node % len(nodes)], SLURM_STEP_ID="0")
            if "cpus-per-task" in opts:
                env["SLURM_CPUS_PER_TASK"] = opts["cpus-per-task"]
            procs.append(subprocess.Popen(cmd, env=env))
    if os.environ.get("STANDIN_SRUN_PIDS"):
        with open(os.environ["STANDIN_SRUN_PIDS"], "w") as fh:
            json.dump({r: p.pid for r, p in enumerate(procs)}, fh)

    def forward(signum, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code, killed_at = 0, 0.0
    while any(p.poll() is None for p in procs):
        bad = [p.returncode for p in procs if p.returncode not in (None, 0)]
        if bad and kill_on_bad and not code:
            code = bad[0]
            # as slurmstepd ends a step: SIGCONT + SIGTERM to the rest, SIGKILL after a grace period
            killed_at = time.monotonic()
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGCONT)
                    p.send_signal(signal.SIGTERM)
        if code and time.monotonic() - killed_at > KILL_WAIT_S:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.05)
    bad = [p.returncode for p in procs if p.returncode != 0]
    return code or (bad[0] if bad else 0)


def scontrol(argv: list[str]) -> int:
    """`scontrol show hostnames LIST` and a no-op `scontrol requeue`."""
    if argv[:2] == ["show", "hostnames"]:
        print("\n".join(hostnames(argv[2] if len(argv) > 2 else os.environ["SLURM_JOB_NODELIST"])))
        return 0
    if argv[:1] == ["requeue"]:
        print(f"[stand-in scontrol] requeue {' '.join(argv[1:])}", file=sys.stderr)
        return 0
    print(f"stand-in scontrol: unsupported: {' '.join(argv)}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    tool, rest = sys.argv[1], sys.argv[2:]
    sys.exit(srun(rest) if tool == "srun" else scontrol(rest))
