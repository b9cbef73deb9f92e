"""How long and how much memory `memorize train --dry-run` takes for the big fine-tune configs.

Each dry run is a fresh process (imports included, as a user runs it); wall time and its peak RSS
(getrusage of the child) are reported. The brief's bound: Llama-405B on 6,144 GPUs in <= 60 s and
<= 4 GB on a 2-core machine.

    python benchmarks/bench_dryrun.py [--out results.json]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from common import ROOT, report, write

CASES = [("llama-8b-finetune", 4), ("llama-70b-finetune", 64), ("llama-405b-finetune", 6144)]


def measure(config: str, world: int) -> dict:
    """Wall seconds and peak RSS (GiB) of one dry-run process."""
    cmd = [sys.executable, "-m", "memorization", "train", f"configs/train/{config}.yaml", "--dry-run",
           "--world", str(world), "--hardware", "alps-h100", "--json"]
    t0 = time.perf_counter()
    pid = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, env=dict(os.environ)).pid
    _, status, usage = os.wait4(pid, 0)
    took = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{config}: the dry run failed ({status})")
    return {"config": config, "world": world, "wall_s": took, "peak_rss_gib": usage.ru_maxrss / 2**20}


def main() -> None:
    """Run every case once and print its figures."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="JSON result path (default benchmarks/results/)")
    args = ap.parse_args()
    rows = []
    for config, world in CASES:
        r = measure(config, world)
        rows.append(r)
        report(f"{config}_{world}_wall_s", r["wall_s"])
        report(f"{config}_{world}_peak_rss_gib", r["peak_rss_gib"])
    write(args.out, "dryrun.json", {"cases": rows})


if __name__ == "__main__":
    main()
