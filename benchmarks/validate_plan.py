"""Validate the performance model (axonn.plan) against the engine on 8 gloo ranks.

(a) bytes: for every valid 8-rank grid of a small Llama, one step (forward, loss, backward,
    sync_gradients) is counted by `grid.stats` and compared per (collective, group) with
    `collective_counts(..., dtype_bytes=4)`: calls and bytes must be equal.
(b) time: every valid grid's measured step time (AdamW step included; two passes, forward then
    reverse grid order, median of the timed steps) vs `predict` with the `local` profile, fp32
    emulated by halving its bandwidths (the model counts bf16 bytes) and flop/s and bandwidth scaled
    by cores/ranks (8 ranks share the cores).  Reports the Spearman rank correlation and whether
    the measured best grid is in the predicted top 3.

A second prediction uses flop/s, all-reduce latency and bandwidth measured in situ by the 8 ranks
at once (the `local` profile is measured with 2 processes on an idle machine).
Prints `plan_bytes_exact: <fraction of grids>`, `plan_spearman_<local|in_situ>: <rho>`,
`plan_best_in_top3_<local|in_situ>: 0|1`; writes benchmarks/results/validate_plan.json.

    python benchmarks/validate_plan.py [--seq 32] [--batch 8] [--steps 4]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import common
import torch
import torch.distributed as dist
from bench_engine import engine_step
from common import report

import axonn
from axonn.plan.calibrate import get_hardware
from axonn.plan.model import predict
from axonn.plan.search import valid_grids
from axonn.plan.shapes import shape_from_config
from axonn.plan.volumes import Grid, collective_counts
from axonn.spawn import run_distributed

WORLD = 8


def _grids(batch: int) -> list[tuple[int, int, int, int]]:
    shape = shape_from_config(common.SMALL)
    return [(g.x, g.y, g.z, g.data) for g in valid_grids(shape, WORLD, batch, strict=True, mode="paired")]


def _volume_step(model: torch.nn.Module, ids: torch.Tensor, grid) -> dict:
    grid.stats.reset()
    local = axonn.shard_batch(ids, grid)
    logits = model(input_ids=local).logits[:, :-1]
    loss, _ = axonn.cross_entropy(logits, local[:, 1:], grid)
    loss.backward()
    axonn.sync_gradients(model, grid)
    model.zero_grad(set_to_none=True)
    snap = grid.stats.snapshot()
    return {f"{kind}/{g}": [v["calls"], v["bytes"]] for g, d in snap.items() for kind, v in d.items()}


def _median_time(fn, reps: int = 7) -> float:
    ts = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def calibrate_in_situ() -> dict:
    """This world's own speeds, all 8 ranks busy at once: matmul flop/s, all-reduce latency, bandwidth."""
    a = torch.randn(256, 256)
    t_mm = _median_time(lambda: [a @ a for _ in range(4)])
    small, big = torch.zeros(256), torch.zeros(1 << 20)  # 1 KiB, 4 MiB
    t_small = _median_time(lambda: dist.all_reduce(small))
    t_big = _median_time(lambda: dist.all_reduce(big))
    p = WORLD
    lat = t_small / (2 * (p - 1))
    bw = 2 * (p - 1) / p * (big.numel() - small.numel()) * 4 / max(t_big - t_small, 1e-9)
    return {"flops": 4 * 2 * 256**3 / t_mm, "lat_s": lat, "bw": bw}


def _rank(rank: int, world: int, grids: list, seq: int, batch: int, steps: int) -> dict:
    torch.set_num_threads(1)
    ids = common.batch(batch, seq, common.SMALL["vocab_size"])
    cal = calibrate_in_situ()
    counted, times = {}, {str(g): [] for g in grids}
    for pass_ in range(2):
        for dims in (grids if pass_ == 0 else grids[::-1]):
            grid = axonn.ProcessGrid(*dims)
            model = axonn.parallelize(common.llama(), grid, mode="paired")
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            engine_step(model, opt, ids, ids, grid)  # warm-up (and learns the prefetch chain)
            if pass_ == 0:
                counted[str(dims)] = _volume_step(model, ids, grid)
            for _ in range(steps):
                dist.barrier()
                t0 = time.perf_counter()
                engine_step(model, opt, ids, ids, grid)
                dist.barrier()
                times[str(dims)].append(time.perf_counter() - t0)
            del model, opt
    return {"counted": counted, "times": times, "calibration": cal}


