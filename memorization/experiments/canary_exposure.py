"""canary-exposure: exposure and extraction against how many times a secret or document was seen.

Canaries (a template with a random secret from a declared space) and duplicated corpus documents
are injected into the training corpus with data_pipelines.inject, each item `count` times for every
count in `counts`; the manifest (OUT/manifest.json) records every copy's token positions. After
training with standard loss and with goldfish, each canary gets its exposure and extraction over
the secret space and each duplicated document its greedy-extraction exact match.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from memorization.eval.exposure import CANARY_SCORES
from memorization.experiments.injection import (
    MASKED_COLUMNS,
    SPLIT_NOTE,
    InjectionConfig,
    build_corpus,
    injected_questions,
    item_words,
    masked_split,
    save_manifest,
    score_injected,
    secret_mask,
)
from memorization.experiments.reporting import Outputs, Table, figure, save
from memorization.experiments.runner import Experiment
from memorization.experiments.scoring import SAMPLE_COLUMNS, extraction_samples
from memorization.experiments.spec import check_losses
from memorization.paired import paired_table

COLUMNS = (
    ("loss", "loss", "{}"), ("count", "copies", "{}"), ("canaries", "canaries", "{}"),
    ("exposure_mean", "exposure", "{:.2f}"), ("extracted", "secrets extracted", "{:.0%}"),
    ("duplicates", "docs", "{}"),
    ("dup_exact_match", "doc exact match", "{:.0%}"), ("dup_rougeL", "doc RougeL", "{:.3f}"),
)


@dataclass
class Config(InjectionConfig):
    """Copy counts shared by canaries and duplicated documents, and the losses compared."""

    losses: list[str] = field(default_factory=lambda: ["standard", "goldfish"])

    def validate(self, prefix: str = "") -> None:
        """The injection checks and the loss names."""
        super().validate(prefix)
        check_losses("losses", self.losses)


def loss_config(cfg: Config, loss: str):
    """The RunConfig of one loss: the base on the injected corpus (every canary kept: min_tokens 1)."""
    b = cfg.base
    gold = replace(b.goldfish, enabled=loss == "goldfish", token_budget=False)
    return replace(b, name=loss, goldfish=gold, data=replace(b.data, min_tokens=1))


def run_data(cfg: Config) -> list:
    """Each sub-run's training rows as `run` prepares them (the injected corpus), writing nothing:
    what a dry run counts for DP-SGD's row checks."""
    data = build_corpus(cfg)[0]
    return [data for _ in cfg.losses]


def run_configs(cfg: Config) -> list:
    """Every sub-run's RunConfig, in training order (memorization.train.run_plan checks them all first)."""
    return [loss_config(cfg, loss) for loss in cfg.losses]


def run(cfg: Config, exp: Experiment) -> Outputs | None:
    """Train standard and goldfish on the injected corpus; score canaries and duplicates by copy count."""
    data, manifest, dup_tokens, _ = build_corpus(cfg, exp)
    exp.check(run_configs(cfg), data)
    save_manifest(manifest, exp)
    space = cfg.canary_spec().space
    b = cfg.base
    c = cfg.canaries
    key = cfg.injection_key()

    def evaluate(model, run_dir) -> dict[str, Any]:
        return {"canary_eval": score_injected(model, cfg, data.tokenizer, manifest, dup_tokens)}

    runs, rows, samples = [], [], []
    for loss in cfg.losses:
        rc = loss_config(cfg, loss)
        summary = exp.run(rc, data, evaluate=evaluate, extra_key=key,
                          eval_key={"candidates": c.candidates, "scores": CANARY_SCORES},
                          per_run_wandb=cfg.per_run_wandb)
        if not exp.is_main:
            continue
        runs.append(summary)
        rows += _rows_by_count(loss, cfg.counts, summary["canary_eval"])
        ev = summary["canary_eval"]
        samples += [[loss, c["id"], ev["prompt"], c["secret"], ev["greedy_continuation"], c["extracted"]]
                    for c in ev["canaries"][: cfg.samples]]
        samples += extraction_samples(loss, exp.run_dir(loss), data.tokenizer, min(cfg.samples, 4))
    if not exp.is_main:
        return None

    ev0 = runs[0]["canary_eval"]
    how = "exact over all of R" if ev0["exact"] else f"estimated from {ev0['scored']} sampled secrets"
    chat = data.is_chat
    rows_are = "; chat: one conversation per row, only the answers trained" if chat else ""
    notes = [
        f"Corpus: {b.data.corpus} ({len(data.train_docs)} training rows incl. injected copies, cut to "
        f"{b.data.block_len} tokens{rows_are}), {b.trainer.epochs} epochs, model {b.model.name} "
        f"{b.model.overrides or ''}.",
        f"Canaries: {cfg.canaries.per_count} per count, template {cfg.canaries.template!r}, space "
        f"{space.kind} x {space.length} (|R| = {space.size}, max exposure {ev0['max_exposure']:.2f} bits); "
        f"exposure {how}." + (f" Each canary is trained as the answer to the user turn {c.prompt!r} and "
                              "scored in that conversation (every secret of R as that answer)."
                              if chat else ""),
        "Secret extracted = the canary beats every secret that was never inserted (top-m guesses of an "
        "attacker who scores R); the greedy continuation of the prompt is in the W&B samples table.",
        (f"Duplicated conversations: {cfg.duplicates.per_count} per count; exact match = the greedy answer "
         f"(its first {b.eval.suffix} tokens) from the conversation's prompt." if chat else
         f"Duplicated documents: {cfg.duplicates.per_count} per count; exact match = greedy {b.eval.suffix} "
         f"tokens from the first {b.eval.prefix}.") + " Manifest with every copy's token positions (in chat "
        "rows: the whole conversation's): manifest.json.",
        f"Goldfish: {b.goldfish.strategy}, k={b.goldfish.k}, h={b.goldfish.h}"
        + (" (in chat rows over each answer's own tokens: the first h of an answer are never dropped)."
           if chat and b.goldfish.strategy == "hash" else "."),
    ]
    split = "goldfish" in cfg.losses and secret_mask(b) is not None
    columns = (*COLUMNS[:4], *MASKED_COLUMNS, *COLUMNS[4:]) if split else COLUMNS
    if split:
        notes.append(SPLIT_NOTE)
    plots = [_plot(rows, runs, exp.out / "canary-exposure.png", split)]
    answers = {r["name"]: {"injected": r["canary_eval"]} for r in runs}
    ref = "standard" if "standard" in answers else runs[0]["name"]
    paired, tests, paired_notes = paired_table(answers, [(n, ref) for n in answers if n != ref],
                                               injected_questions(item_words(cfg)[0]), label="loss",
                                               seed=b.seed,
                                               title=f"Paired tests: each loss − '{ref}', canary by canary")
    notes += paired_notes
    tables = [Table("By copy count", rows, columns, ("loss", "count"))]
    tables += [Table(**paired, per_seed=True)] if paired else []
    return Outputs(title="Canary exposure and extraction vs number of copies", kind=cfg.kind, runs=runs,
                   tables=tables, notes=notes, plots=plots, samples=samples,
                   sample_columns=SAMPLE_COLUMNS, extra={"max_exposure": ev0["max_exposure"],
                                                         "manifest": "manifest.json", "paired_tests": tests})


