"""Predicted sustained PF/s at the AxoNN paper's scales, beside the paper's headline numbers.

For GPT-style 5B-320B and Llama 405B on Perlmutter (4,096 A100), Frontier (32,768 MI250X GCDs)
and Alps (6,144 H100) the planner searches every (x, y, z, data) and reports the best that fits,
with and without communication overlap. Writes JSON and a markdown table.

    python benchmarks/plan_paper_scale.py [--out-dir benchmarks/results] [--seq 2048]
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from pathlib import Path

from axonn.plan import load_shape, plan
from memorize_core import ConfigError

# (preset, GPUs, global batch in sequences, paper headline PF/s). Batch: half a sequence per GPU
# (our choice: 4.2M, 33.6M and 6.3M tokens per step at seq 2048).
SYSTEMS = [
    ("perlmutter-a100", 4096, 2048, 620.1),
    ("frontier-mi250x", 32768, 16384, 1381.0),
    ("alps-h100", 6144, 3072, 1423.0),
]
MODELS = ["gpt-5b", "gpt-10b", "gpt-20b", "gpt-40b", "gpt-80b", "gpt-160b", "gpt-320b",
          "llama-405b"]


def best(model: str, hw: str, gpus: int, seq: int, batch: int, overlap: bool) -> dict | None:
    """The planner's best configuration as a dict (None when nothing fits)."""
    try:
        top = plan(model, gpus, None, seq, batch, hw, overlap=overlap)[0]
    except ConfigError as e:
        return {"error": str(e)}
    return top.as_dict()


def run(seq: int) -> list[dict]:
    """Every (system, model) row."""
    rows = []
    for hw, gpus, batch, paper in SYSTEMS:
        for model in MODELS:
            t0 = time.perf_counter()
            on = best(model, hw, gpus, seq, batch, overlap=True)
            off = best(model, hw, gpus, seq, batch, overlap=False)
            rows.append({"system": hw, "gpus": gpus, "global_batch": batch, "seq": seq,
                         "model": model, "params_b": load_shape(model).params / 1e9,
                         "paper_pflops": paper, "best": on, "best_no_overlap": off,
                         "search_s": time.perf_counter() - t0})
            print(_line(rows[-1]), flush=True)
    return rows


def _line(r: dict) -> str:
    b, n = r["best"], r["best_no_overlap"]
    if "error" in b:
        return f"{r['system']:<16} {r['model']:<11} no fit: {b['error']}"
    grid = f"({b['x']},{b['y']},{b['z']},{b['data']})"
    even = "" if b["even_batch"] else "*"
    no = f"{n['pflops']:.0f}" if "error" not in n else "-"
    return (f"{r['system']:<16} {r['model']:<11} {grid + even:<18} mb {b['micro_batch']:<3} "
            f"ckpt {'on ' if b['checkpoint_activations'] else 'off'} "
            f"{b['time_s']:8.2f} s  {b['tflops_per_gpu']:6.1f} TF/s/GPU "
            f"{b['pct_peak']:5.1f}%  {b['pflops']:7.0f} PF/s (no overlap {no})")


def markdown(rows: list[dict], command: str) -> str:
    """The table for docs/planning.md."""
    out = [f"Date {datetime.date.today()}, machine `{platform.node()}` ({platform.machine()}), "
           f"command `{command}`.", "",
           "| system | GPUs | model | params | best (x,y,z,data) | mb | ckpt | step s | "
           "TF/s/GPU | % peak | PF/s | PF/s no overlap | paper PF/s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b, n = r["best"], r["best_no_overlap"]
        head = f"| {r['system']} | {r['gpus']} | {r['model']} | {r['params_b']:.1f}B |"
        if "error" in b:
            out.append(head + " no configuration fits | | | | | | | | |")
            continue
        even = "" if b["even_batch"] else "*"
        no = f"{n['pflops']:.0f}" if "error" not in n else "-"
        out.append(f"{head} ({b['x']},{b['y']},{b['z']},{b['data']}){even} | {b['micro_batch']} | "
                   f"{'on' if b['checkpoint_activations'] else 'off'} | {b['time_s']:.2f} | "
                   f"{b['tflops_per_gpu']:.1f} | {b['pct_peak']:.1f} | {b['pflops']:.0f} | {no} | "
                   f"{r['paper_pflops']:.1f} |")
    out += ["", "`*`: z*data does not divide the global batch (uneven Z split; the engine's "
            "shard_batch needs an even one). The paper column is the paper's headline for the "
            "system (its best model), repeated on each row."]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Run the sweep and write plan_paper_scale.{json,md}."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out-dir", default="benchmarks/results")
    p.add_argument("--seq", type=int, default=2048)
    args = p.parse_args(argv)
    command = "python benchmarks/plan_paper_scale.py" + (f" --seq {args.seq}" if args.seq != 2048 else "")
    rows = run(args.seq)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan_paper_scale.json").write_text(json.dumps(rows, indent=1))
    md = markdown(rows, command)
    (out / "plan_paper_scale.md").write_text(md + "\n")
    print()
    print(md)
    for hw, _, _, paper in SYSTEMS:
        ok = [r for r in rows if r["system"] == hw and "error" not in r["best"]]
        if ok:
            top = max(ok, key=lambda r: r["best"]["pflops"])
            print(f"{hw}: best predicted {top['best']['pflops']:.0f} PF/s ({top['model']}) vs "
                  f"paper {paper:.1f} PF/s -> ratio {top['best']['pflops'] / paper:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
