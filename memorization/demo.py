"""`memorize demo`: standard vs goldfish loss on real Wikipedia leads, from the same seed."""
from __future__ import annotations

import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch

from memorization.config import RunConfig, load_run_config
from memorization.models import REPO_ROOT
from memorization.report import read_metrics, text_table, write_report
from memorization.train.parallel import grid_spec, is_main_process, wants_grid
from memorization.train.pipeline import check_out_dir, prepare_out_dir, run_training
from memorization.train.prepare import prepare_data

DEMO_CONFIG = REPO_ROOT / "configs" / "train" / "tiny-wiki.yaml"


def demo_configs(epochs: int | None = None, overrides: list[str] | None = None) -> list[RunConfig]:
    """The two runs: standard loss and goldfish (hash, k=4, h=13), otherwise identical."""
    base = load_run_config(DEMO_CONFIG, overrides)
    if epochs is not None:
        base = replace(base, trainer=replace(base.trainer, epochs=epochs, max_steps=0))
    standard = replace(base, name="standard", goldfish=replace(base.goldfish, enabled=False))
    goldfish = replace(base, name="goldfish", goldfish=replace(base.goldfish, enabled=True))
    return [standard, goldfish]


def _side_by_side(grid: str | None, cfg: RunConfig) -> bool:
    """Serial CPU runs on a machine with >= 2 cores train both models at once, one thread each.

    Two single-threaded processes use two cores fully, while one process with two threads loses
    much of the second core to synchronisation on small models (and collapses when another job
    shares the machine), so this roughly halves the demo's wall time on a laptop.
    """
    return (not wants_grid(grid_spec(grid, cfg)) and not torch.cuda.is_available()
            and (os.cpu_count() or 1) >= 2)


def _train_job(job: tuple) -> dict[str, Any]:
    """One demo run in a worker process (module level so it pickles)."""
    cfg, out, overwrite, data, position = job
    torch.set_num_threads(1)
    return run_training(cfg, out, overwrite=overwrite, data=data, progress_position=position)


def _run_side_by_side(jobs: list[tuple]) -> list[dict[str, Any]]:
    """Run the demo's trainings concurrently in spawned processes; results in job order."""
    with ProcessPoolExecutor(max_workers=len(jobs), mp_context=get_context("spawn")) as pool:
        return list(pool.map(_train_job, jobs))


def run_demo(out: str | Path = "runs/demo", *, epochs: int | None = None, overwrite: bool = False,
             overrides: list[str] | None = None, grid: str | None = None) -> dict[str, Any]:
    """Train both runs, evaluate extraction and held-out loss, write the report; return it.

    `grid` is the --grid text (None: the config's `grid`), resolved by each run (run_training)."""
    configs = demo_configs(epochs, overrides)
    is_main = is_main_process()
    check_out_dir(out, overwrite)
    t0 = time.perf_counter()
    data = prepare_data(configs[0])  # tokenizer and rows are shared: only the loss differs
    out_dir = prepare_out_dir(out, overwrite) if is_main else Path(out)
    configs = [replace(c, wandb=replace(c.wandb, group=c.wandb.group or "demo")) for c in configs]
    jobs = [(cfg, out_dir / cfg.name, overwrite, data, i) for i, cfg in enumerate(configs)]
    if _side_by_side(grid, configs[0]):
        runs = _run_side_by_side(jobs)
    else:
        runs = [run_training(cfg, out, overwrite=ow, grid_spec=grid, data=d) for cfg, out, ow, d, _ in jobs]
    curves = {cfg.name: read_metrics(out_dir / cfg.name / "metrics.jsonl") for cfg in configs}
    elapsed = time.perf_counter() - t0
    report = {"runs": runs}
    if is_main:
        std, gf = runs
        rel = abs(gf["val_loss"] - std["val_loss"]) / std["val_loss"]
        notes = [
            f"Corpus: {configs[0].data.corpus} ({std['docs']} documents of >= {configs[0].data.min_tokens} "
            f"tokens, each cut to {configs[0].data.block_len}); held-out loss on {configs[0].data.held_out}.",
            f"Extraction: greedy {configs[0].eval.suffix}-token continuation of the first "
            f"{configs[0].eval.prefix} tokens of every training document.",
            f"Goldfish: strategy={configs[1].goldfish.strategy}, k={configs[1].goldfish.k}, "
            f"h={configs[1].goldfish.h}; validation losses differ by {rel:.1%}.",
            f"Wall time: {elapsed:.0f} s.",
        ]
        extra = {"val_loss_rel_diff": rel, "seconds": round(elapsed, 1),
                 "wandb": str(out_dir / "*" / "wandb"), "corpus": configs[0].data.corpus}
        write_report(out_dir, title="Goldfish loss vs standard loss (memorize demo)", runs=runs,
                     extra=extra, curves=curves, notes=notes)
        print()
        print(text_table(runs))
        print(f"\nreport: {out_dir / 'report.md'}  plot: {out_dir / 'report.png'}  ({elapsed:.0f} s)")
        report.update(extra)
    return report
