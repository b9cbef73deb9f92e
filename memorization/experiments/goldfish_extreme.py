"""goldfish-extreme: N documents x E epochs, standard loss vs goldfish static vs goldfish hash.

The paper's extreme setting (Hans et al. 2024, 100 Wikipedia articles x 100 epochs) in miniature:
train one model per variant from the same seed on the same rows, then ask each to continue every
training document and score exact match / RougeL, with loss-based membership inference against
held-out documents of the same corpus and the validation loss beside them.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from memorization.experiments.paired_runs import against, paired_runs
from memorization.experiments.reporting import Outputs, Table, figure, save
from memorization.experiments.runner import Experiment, prepare_split
from memorization.experiments.scoring import SAMPLE_COLUMNS, extraction_samples, mia_metrics
from memorization.experiments.spec import ExperimentConfig, check_variants
from memorization.report import read_metrics

COLUMNS = (
    ("name", "run", "{}"), ("loss", "loss", "{}"), ("goldfish_k", "k", "{}"), ("goldfish_h", "h", "{}"),
    ("docs", "docs", "{}"), ("epochs", "epochs", "{}"), ("exact_match_rate", "exact match", "{:.1%}"),
    ("rougeL", "RougeL", "{:.3f}"), ("token_accuracy", "token acc", "{:.3f}"),
    ("mia_auc", "MIA AUC", "{:.3f}"), ("val_loss", "val loss", "{:.3f}"),
    ("train_seconds", "train s", "{:.0f}"),
)


@dataclass
class Config(ExperimentConfig):
    """Which variants to train; goldfish k and h come from base.goldfish."""

    variants: list[str] = field(default_factory=lambda: ["standard", "static", "hash"])

    def validate(self, prefix: str = "") -> None:
        """Variant names must be standard or goldfish strategies."""
        super().validate(prefix)
        check_variants("variants", self.variants)


def variant_config(cfg: Config, variant: str):
    """The RunConfig of one variant: base settings, goldfish on with that strategy (or off)."""
    b = cfg.base
    gold = replace(b.goldfish, enabled=variant != "standard",
                   strategy=b.goldfish.strategy if variant == "standard" else variant)
    name = "standard" if variant == "standard" else f"goldfish-{variant}"
    return replace(b, name=name, goldfish=gold)


def run_configs(cfg: Config) -> list:
    """Every sub-run's RunConfig, in training order (memorization.train.run_plan checks them all first)."""
    return [variant_config(cfg, v) for v in cfg.variants]


def run(cfg: Config, exp: Experiment) -> Outputs | None:
    """Train every variant (reusing finished ones) and report extraction, MIA and validation loss."""
    split = prepare_split(cfg.base)
    data = split.prepared
    exp.check(run_configs(cfg), data)
    runs, samples, curves = [], [], {}

    for variant in cfg.variants:
        rc = variant_config(cfg, variant)

        def evaluate(model, run_dir) -> dict[str, Any]:
            return mia_metrics(model, data.member_docs, split.nonmembers, data.tokenizer)

        summary = exp.run(rc, data, evaluate=evaluate, per_run_wandb=cfg.per_run_wandb)
        if not exp.is_main:
            continue
        runs.append(summary)
        samples += extraction_samples(rc.name, exp.run_dir(rc.name), data.tokenizer, cfg.samples)
        curves[rc.name] = read_metrics(exp.run_dir(rc.name) / "metrics.jsonl")
    if not exp.is_main:
        return None

    b = cfg.base
    plots = [_plot(runs, curves, exp.out / "goldfish-extreme.png")]
    notes = [
        f"Corpus: {b.data.corpus}, {runs[0].get('docs')} training documents cut to {b.data.block_len} "
        f"tokens; model {b.model.name} {b.model.overrides or ''} ({runs[0].get('params')} parameters), "
        f"{b.trainer.epochs} epochs, lr {b.trainer.lr}.",
        f"Extraction: greedy {b.eval.suffix}-token continuation of the first {b.eval.prefix} tokens of "
        "every training document.",
        f"Goldfish: k={b.goldfish.k}, h={b.goldfish.h} (static drops every k-th position; hash drops by a "
        "hash of the h preceding token ids).",
        f"MIA (loss score): {len(data.train_docs)} training documents vs {len(split.nonmembers)} held-out "
        f"documents from {split.held_out_source}; validation loss on the same held-out documents.",
    ]
    paired, tests, paired_notes = paired_runs(exp, against([r["name"] for r in runs], "standard"), b)
    return Outputs(title="Goldfish extreme: standard vs goldfish static vs goldfish hash", kind=cfg.kind,
                   runs=runs, tables=[Table("Summary", runs, COLUMNS), *paired], notes=notes + paired_notes,
                   plots=plots, samples=samples, sample_columns=SAMPLE_COLUMNS,
                   extra={"held_out": split.held_out_source, "paired_tests": tests})


def _plot(runs: list[dict[str, Any]], curves: dict[str, list[dict]], path):
    """Training loss per step (supervised and dropped tokens) and extraction/MIA bars per run."""
    fig, (ax1, ax2) = figure(2)
    for name, hist in curves.items():
        if hist:
            line, = ax1.plot([m["step"] for m in hist], [m["loss"] for m in hist], label=f"{name}")
            dropped = [(m["step"], m["dropped_loss"]) for m in hist if "dropped_loss" in m]
            if dropped:
                ax1.plot(*zip(*dropped), linestyle="--", color=line.get_color(), alpha=0.7,
                         label=f"{name} (dropped tokens)")
    ax1.set(xlabel="optimizer step", ylabel="training loss (nats/token)", yscale="log", title="Training loss")
    ax1.legend(fontsize=7)
    metrics = [("exact_match_rate", "exact match"), ("rougeL", "RougeL"), ("mia_auc", "MIA AUC")]
    width = 0.8 / len(metrics)
    for i, (key, label) in enumerate(metrics):
        xs = [j + (i - 1) * width for j in range(len(runs))]
        ax2.bar(xs, [r.get(key) or 0.0 for r in runs], width=width, label=label)
    ax2.set_xticks(range(len(runs)), [r["name"] for r in runs], fontsize=8)
    ax2.set(ylim=(0, 1.05), title="Memorization of the training documents")
    ax2.legend(fontsize=7)
    return save(fig, path)
