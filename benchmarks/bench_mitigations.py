"""Cost of each mitigation on the SmolLM2-135M fine-tune: step time and peak memory, one process per arm.

The arms are those of configs/experiments/mitigations.yaml (their run-config overrides, applied to
configs/train/smollm2-wiki.yaml). Each arm runs `memorize train ... --steps N` in its own process,
so its peak resident set (VmHWM, read at exit) is that arm's alone (in the experiment every arm
shares one process and the allocator keeps what earlier arms used). Step time is the mean over
steps 3..N (steps 1-2 warm up), from the trainer's cumulative tokens/s in metrics.jsonl; the ratio
is against the `none` arm measured in the same invocation. The `dedup` arm is the `none` step on
fewer rows (its cost is fewer steps, not slower ones) and is not run.

    python benchmarks/bench_mitigations.py [--steps 8] [--arms none,goldfish,...] [--threads 2]
                                           [--rounds 3] [--per-sample]

`--rounds N` runs the chosen arms in turn N times (none, dp, none, dp, ...: a shared, noisy machine
slows neighbouring runs alike) and reports each arm's median step time, its largest peak RSS and the
median of the per-round ratios to `none`. `--per-sample` adds the DP-SGD arm again with Opacus'
per-sample clipping (trainer.dp.clipping=per_sample) beside the default ghost clipping.

Writes benchmarks/results/bench_mitigations.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from common import ROOT, peak_rss, write

EXPERIMENT = ROOT / "configs" / "experiments" / "mitigations.yaml"
CONFIG = ROOT / "configs" / "train" / "smollm2-wiki.yaml"
QUIET = ["trainer.progress=false", "wandb.mode=disabled", "eval.extraction=false", "data.held_out=''"]


def arms(names: list[str] | None) -> list[dict[str, Any]]:
    """The experiment's arms that change the step (all but dedup), optionally only `names`."""
    out = [a for a in yaml.safe_load(EXPERIMENT.read_text())["arms"] if not a.get("dedup")]
    if names:
        known = {a["name"] for a in out}
        bad = [n for n in names if n not in known]
        if bad:
            raise SystemExit(f"--arms: unknown {bad}; choose from {sorted(known)}")
        out = [a for a in out if a["name"] in names]
    return out


def step_seconds(metrics: Path, skip: int = 2) -> float:
    """Mean seconds per step after `skip` warm-up steps (tokens / cumulative tokens/s = elapsed)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "tokens_per_s" in r]
    elapsed = [r["tokens"] / r["tokens_per_s"] for r in rows]
    return (elapsed[-1] - elapsed[skip - 1]) / (len(rows) - skip)


def run_arm(arm: dict[str, Any], steps: int, threads: int) -> dict[str, Any]:
    """Train one arm for `steps` steps in a fresh process; its step time and peak RSS."""
    res = {"name": arm["name"], "mitigation": arm["mitigation"], "overrides": arm.get("overrides", [])}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        run = peak_rss(["-m", "memorization", "train", str(CONFIG), "--steps", str(steps), "--out", str(out),
                        *QUIET, *res["overrides"]], threads)
        res.update(rc=run["rc"], wall_s=run["wall_s"])
        if run["rc"]:
            res["log_tail"] = run["log_tail"]
            return res
        summary = json.loads((out / "run.json").read_text())["summary"]
        res.update(step_s=step_seconds(out / "metrics.jsonl"), peak_rss_gib=run["peak_rss_mib"] / 1024,
                   trainable_params=summary.get("trainable_params"), epsilon=summary.get("epsilon"))
    print(f"{arm['name']}: {res['step_s']:.2f} s/step, peak RSS {res['peak_rss_gib']:.2f} GiB", flush=True)
    return res


def _merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One arm over its rounds: median step time, largest peak RSS, every round's figures kept."""
    if len(runs) == 1 or any(r["rc"] for r in runs):
        return next((r for r in runs if r["rc"]), runs[0])
    out = {**runs[0], "rounds": [{"step_s": r["step_s"], "peak_rss_gib": r["peak_rss_gib"]} for r in runs]}
    out["step_s"] = statistics.median(r["step_s"] for r in runs)
    out["peak_rss_gib"] = max(r["peak_rss_gib"] for r in runs)
    return out


def _paired_ratios(results: list[dict[str, Any]]) -> None:
    """Each arm's median over rounds of (its step time / none's step time in the same round)."""
    base = next((r for r in results if r["name"] == "none" and "rounds" in r), None)
    for r in results:
        if base is not None and "rounds" in r:
            r["ratio_median"] = statistics.median(a["step_s"] / b["step_s"]
                                                  for a, b in zip(r["rounds"], base["rounds"]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="steps per arm (the first 2 are not timed)")
    ap.add_argument("--arms", default=None, help="comma-separated arm names (default: all but dedup)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of each arm's process")
    ap.add_argument("--rounds", type=int, default=1, help="run the arms in turn this many times")
    ap.add_argument("--per-sample", action="store_true",
                    help="add each DP-SGD arm with trainer.dp.clipping=per_sample (Opacus)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.steps < 4:
        raise SystemExit(f"--steps={args.steps}: use at least 4 (2 warm-up steps + 2 timed)")
    chosen = arms(args.arms.split(",") if args.arms else None)
    if args.per_sample:
        chosen += [{**a, "name": f"{a['name']}-per-sample",
                    "overrides": [*a.get("overrides", []), "trainer.dp.clipping=per_sample"]}
                   for a in chosen if a["mitigation"] == "dp-sgd"]
    rounds = [[run_arm(a, args.steps, args.threads) for a in chosen] for _ in range(args.rounds)]
    results = [_merge([rnd[i] for rnd in rounds]) for i in range(len(chosen))]
    base = next((r for r in results if r["name"] == "none" and r["rc"] == 0), None)
    _paired_ratios(results)
    print("\n| arm | s/step | x none | peak RSS GiB | trainable params | epsilon |")
    print("|---|---|---|---|---|---|")
    for r in results:
        if r["rc"]:
            print(f"| {r['name']} | failed | | | | |")
            continue
        r["step_time_vs_none"] = r.get("ratio_median", r["step_s"] / base["step_s"]) if base else None
        if base:
            r["peak_vs_none"] = r["peak_rss_gib"] / base["peak_rss_gib"]
        x = f"{r['step_time_vs_none']:.2f}" if base else "-"
        eps = f"{r['epsilon']:.2f}" if r.get("epsilon") else "-"
        print(f"| {r['name']} | {r['step_s']:.2f} | {x} | {r['peak_rss_gib']:.2f} | "
              f"{r['trainable_params']:,} | {eps} |")
    write(args.out, "bench_mitigations.json", {"steps": args.steps, "threads": args.threads,
                                               "rounds": args.rounds, "arms": results})
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
