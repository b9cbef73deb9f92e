"""catastrophic-memorization: how fast models of growing size memorize, pass by pass.

The AxoNN paper (SC24) found that large models memorize their fine-tuning data within very few
passes. Here a family of model sizes trains on the same documents for `passes` epochs; after
every pass each model continues every training document from its prefix and we record exact
match, for standard loss and for goldfish. The plot puts memorization against model size, one
line per pass.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from memorization.config import ModelConfig, RunConfig
from memorization.experiments.beyond_greedy import NP_NOTE, beyond_greedy
from memorization.experiments.corpus_scan import ScanSettings
from memorization.experiments.paired_runs import paired_runs
from memorization.experiments.passes import train_with_passes
from memorization.experiments.reporting import Outputs, Table, figure, save
from memorization.experiments.runner import Experiment, prepare_split
from memorization.experiments.scoring import SAMPLE_COLUMNS, extraction_samples
from memorization.experiments.spec import ExperimentConfig, check_losses, int_list
from memorization.outputs import check_name
from memorization.paired import Question, per_document
from memorize_core import fail


@dataclass
class ModelSize:
    """One member of the family: HF overrides over the base model, or another model altogether."""

    name: str = ""
    model: str = ""  # zoo name or local HF dir; "" = base.model.name with base overrides underneath
    overrides: dict = field(default_factory=dict)

    def validate(self, prefix: str = "sizes") -> None:
        """A plain, non-empty name (it names the run folders)."""
        check_name(f"{prefix}.name", self.name)  # it names the run folders


def _default_sizes() -> list[ModelSize]:
    return [ModelSize(f"h{w}", overrides={"hidden_size": w, "num_hidden_layers": 2,
                                          "intermediate_size": w * 43 // 16}) for w in (64, 128, 256, 512)]


@dataclass
class Config(ExperimentConfig, ScanSettings):
    """Sizes x losses, each trained for `passes` epochs (base.trainer.epochs is ignored)."""

    sizes: list[ModelSize] = field(default_factory=_default_sizes)
    passes: int = 40
    losses: list[str] = field(default_factory=lambda: ["standard", "goldfish"])
    plot_passes: list[int] = field(default_factory=list)  # [] = up to 6 passes spread over 1..passes

    def validate(self, prefix: str = "") -> None:
        """At least one size with distinct names, passes >= 1, plot passes within range."""
        super().validate(prefix)
        self.check_scan()
        if not self.sizes:
            raise fail("sizes", self.sizes, "give at least one model size")
        names = [s.name for s in self.sizes]
        if len(set(names)) != len(names):
            raise fail("sizes", names, "size names must be distinct (they name the run folders)")
        if self.passes < 1:
            raise fail("passes", self.passes, "must be >= 1")
        check_losses("losses", self.losses)
        if self.plot_passes:
            int_list("plot_passes", self.plot_passes, minimum=1)
            if max(self.plot_passes) > self.passes:
                raise fail("plot_passes", self.plot_passes, f"every pass must be <= passes={self.passes}")

    def shown_passes(self) -> list[int]:
        """Passes drawn as lines and shown as table columns."""
        if self.plot_passes:
            return sorted(self.plot_passes)
        n = min(6, self.passes)
        return sorted({round(1 + i * (self.passes - 1) / max(1, n - 1)) for i in range(n)})


def size_config(cfg: Config, size: ModelSize, loss: str) -> RunConfig:
    """The RunConfig of one (size, loss) run."""
    b = cfg.base
    if size.model:
        model = ModelConfig(name=size.model, overrides=dict(size.overrides))
    else:
        model = ModelConfig(name=b.model.name, overrides={**b.model.overrides, **size.overrides})
    trainer = replace(b.trainer, epochs=cfg.passes, max_steps=0)
    gold = replace(b.goldfish, enabled=loss == "goldfish", token_budget=False)
    return replace(b, name=f"{size.name}-{loss}", model=model, trainer=trainer, goldfish=gold)


def run_configs(cfg: Config) -> list[RunConfig]:
    """Every sub-run's RunConfig, in training order (memorization.train.run_plan checks them all first)."""
    return [size_config(cfg, size, loss) for size in cfg.sizes for loss in cfg.losses]


