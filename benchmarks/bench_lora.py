"""LoRA on a tensor split: per-rank memory of the frozen base, the adapters and their gradient and AdamW
state against the planner's model, and step time against serial (peft) LoRA.

The model is common.SMALL (4 layers, hidden 256, vocab 4096) in fp32 (the load dtype on a CPU; a GPU
run keeps its base in bf16, which the planner's Adapters.frozen_bytes models) with rank-8 adapters
on every linear layer.  Memory is counted from the tensors each rank holds after the run
(parameters, gradients, optimizer state: what the planner's weights/gradients/optimizer categories
model; activations are not counted); the planner's figures are axonn.plan.memory.memory_breakdown
with the run's Adapters.
Step time is the median of steps 3..N on each world (gloo on this machine's cores: an N-way split
runs N processes on the same 2 cores, so the ratio shows overhead, not speed-up).

    python benchmarks/bench_lora.py [--steps 6] [--grids 1,1,1,1 1,2,1,1 2,1,1,1 1,1,2,1]

Writes benchmarks/results/bench_lora.json and prints a table.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any

import torch
from common import SMALL, TokenRows, batch, llama, write
from transformers import LlamaConfig

import axonn
from axonn.config import TrainerConfig
from axonn.plan import load_shape
from axonn.plan.memory import adapter_params, local_params, memory_breakdown
from axonn.plan.volumes import Grid
from axonn.spawn import run_distributed
from axonn.trainer import Trainer
from memorization.mitigations.peft_lora import (
    LoraSettings,
    apply_lora,
    apply_sharded_lora,
    lora_targets,
    planner_adapters,
)

SETTINGS = LoraSettings(enabled=True, r=8, alpha=16.0, target_modules="all-linear")
MiB = 2**20



class _Clock:
    """Step end times (on_step_end)."""

    def __init__(self) -> None:
        self.t = [time.perf_counter()]

    def on_step_end(self, trainer: Any, metrics: dict) -> None:
        self.t.append(time.perf_counter())


def _cfg(steps: int) -> TrainerConfig:
    return TrainerConfig(lr=1e-3, warmup_steps=0, batch_size=8, max_steps=steps, progress=False, seed=0,
                         device="cpu", precision="fp32")


def _bytes(ts: Any) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _measure(model: torch.nn.Module, trainer: Trainer, clock: _Clock) -> dict[str, Any]:
    frozen = [p for p in model.parameters() if not p.requires_grad]
    trained = [p for p in model.parameters() if p.requires_grad]
    state = [v for s in trainer.optimizer.state.values() for v in s.values()
             if torch.is_tensor(v) and v.dim()]
    steps = [b - a for a, b in zip(clock.t, clock.t[1:])][2:]
    return {"frozen_params": sum(p.numel() for p in frozen), "base_bytes": _bytes(frozen),
            "adapter_params": sum(p.numel() for p in trained), "adapter_bytes": _bytes(trained),
            "grad_bytes": _bytes(p.grad for p in trained if p.grad is not None),
            "optimizer_bytes": _bytes(state),
            "step_s": statistics.median(steps)}


def _grid_run(rank: int, world: int, dims: tuple[int, ...], steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    grid = axonn.ProcessGrid(*dims)
    model = axonn.parallelize(llama(), grid, mode="paired")
    model = apply_sharded_lora(model, SETTINGS, lora_targets(llama(), SETTINGS), seed=0)
    clock = _Clock()
    trainer = Trainer(model, _cfg(steps), TokenRows(batch(64, 64, SMALL["vocab_size"])), grid=grid,
                      callbacks=[clock])
    trainer.fit()
    return _measure(model, trainer, clock)


def _serial(steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    model = apply_lora(llama(), SETTINGS, seed=0)
    clock = _Clock()
    trainer = Trainer(model, _cfg(steps), TokenRows(batch(64, 64, SMALL["vocab_size"])), callbacks=[clock])
    trainer.fit()
    return _measure(model, trainer, clock)


def _planner(dims: tuple[int, ...]) -> dict[str, float]:
    shape, g = load_shape(LlamaConfig(**SMALL)), Grid(*dims)
    adapters = planner_adapters(SETTINGS, llama(), "fp32")
    mem = memory_breakdown(shape, g, 64, 8, False, mode="paired", adapters=adapters, precision="fp32")
    return {"frozen_params": local_params(shape, g, "paired"),
            "adapter_params": adapter_params(shape, g, adapters, "paired"),
            "weights_bytes": mem["weights"], "grad_bytes": mem["gradients"],
            "optimizer_bytes": mem["optimizer"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--grids", nargs="+", default=["1,1,1,1", "1,2,1,1", "2,1,1,1", "1,1,2,1"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    serial = _serial(args.steps)
    rows = []
    for spec in args.grids:
        dims = tuple(int(v) for v in spec.split(","))
        n = math.prod(dims)
        got = run_distributed(_grid_run, n, dims, args.steps, timeout=1200)[0] if n > 1 else serial
        plan = _planner(dims)
        held = got["base_bytes"] + got["adapter_bytes"] + got["grad_bytes"] + got["optimizer_bytes"]
        modelled = plan["weights_bytes"] + plan["grad_bytes"] + plan["optimizer_bytes"]
        rows.append({"grid": spec, "split": n, "measured": got, "planner": plan,
                     "base_vs_serial_over_n": got["base_bytes"] / (serial["base_bytes"] / n),
                     "state_vs_planner": held / modelled, "step_vs_serial": got["step_s"] / serial["step_s"]})
    print(f"{'grid':9} {'base MiB':>9} {'base/(serial/N)':>15} {'adapters MiB':>12} {'grad+AdamW MiB':>14} "
          f"{'vs planner':>10} {'step s':>7} {'vs serial':>9}")
    for r in rows:
        m = r["measured"]
        print(f"{r['grid']:9} {m['base_bytes'] / MiB:9.2f} {r['base_vs_serial_over_n']:15.3f} "
              f"{m['adapter_bytes'] / MiB:12.3f} {(m['grad_bytes'] + m['optimizer_bytes']) / MiB:14.3f} "
              f"{r['state_vs_planner']:10.3f} {m['step_s']:7.3f} {r['step_vs_serial']:9.2f}")
    write(args.out, "bench_lora.json", {"settings": SETTINGS.__dict__, "steps": args.steps, "rows": rows})


if __name__ == "__main__":
    main()
