"""Memorization experiments: one YAML config and one command each (`memorize run CONFIG`).

Kinds (configs/experiments/<kind>.yaml):
  goldfish-extreme           N documents x E epochs: standard vs goldfish static vs goldfish hash
  goldfish-sweep             k x h grid (+ static, token budget on/off): memorization vs validation loss
  catastrophic-memorization  model sizes x passes: exact match after every pass, standard vs goldfish
  canary-exposure            canaries and duplicated documents: exposure/extraction vs copy count
  pretrained-memorization    a pretrained model fine-tuned pass by pass: extraction, MIA and utility
                             from pass 0, standard vs goldfish vs the random-init control
  mitigations                goldfish vs DP-SGD vs LoRA vs dedup on one fine-tune with canaries and
                             duplicates: extraction, exposure, MIA, utility and cost per arm
  goldfish-near-duplicates   copies x edit rate x goldfish strategy: extraction, mask coverage and
                             held-out loss when the duplicates are near-copies
  forgetting                 mitigations' fine-tune, then plain training on fresh data: the same
                             questions of the fine-tune's data after every further pass
  unlearning                 mitigations' fine-tune, then retrain / gradient ascent / gradient
                             difference / NPO on a forget set: forget vs retain after every pass, and
                             the relearning attack
"""
from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist
from transformers.utils import logging as hf_logging

import axonn
from memorization.experiments.replicates import check_out, run_replicates, seeded
from memorization.experiments.reporting import write_outputs
from memorization.experiments.runner import Experiment
from memorization.experiments.spec import build_experiment, load_experiment_dict
from memorization.train.parallel import grid_spec, wants_grid
from memorization.train.run_plan import check_runs
from memorize_core import fail

KINDS = {
    "goldfish-extreme": "memorization.experiments.goldfish_extreme",
    "goldfish-sweep": "memorization.experiments.goldfish_sweep",
    "catastrophic-memorization": "memorization.experiments.catastrophic",
    "canary-exposure": "memorization.experiments.canary_exposure",
    "pretrained-memorization": "memorization.experiments.pretrained",
    "mitigations": "memorization.experiments.mitigations",
    "goldfish-near-duplicates": "memorization.experiments.near_duplicates",
    "forgetting": "memorization.experiments.forgetting",
    "unlearning": "memorization.experiments.unlearning",
}


def load_experiment(config_path: str | Path, overrides: Sequence[str] | None = None) -> tuple[Any, Any]:
    """(experiment module, validated config) for an experiment YAML with overrides applied."""
    data = load_experiment_dict(config_path, overrides)
    kind = data.get("kind")
    if kind not in KINDS:
        raise fail("kind", kind, f"choose one of {', '.join(KINDS)}")
    module = importlib.import_module(KINDS[kind])
    return module, build_experiment(module.Config, data)


def run_experiment(config_path: str | Path, *, out: str | Path | None = None,
                   overrides: Sequence[str] | None = None, overwrite: bool = False,
                   grid: str | None = None) -> dict[str, Any]:
    """Run (or resume) an experiment; write OUT/report.{json,md}, plots and a W&B run; return the report.

    With `replicate.seeds`, once per seed into OUT/seed-S, then OUT/report.* averages them (replicates).

    `grid` is the --grid text (None: the base config's `grid`); each sub-run resolves it into the
    ProcessGrid that fits its own model (memorization.train.parallel.resolve_grid)."""
    module, cfg = load_experiment(config_path, overrides)
    # every sub-run, before anything is written (a seed changes no plan: the first replicate stands for all)
    first = seeded(cfg, cfg.replicate.seeds[0]) if cfg.replicate.seeds else cfg
    check_runs(module.run_configs(first), spec=grid)
    _init_distributed(grid_spec(grid, cfg.base), cfg.base.trainer.collective_timeout_s)
    out = Path(out or Path("runs") / cfg.name)
    if cfg.replicate.seeds:
        with _quiet_transformers():
            return run_replicates(module, cfg, out, grid=grid, overwrite=overwrite)
    check_out(out, replicates=False)
    exp = Experiment(out, grid_spec=grid, overwrite=overwrite).open()
    with _quiet_transformers():
        outputs = module.run(cfg, exp)
    if not exp.is_main:
        return {}
    return write_outputs(exp.out, outputs, cfg, exp.seconds)


def _init_distributed(spec: str, timeout_s: float) -> None:
    """Under torchrun, join the process group before the first sub-run.

    Ranks then agree (by broadcast from rank 0) on which sub-runs are finished, even when every
    one of them is reused; each sub-run still builds the grid that fits its own model.
    """
    if wants_grid(spec):
        if not dist.is_initialized():
            axonn.init(1, 1, 1, timeout_s=timeout_s)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Hide transformers' per-save/per-load progress bars (dozens per sweep), restoring them afterwards."""
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


__all__ = ["KINDS", "load_experiment", "run_experiment"]
