"""pretrained-memorization: catastrophic memorization on a real pretrained model, pass by pass.

The AxoNN study (SC24) found that large pretrained models memorize their fine-tuning data within
very few passes. Here a pretrained model (SmolLM2-135M by default) is fine-tuned on one half of a
corpus (the members) for `passes` passes, with standard loss and with goldfish loss, next to the
control that isolates pretraining: the same architecture from random init, same data, same
schedule. Before fine-tuning (pass 0) and after every pass each run is asked the three questions:
  memorization   greedy extraction of every member from its prefix (exact match, RougeL)
  membership     MIA on members vs the held-out half (loss, zlib, min-k++, ref_ratio with the
                 un-fine-tuned base model as reference): ROC AUC, TPR@1%FPR, bootstrap CIs
  utility        held-out loss on the non-member half and on another domain
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from axonn.grid import ProcessGrid
from axonn.hooks import Callback
from axonn.trainer import Trainer
from evals import summarize
from memorization.config import RunConfig
from memorization.experiments.beyond_greedy import NP_NOTE, beyond_greedy
from memorization.experiments.catastrophic import ModelSize
from memorization.experiments.corpus_scan import ScanSettings, scan_training_set
from memorization.experiments.questions import (
    MiaSettings,
    PrivacyUtility,
    format_acc,
    format_auc,
    limit_words,
    other_domain,
    reference_model,
    task_label,
)
from memorization.experiments.reporting import Outputs, Table, figure, save
from memorization.experiments.runner import Experiment, SplitData, prepare_split, say
from memorization.experiments.scoring import SAMPLE_COLUMNS, extraction_samples
from memorization.experiments.spec import (
    LOSSES,
    Arm,
    ExperimentConfig,
    check_losses,
    int_list,
    with_overrides,
)
from memorization.models import is_pretrained, zoo_names
from memorization.outputs import check_name
from memorization.paired import Question, mia_questions, paired_table, per_document
from memorization.train.evaluation import extraction_results
from memorization.train.pipeline import finish, start_run, train
from memorize_core import fail


@dataclass
class Config(ExperimentConfig, MiaSettings, ScanSettings):
    """Sizes x losses x {pretrained, random-init control}, each fine-tuned for `passes` passes."""

    passes: int = 6
    losses: list[str] = field(default_factory=lambda: ["standard", "goldfish"])
    control: bool = True  # also train the architecture from random init (standard loss)
    eval_passes: list[int] = field(default_factory=list)  # [] = every pass (0 is always scored)
    # a family of pretrained models sharing base's tokenizer (e.g. Llama 3.1 8B / 70B / 405B by
    # path); [] = base.model alone. Run names gain the size's name.
    sizes: list[ModelSize] = field(default_factory=list)
    # accept zoo shapes (the real models' architectures, random weights) in place of weight folders,
    # so the experiment can be checked and sized before the weights are there; reported as such
    zoo_stand_ins: bool = False
    # further pretrained arms beside `losses`: standard loss plus the arm's run-config overrides
    # (LoRA, DP-SGD, DP-SGD + LoRA, ...), e.g. {name: lora, overrides: [model.lora.enabled=true]}
    arms: list[Arm] = field(default_factory=list)

    def validate(self, prefix: str = "") -> None:
        """A pretrained base model, members vs a same-distribution held-out half, sane ranges."""
        super().validate(prefix)
        self.check()
        self.check_scan()
        if self.passes < 1:
            raise fail("passes", self.passes, "must be >= 1")
        check_losses("losses", self.losses)
        if self.eval_passes:
            int_list("eval_passes", self.eval_passes, minimum=1)
            if max(self.eval_passes) > self.passes:
                raise fail("eval_passes", self.eval_passes, f"every pass must be <= passes={self.passes}")
        names = [z.name for z in self.sizes]
        if len(set(names)) != len(names):
            raise fail("sizes", names, "size names must be distinct (they name the run folders)")
        for i, z in enumerate(self.sizes):
            z.validate(f"sizes[{i}]")
        require_pretrained_split(self.base, stand_ins=self.zoo_stand_ins)
        for i, z in enumerate(self.sizes):
            if z.model:
                _require_pretrained(f"sizes[{i}].model", z.model, self.zoo_stand_ins)
        arm_names = [a.name for a in self.arms]
        for i, a in enumerate(self.arms):
            check_name(f"arms[{i}].name", a.name)  # it names its run folders
            if a.dedup:
                raise fail(f"arms[{i}].dedup", True, "deduplication is the mitigations experiment's arm; "
                           "remove it here")
            run_config(self, a.name, True, None, a)  # every override parses into a valid run config
        if len(set(arm_names + self.losses)) != len(arm_names) + len(self.losses):
            raise fail("arms", arm_names, f"arm names must be distinct and differ from losses {self.losses}")


def _require_pretrained(field_name: str, name: str, stand_ins: bool) -> None:
    if is_pretrained(name) or (stand_ins and name in zoo_names()):
        return
    extra = "" if name not in zoo_names() else f"; {name} is a zoo shape (random weights): set " \
        "zoo_stand_ins=true only to check and size the experiment before the weights are there"
    raise fail(field_name, name, "this experiment fine-tunes a pretrained model: use smollm2-135m or a "
               f"local Hugging Face model folder{extra}")


def require_pretrained_split(base: RunConfig, stand_ins: bool = False) -> None:
    """Refuse a random-init base model, or non-members from another distribution than the members."""
    d = base.data
    if d.held_out or not d.held_out_fraction > 0:
        raise fail("base.data.held_out_fraction", d.held_out_fraction,
                   "membership inference needs non-members from the members' distribution: set "
                   "base.data.held_out='' and base.data.held_out_fraction=0.5")
    _require_pretrained("base.model.name", base.model.name, stand_ins)


class Evaluator:
    """The three questions, asked of one model: extraction here, MIA and utility by PrivacyUtility."""

    def __init__(self, cfg: Config, split: SplitData, questions: PrivacyUtility):
        self.cfg, self.split, self.questions = cfg, split, questions

    def __call__(self, model: torch.nn.Module, grid: ProcessGrid | None = None, downstream: bool = False
                 ) -> tuple[dict[str, Any], list[Any]]:
        """(record: extraction, MIA per method and held-out losses of `model`, + the downstream tasks
        when asked; extraction results), scored on `grid` (default: the model's own) on every rank."""
        results = extraction_results(model, self.cfg.base, self.split.prepared, grid=grid)
        stats = summarize(results)
        record = {"exact_match_rate": stats["exact_match_rate"], "rougeL": stats["rougeL"],
                  "token_accuracy": stats["token_accuracy"],
                  **self.questions(model, grid, downstream, per_document=True)}
        record["per_document"].update(exact_match=[float(r.exact_match) for r in results],
                                      rougeL=[r.rougeL for r in results])
        if self.cfg.scan_corpus:  # the fraction of the training set extractable, beside the per-document EM
            e = self.cfg.base.eval
            record.update(scan_training_set(model, self.split.prepared.train_docs, prefix=e.prefix,
                                            suffix=e.suffix, stride=self.cfg.scan_stride,
                                            batch_size=e.batch_size, grid=grid))
        return record, results


class PassEvaluation(Callback):
    """Trainer callback: the Evaluator's record before training (pass 0) and after chosen passes;
    downstream tasks (the costliest question) at pass 0 and after the last pass only."""

    def __init__(self, evaluate: Evaluator, passes: set[int] | None, last: int):
        self.evaluate, self.passes, self.last = evaluate, passes, last
        self.records: list[dict[str, Any]] = []
        self.last_results: list[Any] = []  # the latest pass's extraction results
        self.last_per_document: dict[str, Any] = {}  # and its per-document scores (the paired tests')

    def _score(self, trainer: Trainer, done: int) -> None:
        # the model as it is, on its grid: a collective under a grid, every rank takes part
        record, self.last_results = self.evaluate(trainer.model, trainer.grid,
                                                  downstream=done in (0, self.last))
        self.last_per_document = record.pop("per_document")  # the last pass's only: run.json, not each pass
        rec = {"pass": done, "step": trainer.state.step, **record}
        self.records.append(rec)
        head = (rec.get("downstream") or {}).get("headline") or {}
        trainer.log({"pass": done, "pass_exact_match": rec["exact_match_rate"],
                     "pass_val_loss": rec["val_loss"],
                     **({"pass_downstream_acc": head["acc"], "pass_downstream_acc_stderr": head["acc_stderr"]}
                        if head.get("acc") is not None else {})})
        say(f"{trainer.name} pass {done}: exact match {rec['exact_match_rate']:.0%}, val loss "
            f"{rec['val_loss']:.3f}, MIA AUC "
            + ", ".join(f"{m} {v['auc']:.2f}" for m, v in rec["mia"].items())
            + (f", {head['task']} acc {head['acc']:.3f}" if head.get("acc") is not None else ""))

    def on_fit_start(self, trainer: Trainer) -> None:
        """Pass 0: the model before fine-tuning."""
        self._score(trainer, 0)

    def on_epoch_end(self, trainer: Trainer, epoch: int) -> None:
        """After pass `epoch` (always after the last)."""
        if self.passes is None or epoch in self.passes or epoch == self.last:
            self._score(trainer, epoch)


def _sized(cfg: Config, size: ModelSize | None) -> RunConfig:
    """The base RunConfig with `size`'s model and overrides (the base itself without a size)."""
    b = cfg.base
    if size is None:
        return b
    overrides = {**b.model.overrides, **size.overrides}
    model = replace(b.model, name=size.model or b.model.name, overrides=overrides)
    return replace(b, model=model)


def run_config(cfg: Config, loss: str, pretrained: bool, size: ModelSize | None = None,
               arm: Arm | None = None) -> RunConfig:
    """The RunConfig of one (size, loss or arm, pretrained?) run: `passes` epochs, goldfish per `loss`
    (an arm: standard loss plus its overrides)."""
    b = _sized(cfg, size)
    name = (f"{size.name}-" if size else "") + f"{'pretrained' if pretrained else 'random-init'}-{loss}"
    rc = replace(b, name=name, model=replace(b.model, random_init=not pretrained),
                 trainer=replace(b.trainer, epochs=cfg.passes, max_steps=0),
                 goldfish=replace(b.goldfish, enabled=loss == "goldfish"),
                 # every pass is scored by the callback and finish writes the last pass's extraction;
                 # extraction stays on so the dry run sizes it
                 eval=replace(b.eval, extraction=True, mia=False))
    if arm is not None:
        rc = with_overrides(rc, arm.overrides, f"arms[{cfg.arms.index(arm)}].overrides")
        rc = replace(rc, name=name)
    return replace(rc, goldfish=replace(rc.goldfish, token_budget=False))


def _arms(cfg: Config) -> list[tuple[ModelSize | None, str, bool, Arm | None]]:
    per_size = [(loss, True, None) for loss in cfg.losses] + [(a.name, True, a) for a in cfg.arms] \
        + ([("standard", False, None)] if cfg.control else [])
    return [(size, loss, pretrained, arm) for size in (cfg.sizes or [None])
            for loss, pretrained, arm in per_size]


def run_configs(cfg: Config) -> list[RunConfig]:
    """Every sub-run's RunConfig, in training order (memorization.train.run_plan checks them all first)."""
    return [run_config(cfg, loss, pretrained, size, arm) for size, loss, pretrained, arm in _arms(cfg)]


def _evaluator(cfg: Config, size: ModelSize | None, split: SplitData, grid_spec: str | None) -> Evaluator:
    """The three questions for one size, its un-fine-tuned model the MIA reference (asked on every
    rank: the models are scored where they are, on the runs' grid)."""
    data = split.prepared
    reference = reference_model(_sized(cfg, size), grid_spec)
    questions = PrivacyUtility(cfg, data.tokenizer, data.member_docs, split.nonmembers,
                               other_domain(cfg, data.tokenizer, cfg.base.data.block_len), reference,
                               seed=cfg.base.seed)
    return Evaluator(cfg, split, questions)


def run(cfg: Config, exp: Experiment) -> Outputs | None:
    """Fine-tune every arm with the three questions asked before and after each pass; report per pass."""
    split = prepare_split(cfg.base)
    data = split.prepared
    exp.check(run_configs(cfg), data)
    runs, samples = [], []
    answers: dict[str, Any] = {}  # each run's summary (its last pass's per-document scores: paired tests)
    evaluator, evaluated = None, object()  # one size's questions (and reference) at a time
    for size, loss, pretrained, arm in _arms(cfg):
        rc = run_config(cfg, loss, pretrained, size, arm)
        if size is not evaluated:
            evaluator, evaluated = _evaluator(cfg, size, split, exp.grid_spec), size

        def train_arm(rc: RunConfig, run_dir: Path, evaluator: Evaluator = evaluator) -> dict[str, Any]:
            probe = PassEvaluation(evaluator, set(cfg.eval_passes) or None, cfg.passes)
            with start_run(rc, run_dir, data, overwrite=True, grid_spec=exp.grid_spec,
                           progress=rc.trainer.progress, callbacks=[probe]) as run:
                train(run)  # the last pass is always scored: its extraction is the run's
                summary = finish(run, scored=probe.last_results,
                                 extra={"passes": probe.records, "per_document": probe.last_per_document})
            if exp.is_main:
                with open(run_dir / "passes.jsonl", "w", encoding="utf-8") as fh:
                    fh.writelines(json.dumps(r) + "\n" for r in probe.records)
            return summary

        summary = exp.run(rc, data, train=train_arm, per_run_wandb=cfg.per_run_wandb,
                          extra_key={"evaluated": "every pass", "mia": cfg.mia_methods, "k": cfg.mia_k,
                                     "bootstrap": cfg.bootstrap, "other": [cfg.other_held_out,
                                                                          cfg.other_held_out_limit],
                                     "eval_passes": cfg.eval_passes,
                                     "downstream": [cfg.downstream, cfg.downstream_limit,
                                                    cfg.downstream_fewshot]})
        if not exp.is_main:
            continue
        record = _run_record(summary, "goldfish" if rc.goldfish.enabled else "standard", pretrained)
        record["arm"] = loss
        record["model"] = rc.model.name
        record["weights"] = ("random init" if not pretrained else "pretrained" if is_pretrained(rc.model.name)
                             else "zoo stand-in (random weights)")
        runs.append(record)
        answers[rc.name] = summary
        samples += extraction_samples(rc.name, exp.run_dir(rc.name), data.tokenizer, min(cfg.samples, 4))
    if not exp.is_main:
        return None
    return _outputs(cfg, runs, split, exp.out, samples, answers)


def paired_pairs(cfg: Config) -> list[tuple[str, str]]:
    """(run, reference) of the paired tests: every other run of a size against that size's pretrained
    standard-loss run (the first run of the size when the experiment trains none)."""
    pairs = []
    for size in cfg.sizes or [None]:
        names = [(run_config(cfg, loss, pretrained, s, arm).name,
                  loss == "standard" and pretrained and arm is None)
                 for s, loss, pretrained, arm in _arms(cfg) if s is size]
        ref = next((n for n, standard in names if standard), names[0][0])
        pairs += [(n, ref) for n, _ in names if n != ref]
    return pairs


def paired_questions(methods: list[str]) -> list[Question]:
    """What the paired tests compare between two runs after the last pass (docs/experiments.md)."""
    return [Question("em", "EM", "binary", per_document("exact_match"), "{:+.0%}"),
            Question("rougeL", "RougeL", "number", per_document("rougeL")),
            Question("nll", "held-out NLL per document", "number", per_document("nonmember_nll")),
            *mia_questions(methods)]


def _run_record(summary: dict[str, Any], loss: str, pretrained: bool) -> dict[str, Any]:
    passes = summary.get("passes") or []
    last = passes[-1] if passes else {}
    return {"name": summary["name"], "loss": loss, "pretrained": pretrained, "params": summary.get("params"),
            "steps": summary.get("steps"), "train_seconds": summary.get("train_seconds"),
            "final_train_loss": summary.get("final_train_loss"), "reused": summary.get("reused", False),
            "exact_match_rate": last.get("exact_match_rate"), "rougeL": last.get("rougeL"),
            "val_loss": last.get("val_loss"), "other_val_loss": last.get("other_val_loss"),
            "passes": passes, "sampled": summary.get("sampled"),
            "near_verbatim": summary.get("near_verbatim")}


def _first_pass(run: dict[str, Any], threshold: float) -> int | None:
    return next((p["pass"] for p in run["passes"] if (p.get("exact_match_rate") or 0) >= threshold), None)


def _outputs(cfg: Config, runs: list[dict[str, Any]], split: SplitData, out: Path,
             samples: list[list[Any]], answers: dict[str, Any] | None = None) -> Outputs:
    methods = cfg.mia_methods
    summary_rows, pass_rows = [], []
    for r in runs:
        last = r["passes"][-1] if r["passes"] else {}
        first = r["passes"][0] if r["passes"] else {}
        row = {"run": r["name"], "params": r.get("params"), "em_0": first.get("exact_match_rate"),
               "em": r["exact_match_rate"], "first_50": _first_pass(r, 0.5), "rougeL": r["rougeL"],
               "val_0": first.get("val_loss"), "val": r["val_loss"], "other": r["other_val_loss"],
               "ds_0": format_acc(first.get("downstream")), "ds": format_acc(last.get("downstream"))}
        for m in methods:
            row[f"auc_{m}"] = format_auc(last.get("mia", {}).get(m))
        summary_rows.append(row)
        for p in r["passes"]:
            pr = {"run": r["name"], "pass": p["pass"], "em": p["exact_match_rate"], "rougeL": p["rougeL"],
                  "val": p["val_loss"], "other": p["other_val_loss"]}
            for m in methods:
                pr[f"auc_{m}"] = format_auc(p["mia"].get(m))
                pr[f"tpr_{m}"] = p["mia"].get(m, {}).get("tpr_at_1fpr")
            pass_rows.append(pr)
    cols = [("run", "run", "{}"), ("params", "params", "{:,}"), ("em_0", "EM pass 0", "{:.0%}"),
            ("em", f"EM pass {cfg.passes}", "{:.0%}"), ("first_50", "first pass EM>=50%", "{}"),
            ("rougeL", "RougeL", "{:.3f}"), ("val_0", "val loss pass 0", "{:.3f}"),
            ("val", "val loss", "{:.3f}"),
            ("other", f"{cfg.other_held_out} loss", "{:.3f}")]
    if cfg.downstream:
        cols += [("ds_0", f"{task_label(cfg)} pass 0", "{}"),
                 ("ds", f"{task_label(cfg)} pass {cfg.passes}", "{}")]
    cols += [(f"auc_{m}", f"AUC {m} [95% CI]", "{}") for m in methods]
    pcols = [("run", "run", "{}"), ("pass", "pass", "{}"), ("em", "EM", "{:.0%}"),
             ("rougeL", "RougeL", "{:.3f}"),
             ("val", "val loss", "{:.3f}"), ("other", f"{cfg.other_held_out} loss", "{:.3f}")]
    pcols += [(f"auc_{m}", f"AUC {m}", "{}") for m in methods]
    pcols += [(f"tpr_{m}", f"TPR@1%FPR {m}", "{:.2f}") for m in methods]
    b = cfg.base
    notes = [
        f"Model: {b.model.name} ({runs[0].get('params') or 0:,} parameters), its own tokenizer. Members: "
        f"{len(split.prepared.train_docs)} documents of '{b.data.corpus}' cut to {b.data.block_len} tokens; "
        f"non-members: {len(split.nonmembers)} documents from {split.held_out_source}.",
        f"{cfg.passes} passes, lr {b.trainer.lr}, batch {b.trainer.batch_size}, "
        f"warmup {b.trainer.warmup_steps}, "
        f"cosine to {b.trainer.min_lr_ratio} x lr; every arm from the same seed. "
        "Pass 0 = before fine-tuning.",
        f"Extraction: greedy {b.eval.suffix} tokens from the first {b.eval.prefix} of every member "
        "(exact match "
        "= all of them right).",
        f"MIA: members vs non-members; higher score = member; min-k fraction {cfg.mia_k}; ref_ratio uses the "
        f"un-fine-tuned {b.model.name} as the reference; 95% CIs from {cfg.bootstrap} stratified bootstrap "
        "resamples. With this few documents an AUC CI is wide: read the trend, not the third decimal.",
        "Utility: token-weighted held-out loss (nats/token) on the non-members and on "
        f"'{cfg.other_held_out}'"
        + (f"; downstream accuracy ± standard error (lm-eval) on {', '.join(cfg.downstream)} "
           f"({limit_words(cfg)}), at pass 0 and after the last pass." if cfg.downstream else "."),
        f"Goldfish: {b.goldfish.strategy}, k={b.goldfish.k}, h={b.goldfish.h}."
        + (" The random-init control is the same architecture with fresh seeded weights, standard loss."
           if cfg.control else ""),
    ]
    if cfg.sizes:
        which = "; ".join(f"{r['name']}: {r.get('model')} ({r.get('weights')})" for r in runs)
        notes.append(f"Sizes: {which}. Each size's MIA reference is its own un-fine-tuned model.")
    plots = [_plot_em(runs, out / "pretrained-exact-match.png"),
             _plot_mia(runs, methods, out / "pretrained-mia.png"),
             _plot_utility(runs, cfg.other_held_out, out / "pretrained-utility.png")]
    extra_tables, np_plots = beyond_greedy(runs, out, "pretrained")
    if extra_tables:
        notes.append(NP_NOTE.format(passes=cfg.passes))
    paired, tests, paired_notes = paired_table(answers or {}, paired_pairs(cfg), paired_questions(methods),
                                               label="run", resamples=cfg.bootstrap or 1000, seed=b.seed,
                                               missing="retrain those runs: their scores are taken while "
                                                       "training, pass by pass")
    extra_tables += [Table(**paired, per_seed=True)] if paired else []
    notes += paired_notes
    return Outputs(title="Memorization of a pretrained model, pass by pass", kind=cfg.kind, runs=runs,
                   tables=[Table("Summary", summary_rows, tuple(cols)),
                           Table("Per pass", pass_rows, tuple(pcols), ("run", "pass")), *extra_tables],
                   notes=notes, plots=plots + np_plots, samples=samples, sample_columns=SAMPLE_COLUMNS,
                   extra={"passes": cfg.passes, "mia_methods": methods, "paired_tests": tests})


def _style(r: dict[str, Any]) -> dict[str, Any]:
    line = "-." if r.get("arm") not in (None, *LOSSES) else "-" if r["loss"] == "standard" else "--"
    return {"linestyle": line, "marker": "o" if r["pretrained"] else "x"}


def _plot_em(runs: list[dict[str, Any]], path: Path) -> Path:
    fig, (ax,) = figure(1, width=6.0)
    for r in runs:
        ax.plot([p["pass"] for p in r["passes"]], [p["exact_match_rate"] for p in r["passes"]],
                label=r["name"], **_style(r))
    ax.set(xlabel="passes over the members", ylabel="exact match (members)", ylim=(-0.02, 1.02),
           title="Verbatim extraction after each pass")
    ax.legend(fontsize=8)
    return save(fig, path)


def _plot_mia(runs: list[dict[str, Any]], methods: list[str], path: Path) -> Path:
    fig, axes = figure(len(methods), width=4.2)
    for ax, m in zip(axes, methods):
        for r in runs:
            xs = [p["pass"] for p in r["passes"]]
            recs = [p["mia"].get(m, {}) for p in r["passes"]]
            line, = ax.plot(xs, [x.get("auc") for x in recs], label=r["name"], **_style(r))
            if all(x.get("auc_ci") for x in recs):
                ax.fill_between(xs, [x["auc_ci"][0] for x in recs], [x["auc_ci"][1] for x in recs],
                                color=line.get_color(), alpha=0.12)
        ax.axhline(0.5, color="grey", lw=0.8, ls=":")
        ax.set(xlabel="pass", ylabel="ROC AUC", ylim=(0.3, 1.02), title=f"MIA: {m}")
    axes[0].legend(fontsize=7)
    return save(fig, path)


def _plot_utility(runs: list[dict[str, Any]], other: str, path: Path) -> Path:
    fig, axes = figure(2 if other else 1, width=5.0)
    keys = [("val_loss", "non-member held-out loss")] + (
        [("other_val_loss", f"{other} loss")] if other else [])
    for ax, (key, title) in zip(axes, keys):
        for r in runs:
            ax.plot([p["pass"] for p in r["passes"]], [p[key] for p in r["passes"]], label=r["name"],
                    **_style(r))
        ax.set(xlabel="pass", ylabel="nats / token", title=f"Utility: {title}")
        ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    return save(fig, path)


__all__ = ["Config", "Evaluator", "PassEvaluation", "run", "run_config"]