def run(cfg: Config, exp: Experiment) -> Outputs | None:
    """Train every (size, loss) with extraction after each pass; report memorization vs size per pass."""
    split = prepare_split(cfg.base)
    data = split.prepared
    exp.check(run_configs(cfg), data)
    runs, samples = [], []
    for size in cfg.sizes:
        for loss in cfg.losses:
            rc = size_config(cfg, size, loss)

            def train(rc: RunConfig, run_dir) -> dict[str, Any]:
                return train_with_passes(rc, run_dir, data, grid_spec=exp.grid_spec,
                                         scan_stride=cfg.scan_stride if cfg.scan_corpus else None)

            summary = exp.run(rc, data, train=train, per_run_wandb=cfg.per_run_wandb,
                              extra_key={"evaluated": "every pass"})
            if not exp.is_main:
                continue
            summary["size"] = size.name
            for rec in summary.get("passes", []):
                summary[f"em_pass_{rec['pass']}"] = rec["exact_match_rate"]
                if "scan_exact_match_rate" in rec:  # scan_corpus: every training window, last pass's
                    summary["scan_windows"] = rec["scan_windows"]
                    summary["scan_em_last"] = rec["scan_exact_match_rate"]
            runs.append(summary)
            samples += extraction_samples(rc.name, exp.run_dir(rc.name), data.tokenizer, min(cfg.samples, 4))
    if not exp.is_main:
        return None

    shown = cfg.shown_passes()
    columns = [("size", "size", "{}"), ("params", "params", "{:,}"), ("loss", "loss", "{}")]
    columns += [(f"em_pass_{p}", f"EM pass {p}", "{:.0%}") for p in shown]
    columns += [("rougeL", "RougeL", "{:.3f}"), ("val_loss", "val loss", "{:.3f}")]
    if cfg.scan_corpus:
        columns += [("scan_windows", "windows scanned", "{:,}"),
                    ("scan_em_last", f"EM of every window, pass {cfg.passes}", "{:.0%}")]
    b = cfg.base
    notes = [
        f"Corpus: {b.data.corpus}, {runs[0].get('docs')} training documents cut to {b.data.block_len} "
        f"tokens, {cfg.passes} passes, lr {b.trainer.lr}, batch {b.trainer.batch_size}; every size starts "
        "from the same seed.",
        f"Exact match: greedy {b.eval.suffix} tokens from the first {b.eval.prefix} of every training "
        "document, scored after every pass (EM pass p = after p passes; a cosine schedule spans all passes).",
        f"Goldfish: {b.goldfish.strategy}, k={b.goldfish.k}, h={b.goldfish.h}.",
    ]
    plots = [_plot_sizes(runs, shown, exp.out / "catastrophic-sizes.png"),
             _plot_passes(runs, exp.out / "catastrophic-passes.png")]
    extra_tables, np_plots = beyond_greedy(runs, exp.out, "catastrophic")
    if extra_tables:
        notes.append(NP_NOTE.format(passes=cfg.passes))
    paired, tests, paired_notes = paired_tables(cfg, exp, runs, shown)
    return Outputs(title="Catastrophic memorization: exact match vs model size and passes", kind=cfg.kind,
                   runs=runs, notes=notes + paired_notes,
                   tables=[Table("Summary", runs, tuple(columns), ("loss", "size")), *extra_tables, *paired],
                   plots=plots + np_plots,
                   samples=samples, sample_columns=SAMPLE_COLUMNS,
                   extra={"passes": cfg.passes, "shown_passes": shown, "paired_tests": tests})


