"""goldfish-sweep: how much memorization each (k, h) removes, and what it costs in validation loss.

One run per goldfish setting -- hash strategy at every k in `ks` and h in `hs`, static at every k in
`static_ks` -- each with the supervised-token budget off (same epochs as standard loss) and/or on
(k/(k-1) times the epochs, so the supervised tokens match), plus the standard-loss baseline. Every
run reports exact match, RougeL, loss-based MIA AUC and validation loss; the trade-off plot puts
memorization against validation loss.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from memorization.config import RunConfig
from memorization.experiments.beyond_greedy import NP_NOTE, beyond_greedy
from memorization.experiments.paired_runs import against, paired_runs
from memorization.experiments.reporting import Outputs, Table, figure, save
from memorization.experiments.runner import Experiment, prepare_split
from memorization.experiments.scoring import SAMPLE_COLUMNS, extraction_samples, mia_metrics
from memorization.experiments.spec import ExperimentConfig, int_list
from memorize_core import fail

COLUMNS = (
    ("name", "run", "{}"), ("goldfish_strategy", "strategy", "{}"), ("goldfish_k", "k", "{}"),
    ("goldfish_h", "h", "{}"), ("token_budget", "budget", "{}"), ("epochs", "epochs", "{}"),
    ("exact_match_rate", "exact match", "{:.1%}"), ("rougeL", "RougeL", "{:.3f}"),
    ("mia_auc", "MIA AUC", "{:.3f}"), ("val_loss", "val loss", "{:.3f}"),
)


@dataclass
class Config(ExperimentConfig):
    """The grid. The paper's full grid is ks=[2,3,4,8,16,32] hs=[1,4,13,50]."""

    ks: list[int] = field(default_factory=lambda: [2, 4, 8, 16, 32])
    hs: list[int] = field(default_factory=lambda: [13])
    static_ks: list[int] = field(default_factory=lambda: [4])  # [] = no static runs
    token_budget: list[bool] = field(default_factory=lambda: [False, True])
    standard: bool = True  # include the standard-loss baseline

    def validate(self, prefix: str = "") -> None:
        """k >= 2, h >= 1, budget a non-empty list of distinct booleans."""
        super().validate(prefix)
        int_list("ks", self.ks, minimum=2)
        int_list("hs", self.hs, minimum=1)
        if self.static_ks:
            int_list("static_ks", self.static_ks, minimum=2)
        if not self.token_budget or len(set(self.token_budget)) != len(self.token_budget):
            raise fail("token_budget", self.token_budget, "use [false], [true] or [false, true]")


def sweep_configs(cfg: Config) -> list[RunConfig]:
    """Every run of the sweep, standard first, in a fixed order (the order of the table)."""
    b = cfg.base
    out = [replace(b, name="standard", goldfish=replace(b.goldfish, enabled=False))] if cfg.standard else []
    for budget in cfg.token_budget:
        tag = "-budget" if budget else ""
        for k in cfg.ks:
            for h in cfg.hs:
                g = replace(b.goldfish, enabled=True, strategy="hash", k=k, h=h, token_budget=budget)
                out.append(replace(b, name=f"hash-k{k}-h{h}{tag}", goldfish=g))
        for k in cfg.static_ks:
            g = replace(b.goldfish, enabled=True, strategy="static", k=k, token_budget=budget)
            out.append(replace(b, name=f"static-k{k}{tag}", goldfish=g))
    return out


def run_configs(cfg: Config) -> list[RunConfig]:
    """Every sub-run's RunConfig, in training order (memorization.train.run_plan checks them all first)."""
    return sweep_configs(cfg)


def run(cfg: Config, exp: Experiment) -> Outputs | None:
    """Train (or reuse) every run of the grid and report the memorization / validation-loss trade-off."""
    split = prepare_split(cfg.base)
    data = split.prepared
    exp.check(run_configs(cfg), data)
    runs, samples = [], []

    def evaluate(model, run_dir) -> dict[str, Any]:
        return mia_metrics(model, data.member_docs, split.nonmembers, data.tokenizer)

    for rc in sweep_configs(cfg):
        summary = exp.run(rc, data, evaluate=evaluate, per_run_wandb=cfg.per_run_wandb)
        if not exp.is_main:
            continue
        summary["token_budget"] = rc.goldfish.token_budget if rc.goldfish.enabled else None
        if rc.goldfish.enabled and rc.goldfish.strategy == "static":
            summary["goldfish_h"] = None  # static ignores h
        runs.append(summary)
        samples += extraction_samples(rc.name, exp.run_dir(rc.name), data.tokenizer, min(cfg.samples, 4))
    if not exp.is_main:
        return None

    b = cfg.base
    plots = [_plot_tradeoff(runs, exp.out / "goldfish-sweep-tradeoff.png"),
             _plot_k(runs, exp.out / "goldfish-sweep-k.png")]
    notes = [
        f"Corpus: {b.data.corpus}, {runs[0].get('docs')} training documents cut to {b.data.block_len} "
        f"tokens; model {b.model.name} {b.model.overrides or ''}; {b.trainer.epochs} epochs (budget runs: "
        f"ceil(epochs*k/(k-1))), lr {b.trainer.lr}.",
        f"Grid: hash k in {cfg.ks} x h in {cfg.hs}; static k in {cfg.static_ks}; token budget "
        f"{cfg.token_budget}.",
        f"Extraction: greedy {b.eval.suffix} tokens from the first {b.eval.prefix} of every training "
        "document.",
        f"MIA AUC: loss score, {len(data.train_docs)} training vs {len(split.nonmembers)} held-out documents "
        f"from {split.held_out_source}; validation loss on the same held-out documents.",
    ]
    extra_tables, np_plots = beyond_greedy(runs, exp.out, "goldfish-sweep")
    if extra_tables:
        notes.append(NP_NOTE.format(passes=b.trainer.epochs))
    paired, tests, paired_notes = paired_runs(exp, against([r["name"] for r in runs], "standard"), b)
    return Outputs(title="Goldfish sweep: memorization vs validation loss over k and h", kind=cfg.kind,
                   runs=runs, tables=[Table("Summary", runs, COLUMNS), *extra_tables, *paired],
                   notes=notes + paired_notes, plots=plots + np_plots,
                   samples=samples, sample_columns=SAMPLE_COLUMNS,
                   extra={"held_out": split.held_out_source, "paired_tests": tests})


