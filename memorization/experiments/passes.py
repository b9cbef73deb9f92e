"""One training run that scores extraction after every pass over the data (a Trainer callback).

`memorization.pipeline.run_training` (same model, trainer, goldfish, checkpoints, files and
summary) with a per-epoch extraction callback; it adds passes.jsonl, one extraction summary per
evaluated pass, and the same list as `summary["passes"]` in run.json. The last pass is the run's
own final extraction, so it is scored once.
"""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from axonn.config import to_dict
from axonn.trainer import Trainer
from memorization.config import RunConfig
from memorization.pipeline import PreparedData, effective_trainer, extraction_results, run_training

SUMMARY_KEYS = ("docs", "exact_match_rate", "rougeL", "token_accuracy", "lcp_mean")


class PassExtraction:
    """Trainer callback: greedy extraction of every training document after the chosen passes."""

    def __init__(self, cfg: RunConfig, data: PreparedData, passes: set[int] | None, final: int):
        self.cfg, self.data, self.passes, self.final = cfg, data, passes, final
        self.records: list[dict[str, Any]] = []

    def on_epoch_end(self, trainer: Trainer, epoch: int) -> None:
        """Score extraction now (a collective under a grid: every rank gathers the weights)."""
        if epoch == self.final or (self.passes is not None and epoch not in self.passes):
            return  # the final pass is scored by run_training itself
        model = serial_model(trainer)
        if model is None:
            return
        from evals import summarize

        results = extraction_results(model, self.cfg, self.data)
        stats = summarize(results)
        record = {"pass": epoch, "step": trainer.state.step, **{k: stats[k] for k in SUMMARY_KEYS}}
        self.records.append(record)
        from memorization.tracking import WandbSink

        wb = next((s for s in trainer.sinks if isinstance(s, WandbSink)), None)
        if wb is not None:
            wb.log({"step": trainer.state.step, "pass": epoch,
                    "pass_exact_match": record["exact_match_rate"], "pass_rougeL": record["rougeL"]})


def serial_model(trainer: Trainer) -> torch.nn.Module | None:
    """The model as one serial module on the main rank (None elsewhere)."""
    import axonn

    if not axonn.is_parallel(trainer.model):  # serial, or replicated (e.g. LoRA at 1,1,1,D)
        return trainer.model if trainer.is_main else None

    state = axonn.full_state_dict(trainer.model)  # collective: every rank takes part
    return axonn.serial_copy(trainer.model, state) if trainer.is_main else None


def train_with_passes(cfg: RunConfig, out_dir: Path, data: PreparedData, *, grid_spec: str | None = None,
                      eval_passes: set[int] | None = None) -> dict[str, Any]:
    """Train cfg for cfg.trainer.epochs passes, scoring extraction after each pass in eval_passes (None: all).

    `grid_spec` is run_training's: the --grid text, or None for cfg.grid.
    """
    from memorization.parallel import is_main_process

    cfg = replace(cfg, eval=replace(cfg.eval, extraction=True))  # the last pass is the final extraction
    # the epochs run_training will train (a supervised-token budget lengthens goldfish runs)
    probe = PassExtraction(cfg, data, eval_passes, final=effective_trainer(cfg).epochs)
    summary = run_training(cfg, out_dir, overwrite=True, grid_spec=grid_spec, data=data,
                           progress=cfg.trainer.progress, callbacks=[probe])
    if not is_main_process():
        return summary
    out_dir = Path(out_dir)
    final = {"pass": summary["epochs"], "step": summary["steps"], **{k: summary.get(k) for k in SUMMARY_KEYS}}
    summary["passes"] = probe.records + [final]
    with open(out_dir / "passes.jsonl", "w", encoding="utf-8") as fh:
        for rec in summary["passes"]:
            fh.write(json.dumps(rec) + "\n")
    payload = {"summary": _finite(summary), "config": to_dict(cfg)}
    (out_dir / "run.json").write_text(json.dumps(payload, indent=2))
    return summary


def _finite(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}
