"""One training run that scores extraction after every pass over the data (a Trainer callback).

The run's stages (memorization.train.pipeline) with a per-epoch extraction callback: same model,
trainer, goldfish, checkpoints, files and summary, plus passes.jsonl (one extraction summary per
evaluated pass) and the same list as `summary["passes"]` in run.json. The last pass is always
scored, and its results are the run's final extraction, so it is scored once.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from axonn.hooks import Callback
from axonn.trainer import Trainer
from evals import summarize
from memorization.config import RunConfig
from memorization.experiments.corpus_scan import scan_training_set
from memorization.train.evaluation import extraction_results, sampled_results
from memorization.train.pipeline import EXTRACTION_KEYS, effective_trainer, finish, start_run, train
from memorization.train.prepare import PreparedData


class PassExtraction(Callback):
    """Trainer callback: greedy extraction of every training document after the chosen passes and the last.

    Each scored pass adds a record (pass, step, extraction figures) to `records` and to the run's
    metrics (Trainer.log: metrics.jsonl and W&B); `last_results` holds the latest pass's results.
    """

    def __init__(self, cfg: RunConfig, data: PreparedData, passes: set[int] | None, last: int,
                 scan_stride: int | None = None):
        self.cfg, self.data, self.passes, self.last = cfg, data, passes, last
        self.scan_stride = scan_stride  # None: no corpus scan; else experiments.corpus_scan's stride
        self.records: list[dict[str, Any]] = []
        self.last_results: list[Any] | None = None
        self.last_sampled_rows: list[dict[str, Any]] | None = None  # the latest pass's sampled.jsonl rows
        self.last_step = -1  # the step last_results belong to

    def on_epoch_end(self, trainer: Trainer, epoch: int) -> None:
        """After pass `epoch`: score it if chosen (always the last)."""
        if self.passes is None or epoch in self.passes or epoch == self.last:
            self.score(trainer, epoch)

    def score(self, trainer: Trainer, label: int) -> None:
        """Extraction of the model as it is now, on its grid, recorded as pass `label` (a collective
        under a sharded grid: call it on every rank; every rank gets the results)."""
        self.last_step = trainer.state.step
        self.last_results = extraction_results(trainer.model, self.cfg, self.data, grid=trainer.grid)
        stats = summarize(self.last_results)
        record = {"pass": label, "step": trainer.state.step, **{k: stats[k] for k in EXTRACTION_KEYS},
                  # which documents were asked and which came back: per-document paired tests by pass
                  "ids": [str(r.doc) for r in self.last_results],
                  "extracted": [str(r.doc) for r in self.last_results if r.exact_match]}
        if self.scan_stride is not None:  # every window of the training set, beside the per-document EM
            e = self.cfg.eval
            record.update(scan_training_set(trainer.model, self.data.train_docs, prefix=e.prefix,
                                            suffix=e.suffix, stride=self.scan_stride,
                                            batch_size=e.batch_size, grid=trainer.grid))
        sampled = sampled_results(trainer.model, self.cfg, self.data, grid=trainer.grid)
        if sampled is not None:  # beyond greedy: (n, p) rates per scheme, EM and (n, p) at each offset
            record["sampled"], self.last_sampled_rows = sampled
        self.records.append(record)
        trainer.log({"pass": label, "pass_exact_match": record["exact_match_rate"],
                     "pass_rougeL": record["rougeL"]})


def train_with_passes(cfg: RunConfig, out_dir: Path, data: PreparedData, *, grid_spec: str | None = None,
                      eval_passes: set[int] | None = None, scan_stride: int | None = None) -> dict[str, Any]:
    """Train cfg for cfg.trainer.epochs passes, scoring extraction after each pass in eval_passes (None: all).

    `grid_spec` is the --grid text, or None for cfg.grid.
    """
    cfg = replace(cfg, eval=replace(cfg.eval, extraction=True))  # the last pass is the final extraction
    # the epochs the run trains (a supervised-token budget lengthens goldfish runs)
    probe = PassExtraction(cfg, data, eval_passes, last=effective_trainer(cfg).epochs,
                           scan_stride=scan_stride)
    with start_run(cfg, out_dir, data, overwrite=True, grid_spec=grid_spec, progress=cfg.trainer.progress,
                   callbacks=[probe]) as run:
        train(run)
        if probe.last_step != run.trainer.state.step:  # max_steps ended the run inside a pass
            probe.score(run.trainer, run.trainer.cfg.epochs)
        last = probe.records[-1] if probe.records else {}
        extra = {"passes": probe.records, **({"sampled": last["sampled"]} if "sampled" in last else {})}
        summary = finish(run, scored=probe.last_results, extra=extra, sampled_rows=probe.last_sampled_rows)
    if run.is_main:
        with open(Path(out_dir) / "passes.jsonl", "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(rec) + "\n" for rec in summary["passes"])
    return summary