def paired_tables(cfg: Config, exp: Experiment, runs: list[dict[str, Any]], shown: list[int]
                  ) -> tuple[list[Table], dict[str, Any], list[str]]:
    """Per-document paired tests (experiments.paired_runs): each size against the smallest (fewest
    parameters) with the same loss (does the bigger model memorize documents the smaller does not, after
    pass p?), and goldfish against standard loss at each size. Exact match after each shown pass from the
    passes' ids; the last pass's answers (exact match, RougeL, (n, p) per scheme) from each run's result
    files."""
    names = [r["name"] for r in runs]
    earlier = [k for k in shown if k != cfg.passes]
    extra = {r["name"]: {f"em_pass_{rec['pass']}": _exact_match_by_id(rec) for rec in r.get("passes", [])
                         if rec["pass"] in earlier and "ids" in rec} for r in runs}
    questions = [Question(f"em_pass_{k}", f"EM pass {k}", "binary", per_document(f"em_pass_{k}"), "{:+.0%}")
                 for k in earlier]
    smallest, by_size = size_pairs(cfg, runs)
    by_loss = [(f"{s.name}-goldfish", f"{s.name}-standard") for s in cfg.sizes] \
        if {"standard", "goldfish"} <= set(cfg.losses) else []
    tables, tests, notes = [], {}, []
    for key, title, pairs in (
            ("by_size", f"Paired tests: each size − '{smallest}' with the same loss, document by document",
             by_size),
            ("by_loss", "Paired tests: goldfish − standard loss at each size, document by document",
             by_loss)):
        table, t, n = paired_runs(exp, [pr for pr in pairs if set(pr) <= set(names)], cfg.base, title=title,
                                  extra=extra, extra_questions=questions)
        tables += table
        notes += n
        if t:
            tests[key] = t
    if tables:
        notes.append(f"Paired tests: 'EM pass p' after pass p; EM, RougeL and (n, p) after the last pass "
                     f"({cfg.passes}).")
        old = [r["name"] for r in runs if earlier and not all("ids" in rec for rec in r.get("passes", []))]
        if old:
            notes.append(f"No 'EM pass p' tests for {', '.join(old)}: trained before each pass kept its "
                         "document ids; delete OUT/runs/NAME and rerun to retrain it.")
    return tables, tests, notes


def size_pairs(cfg: Config, runs: list[dict[str, Any]]) -> tuple[str, list[tuple[str, str]]]:
    """(the size with the fewest parameters, (run, that size's run with the same loss) for every other
    size in config order)."""
    params = {r["size"]: r.get("params") or 0 for r in runs}
    smallest = min((s.name for s in cfg.sizes if s.name in params), key=lambda n: params[n])
    return smallest, [(f"{s.name}-{loss}", f"{smallest}-{loss}") for s in cfg.sizes if s.name != smallest
                      for loss in cfg.losses]


def _exact_match_by_id(record: dict[str, Any]) -> dict[str, float]:
    """One pass's exact match of every document it asked, by document id (1.0: extracted)."""
    hit = set(record["extracted"])
    return {i: float(i in hit) for i in record["ids"]}


def _plot_sizes(runs: list[dict[str, Any]], shown: list[int], path):
    """Exact match against parameter count, one line per pass, one panel per loss."""
    losses = list(dict.fromkeys(r["loss"] for r in runs))
    fig, axes = figure(len(losses))
    for ax, loss in zip(axes, losses):
        rs = sorted((r for r in runs if r["loss"] == loss), key=lambda r: r.get("params") or 0)
        for p in shown:
            ax.plot([r.get("params") for r in rs], [r.get(f"em_pass_{p}") for r in rs], marker="o",
                    label=f"after {p} pass{'es' if p > 1 else ''}")
        ax.set_xscale("log")
        params = [r["params"] for r in rs if r.get("params")]
        ax.minorticks_off()
        ax.set_xticks(params, labels=[f"{p / 1e6:.2g}M" for p in params])
        ax.set(xlabel="parameters", ylabel="exact match (training documents)", ylim=(-0.02, 1.02),
               title=f"{loss} loss")
        ax.legend(fontsize=7)
    return save(fig, path)


def _plot_passes(runs: list[dict[str, Any]], path):
    """Exact match against passes for every size (solid: standard, dashed: goldfish)."""
    fig, (ax,) = figure(1, width=6.5)
    colors: dict[str, Any] = {}
    for r in runs:
        recs = r.get("passes", [])
        style = "-" if r["loss"] == "standard" else "--"
        line, = ax.plot([x["pass"] for x in recs], [x["exact_match_rate"] for x in recs], style,
                        color=colors.get(r["size"]), label=f"{r['size']} {r['loss']}")
        colors.setdefault(r["size"], line.get_color())
    ax.set(xlabel="passes over the data", ylabel="exact match", ylim=(-0.02, 1.02),
           title="Exact match after each pass")
    ax.legend(fontsize=7, ncol=2)
    return save(fig, path)
