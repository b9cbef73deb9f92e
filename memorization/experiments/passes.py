"""One training run that scores extraction after every pass over the data (a Trainer callback).

This is `memorization.pipeline.run_training` plus a per-epoch callback: same model, trainer,
goldfish transform, files (metrics.jsonl, model/, extraction.jsonl, run.json with the same summary
keys) and one more, passes.jsonl, with the extraction summary after each evaluated pass.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from axonn.config import to_dict
from axonn.trainer import JsonlSink, Trainer
from memorization.config import RunConfig
from memorization.goldfish import GoldfishTransform
from memorization.models import build_model, count_params
from memorization.pipeline import PreparedData, effective_trainer


class PassExtraction:
    """Trainer callback: greedy extraction of every training document after the chosen passes."""

    def __init__(self, cfg: RunConfig, data: PreparedData, passes: set[int] | None, wandb: Any = None):
        self.cfg, self.data, self.passes, self.wandb = cfg, data, passes, wandb
        self.records: list[dict[str, Any]] = []
        self.last: list[Any] = []

    def on_epoch_end(self, trainer: Trainer, epoch: int) -> None:
        """Score extraction now (a collective under a grid: every rank gathers the weights)."""
        if self.passes is not None and epoch not in self.passes:
            return
        model = _serial_model(trainer)
        if model is None:
            return
        from evals import extract, summarize

        e = self.cfg.eval
        results = extract(model, self.data.train_docs, prefix_len=e.prefix, suffix_len=e.suffix,
                          tokenizer=self.data.tokenizer, batch_size=e.batch_size, num_beams=e.num_beams,
                          doc_ids=self.data.train_doc_ids)
        record = {"pass": epoch, "step": trainer.state.step, **summarize(results)}
        self.records.append(record)
        self.last = results
        if self.wandb is not None:
            self.wandb.log({"step": trainer.state.step, "pass": epoch,
                            "pass_exact_match": record["exact_match_rate"], "pass_rougeL": record["rougeL"]})


def _serial_model(trainer: Trainer) -> torch.nn.Module | None:
    """The model as one serial module on the main rank (None elsewhere)."""
    if trainer.grid is None:
        return trainer.model
    import axonn

    state = axonn.full_state_dict(trainer.model)  # collective: every rank takes part
    return axonn.serial_copy(trainer.model, state) if trainer.is_main else None


def train_with_passes(cfg: RunConfig, out_dir: Path, data: PreparedData, *, grid: Any = None,
                      eval_passes: set[int] | None = None) -> dict[str, Any]:
    """Train cfg for cfg.trainer.epochs passes, scoring extraction after each pass in eval_passes (None: all).

    `grid` is what run_training takes: a ProcessGrid, a spec ("X,Y,Z,D" or "auto"), or None for cfg.grid.
    """
    from memorization.parallel import is_main_process, make_grid, wants_grid
    from memorization.tracking import WandbSink

    is_main = is_main_process()
    model = build_model(cfg.model.name, vocab_size=len(data.tokenizer), seed=cfg.seed,
                        overrides=cfg.model.overrides)
    spec = cfg.grid if grid is None else grid
    if isinstance(spec, str):
        grid = make_grid(spec, model.config, seq=cfg.data.block_len, global_batch=cfg.trainer.batch_size,
                         mode=cfg.parallel_mode, timeout_s=cfg.trainer.collective_timeout_s) \
            if wants_grid(spec) else None
    if grid is not None:
        import axonn

        model = axonn.parallelize(model, grid, mode=cfg.parallel_mode)
    tcfg = replace(effective_trainer(cfg))  # a copy: never mutate the caller's config
    transform = GoldfishTransform(cfg.goldfish, seed=cfg.seed) if cfg.goldfish.enabled else None
    sinks: list[Any] = [JsonlSink(out_dir / "metrics.jsonl")] if is_main else []
    wb = WandbSink(cfg.wandb, name=cfg.name, out_dir=out_dir, config=to_dict(cfg)) if is_main else None
    if wb is not None:
        sinks.append(wb)
    probe = PassExtraction(cfg, data, None if eval_passes is None else eval_passes | {tcfg.epochs}, wb)
    trainer = Trainer(model, tcfg, data.train, eval_data=data.held_out, label_transform=transform,
                      grid=grid, sinks=sinks, callbacks=[probe])
    t0 = time.perf_counter()
    history = trainer.fit()
    train_s = time.perf_counter() - t0
    val_loss = trainer.evaluate() if data.held_out is not None else float("nan")
    trainer.export(out_dir / "model", data.tokenizer)
    summary: dict[str, Any] = {}
    if is_main:
        final = probe.records[-1] if probe.records else {}
        g = cfg.goldfish
        summary = {
            "name": cfg.name, "loss": "goldfish" if g.enabled else "standard",
            "goldfish_strategy": g.strategy if g.enabled else None, "goldfish_k": g.k if g.enabled else None,
            "goldfish_h": g.h if g.enabled else None, "model": cfg.model.name,
            "params": count_params(trainer.model) if grid is None else None,
            "steps": trainer.state.step, "epochs": tcfg.epochs, "tokens": trainer.state.tokens,
            "final_train_loss": history[-1]["loss"] if history else None, "val_loss": val_loss,
            "train_seconds": round(train_s, 2),
            **{k: final.get(k) for k in ("docs", "exact_match_rate", "rougeL", "token_accuracy", "lcp_mean")},
            "passes": probe.records,
        }
        with open(out_dir / "extraction.jsonl", "w", encoding="utf-8") as fh:
            for r in probe.last:
                fh.write(json.dumps(r.to_dict()) + "\n")
        with open(out_dir / "passes.jsonl", "w", encoding="utf-8") as fh:
            for rec in probe.records:
                fh.write(json.dumps(rec) + "\n")
        payload = {"summary": _finite(summary), "config": to_dict(cfg)}
        (out_dir / "run.json").write_text(json.dumps(payload, indent=2))
        if wb is not None:
            wb.summary({k: v for k, v in summary.items() if k != "passes"})
    for sink in sinks:
        sink.close()
    return summary


def _finite(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}