def predicted(grids: list, seq: int, batch: int, cal: dict | None = None) -> dict[str, float]:
    """Predicted step seconds per grid: the local profile adjusted as in the module docstring, or
    (with `cal`) flop/s, latency and bandwidth measured in situ by the 8 busy ranks."""
    hw = get_hardware("local")
    share = (os.cpu_count() or 1) / WORLD
    hw = dataclasses.replace(hw, peak_flops=hw.peak_flops * share, hbm_bw=hw.hbm_bw * share / 2,
                             intra_bw=hw.intra_bw * share / 2, node_bw=hw.node_bw * share / 2,
                             gpus_per_node=WORLD)
    if cal is not None:  # fp32 on the wire: half the bandwidth in bf16-counted bytes
        hw = dataclasses.replace(hw, peak_flops=cal["flops"], intra_bw=cal["bw"] / 2,
                                 node_bw=cal["bw"] / 2, intra_lat=cal["lat_s"], inter_lat=cal["lat_s"])
    shape = shape_from_config(common.SMALL)
    return {str(g): predict(shape, Grid(*g), seq, batch, hw, gpus_per_node=WORLD, checkpoint=False,
                            mode="paired").time_s for g in grids}


def main(argv: list[str] | None = None) -> int:
    """Run the validation and write its JSON."""
    # at the top, each of the 8 spawned ranks (they re-import this script) would pay it too
    from scipy.stats import spearmanr  # deferred: scipy.stats +1.0 s import, only this summary uses it

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    grids = _grids(args.batch)
    res = run_distributed(_rank, WORLD, grids, args.seq, args.batch, args.steps, timeout=1800)
    shape = shape_from_config(common.SMALL)
    exact, mismatches = 0, {}
    for dims in grids:
        want = {f"{k}/{g}": [c, b] for (k, g), (c, b) in
                collective_counts(shape, args.seq, args.batch, *dims, dtype_bytes=4, mode="paired").items()}
        ok = all(r["counted"][str(dims)] == want for r in res)
        got = res[0]["counted"][str(dims)]
        exact += ok  # every rank must match (ranks differ only by coordinates)
        if not ok:
            mismatches[str(dims)] = {"engine": got, "model": want}
    # the step ends when the slowest rank ends: per step the max over ranks, then the median
    measured = {str(g): statistics.median(max(r["times"][str(g)][i] for r in res)
                                          for i in range(len(res[0]["times"][str(g)]))) for g in grids}
    keys = [str(g) for g in grids]
    best = min(keys, key=measured.get)
    cal = res[0]["calibration"]
    preds = {"local": predicted(grids, args.seq, args.batch),
             "in_situ": predicted(grids, args.seq, args.batch, cal)}
    report("plan_bytes_exact", exact / len(grids))
    print(f"  {exact}/{len(grids)} grids: calls and bytes equal the model", flush=True)
    summary = {}
    for name, pred in preds.items():
        rho = float(spearmanr([measured[k] for k in keys], [pred[k] for k in keys]).statistic)
        top3 = sorted(keys, key=pred.get)[:3]
        summary[name] = {"spearman": rho, "top3": top3, "best_in_top3": best in top3}
        report(f"plan_spearman_{name}", rho)
        report(f"plan_best_in_top3_{name}", float(best in top3))
        print(f"  measured best {best} ({measured[best]:.3f} s); predicted top 3 ({name}) {top3}", flush=True)
    print(f"  in-situ calibration: {cal}", flush=True)
    pred = preds["in_situ"]
    rows = sorted(keys, key=measured.get)
    for k in rows:
        print(f"  {k:>14}  measured {measured[k]:.3f} s  predicted local {preds['local'][k]:.4f} s  "
              f"in-situ {pred[k]:.4f} s", flush=True)
    common.write(args.out, "validate_plan.json", {
        "args": vars(args), "model": common.SMALL, "grids": keys, "bytes_exact": exact,
        "mismatches": mismatches, "measured_s": measured, "predicted_s": preds, "summary": summary,
        "calibration_in_situ": cal, "measured_best": best, "raw_times_rank0": res[0]["times"]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