MARKERS = {("hash", False): "o", ("hash", True): "s", ("static", False): "^", ("static", True): "D"}


def _plot_tradeoff(runs: list[dict[str, Any]], path):
    """Exact match, RougeL and MIA AUC against validation loss, one point per run (colour = k)."""
    import matplotlib  # deferred: matplotlib +0.7 s
    from matplotlib.lines import Line2D  # deferred: matplotlib +0.7 s

    cmap = matplotlib.colormaps["viridis"]
    ks = sorted({r["goldfish_k"] for r in runs if r.get("goldfish_k")})
    norm = matplotlib.colors.LogNorm(vmin=min(ks or [2]), vmax=max(ks or [2]) * 1.0001)
    fig, axes = figure(3, width=4.6)
    panels = (("exact_match_rate", "exact match", (-0.03, 1.03)), ("rougeL", "RougeL", (-0.03, 1.03)),
              ("mia_auc", "MIA AUC (loss score)", (0.4, 1.03)))
    for ax, (key, label, ylim) in zip(axes, panels):
        for r in runs:
            if r.get(key) is None or r.get("val_loss") is None:
                continue
            if r["loss"] == "standard":
                ax.scatter(r["val_loss"], r[key], marker="*", s=140, color="black", zorder=3)
                continue
            marker = MARKERS[(r["goldfish_strategy"], bool(r.get("token_budget")))]
            ax.scatter(r["val_loss"], r[key], marker=marker, s=45, color=cmap(norm(r["goldfish_k"])),
                       edgecolors="black", linewidths=0.4)
        if key == "mia_auc":
            ax.axhline(0.5, color="gray", linestyle=":", linewidth=1)
        ax.set(xlabel="validation loss (nats/token)", ylabel=label, ylim=ylim,
               title=f"{label} vs validation loss")
    handles = [Line2D([], [], marker=m, linestyle="", color="gray", label=name) for m, name in
               (("*", "standard"), ("o", "hash"), ("s", "hash + token budget"), ("^", "static"),
                ("D", "static + token budget"))]
    axes[0].legend(handles=handles, fontsize=7, loc="center right")
    if ks:
        bar = fig.colorbar(matplotlib.cm.ScalarMappable(norm=norm, cmap=cmap), ax=axes[-1])
        bar.set_label("k (drop 1 token in k)")
        bar.ax.minorticks_off()
        bar.set_ticks(ks, labels=[str(k) for k in ks])
    return save(fig, path)


def _plot_k(runs: list[dict[str, Any]], path):
    """Exact match and RougeL against k for each (h, budget) line; standard as a dashed line."""
    fig, axes = figure(2)
    std = next((r for r in runs if r["loss"] == "standard"), None)
    lines: dict[tuple, list[dict]] = {}
    for r in runs:
        if r["loss"] != "standard":
            key = (r["goldfish_strategy"], r.get("goldfish_h"), bool(r.get("token_budget")))
            lines.setdefault(key, []).append(r)
    for ax, key, label in zip(axes, ("exact_match_rate", "rougeL"), ("exact match", "RougeL")):
        for (strategy, h, budget), rs in sorted(lines.items(),
                                                key=lambda kv: (kv[0][0], kv[0][1] or 0, kv[0][2])):
            rs = sorted(rs, key=lambda r: r["goldfish_k"])
            name = f"{strategy}" + (f" h={h}" if h is not None else "") + (" +budget" if budget else "")
            ax.plot([r["goldfish_k"] for r in rs], [r[key] for r in rs], marker="o",
                    linestyle="--" if budget else "-", label=name)
        if std is not None:
            ax.axhline(std[key], color="black", linestyle=":", label="standard loss")
        ax.set_xscale("log", base=2)
        ax.set(xlabel="k (goldfish drops 1 token in k)", ylabel=label, ylim=(-0.02, 1.02),
               title=f"{label} of training documents vs k")
        ax.legend(fontsize=7)
    return save(fig, path)