def _rows_by_count(loss: str, counts: list[int], ev: dict[str, Any]) -> list[dict[str, Any]]:
    """One table row per copy count: canary exposure/extraction and duplicate exact match."""
    rows = []
    for n in counts:
        cs = [c for c in ev["canaries"] if c["count"] == n]
        ds = [d for d in ev["duplicates"] if d["count"] == n]
        rows.append({"loss": loss, "count": n, "canaries": len(cs),
                     "exposure_mean": _mean([c["exposure"] for c in cs]), **masked_split(cs),
                     "extracted": _mean([c["extracted"] for c in cs]),
                     "duplicates": len(ds),
                     "dup_exact_match": _mean([d["exact_match"] for d in ds]),
                     "dup_rougeL": _mean([d["rougeL"] for d in ds])})
    return rows


def _mean(values: list) -> float | None:
    return float(np.mean(values)) if values else None


COLORS = {"standard": "tab:blue", "goldfish": "tab:orange"}


def _plot(rows: list[dict[str, Any]], runs: list[dict[str, Any]], path, split: bool):
    """Exposure of every canary vs copies (where `split`, o: no secret token masked, x: some masked), and
    extraction."""
    fig, (ax1, ax2) = figure(2)
    for j, r in enumerate(runs):
        ev, loss = r["canary_eval"], r["loss"]
        color, shift = COLORS.get(loss), 1.0 + 0.08 * (j - (len(runs) - 1) / 2)  # side by side
        for masked, marker in ((False, "o"), (True, "x")) if split else ((None, "o"),):
            pts = [(c["count"] * shift, c["exposure"]) for c in ev["canaries"]
                   if masked is None or bool(c["secret_tokens_dropped"]) == masked]
            if pts:
                ax1.scatter(*zip(*pts), marker=marker, color=color, alpha=0.6, s=22)
        mine = [x for x in rows if x["loss"] == loss]
        ax1.plot([x["count"] for x in mine], [x["exposure_mean"] for x in mine], color=color,
                 label=f"{loss}: mean")
        masked_pts = [(x["count"], x["exposure_masked"]) for x in mine
                      if split and x["exposure_masked"] is not None]
        if masked_pts:
            ax1.plot(*zip(*masked_pts), color=color, linestyle="--", label=f"{loss}: mean of masked (x)")
        kept_pts = [(x["count"], x["kept_exposure_masked"]) for x in mine
                    if split and x["kept_exposure_masked"] is not None]
        if kept_pts:
            ax1.plot(*zip(*kept_pts), color=color, linestyle=":", marker=".",
                     label=f"{loss}: masked, exposure of kept tokens")
        ax2.plot([x["count"] for x in mine], [x["extracted"] for x in mine], marker="o", color=color,
                 label=f"{loss}: secrets extracted")
        if any(x["dup_exact_match"] is not None for x in mine):
            ax2.plot([x["count"] for x in mine], [x["dup_exact_match"] for x in mine], marker="s",
                     linestyle="--", color=color, label=f"{loss}: duplicated docs exact match")
    ax1.axhline(runs[0]["canary_eval"]["max_exposure"], color="gray", linestyle=":", label="max (log2 |R|)")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("copies in the training data")
    ax1.set(ylabel="exposure (bits)",
            title="Canary exposure" + (" (x: goldfish mask drops a secret token)" if split else ""))
    ax2.set(ylabel="fraction", ylim=(-0.02, 1.02), title="Extraction")
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    return save(fig, path)
