"""forgetting: does what a fine-tune memorized fade when training goes on without it?

Phase 1 is the mitigations experiment's fine-tune: every arm (data: a name and run-config overrides)
trains the base model `passes` passes on a corpus into which canaries and duplicated documents were
injected at several copy counts (canary-exposure's injection, OUT/manifest.json): OUT/runs/ARM.
Phase 2 is an ordinary later stage, the same for every arm: the arm's exported model trains on with
plain loss (no goldfish, DP-SGD or LoRA) for `continue_passes` passes over fresh documents that hold
none of the injected items (`fresh.corpus`, another domain by default: news after Wikipedia):
OUT/runs/ARM-continued. Before its first step (pass 0, the fine-tuned model) and after every pass the
continued model is asked the mitigations experiment's questions about the phase-1 data: verbatim
extraction of the leads seen once and the duplicated ones, the secrets' exposure and extraction by copy
count, (n, p) extraction beyond greedy, membership inference of the leads against the held-out half,
and the held-out losses (Wikipedia, and `other_held_out`: held-out text of the fresh domain).

The question it answers (Jagielski et al. 2023, "Measuring forgetting of memorized training
examples"): is a secret inserted 8 times into a fine-tune still extractable after the model trains on
other data, does a mitigation's effect outlast it, and how much of the fine-tune's exposure is left
("exposure kept": the share of the gain over the base model, `baseline: true`, that remains).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from axonn.hooks import Callback
from axonn.trainer import Trainer
from data_pipelines import load_corpus
from memorization.config import RunConfig, change_words
from memorization.experiments.beyond_greedy import near_table
from memorization.experiments.injection import MASKED_COLUMNS, build_corpus, item_words, save_manifest
from memorization.experiments.mitigations import (
    BASELINE_ROW,
    BEYOND_INDEX,
    MASKED_NOTE,
    PZ_FLOOR,
    ArmQuestions,
    arm_config,
    arm_record,
    baseline_record,
    beyond_table,
    paired_questions,
    question_sides,
    splits_by_mask,
)
from memorization.experiments.mitigations import REFERENCE as REFERENCE  # replicates: against 'none' too
from memorization.experiments.mitigations import Config as MitigationsConfig
from memorization.experiments.questions import (
    PrivacyUtility,
    format_acc,
    format_auc,
    other_domain,
    reference_model,
    task_label,
)
from memorization.experiments.reporting import Outputs, Table, figure, save
from memorization.experiments.runner import Experiment, digest, say
from memorization.experiments.spec import Arm
from memorization.mitigations.peft_lora import LoraSettings
from memorization.paired import paired_table
from memorization.train import pipeline
from memorization.train.prepare import PreparedData, is_chat_data, prepare_documents
from memorize_core import ConfigError, fail

SUFFIX = "-continued"  # phase 2 of arm A runs in OUT/runs/A-continued


@dataclass
class FreshData:
    """What phase 2 trains on: a corpus without the injected items, cut like the fine-tune's rows."""

    corpus: str = "lee-news"
    limit: int = 0  # documents (0 = every one)
    lr: float = 0.0  # phase 2's peak learning rate (0 = base.trainer.lr)


@dataclass
class Config(MitigationsConfig):
    """Mitigations' fine-tune (arms, injection, questions) plus the continued training that follows it."""

    continue_passes: int = 4
    fresh: FreshData = field(default_factory=FreshData)
    other_held_out: str = "lee-news-test"  # held-out text of the fresh domain: does phase 2 learn it?

    def validate(self, prefix: str = "") -> None:
        """Mitigations' checks, then what phase 2 needs: fresh data apart from every evaluated set,
        arms whose model a plain run can continue, distinct run folders."""
        super().validate(prefix)
        if self.continue_passes < 1:
            raise fail("continue_passes", self.continue_passes, "must be >= 1")
        f = self.fresh
        if not f.corpus:
            raise fail("fresh.corpus", f.corpus, "name the corpus phase 2 trains on, e.g. lee-news")
        if f.corpus == self.base.data.corpus:
            raise fail("fresh.corpus", f.corpus, "is the fine-tune's corpus, whose documents are the members "
                       "and non-members asked about; continue on another one, e.g. lee-news")
        if f.corpus == self.other_held_out:
            raise fail("other_held_out", self.other_held_out, "is the corpus phase 2 trains on, so its loss "
                       "is no held-out loss; name held-out text of that domain (lee-news-test for lee-news) "
                       "or '' for none")
        if f.limit < 0:
            raise fail("fresh.limit", f.limit, "must be >= 0 (0 = every document)")
        if not f.lr >= 0:
            raise fail("fresh.lr", f.lr, "must be >= 0 (0 = base.trainer.lr)")
        names = {a.name for a in self.arms}
        for i, a in enumerate(self.arms):
            if a.dedup:
                raise fail(f"arms[{i}].dedup", True, "every arm here trains on the one injected corpus; "
                           "compare deduplication in the mitigations experiment")
            rc = arm_config(self, a, f"arms[{i}].overrides")
            if rc.model.lora.enabled and rc.model.lora.export != "merged":
                raise fail(f"arms[{i}].overrides", a.overrides, "phase 2 continues the arm's exported model: "
                           "a LoRA arm must export the merged model (model.lora.export=merged)")
            if a.name + SUFFIX in names:
                raise fail(f"arms[{i}].name", a.name + SUFFIX, f"is the folder of arm {a.name}'s continued "
                           "training; rename the arm")
        continued_config(self, self.arms[0], None).validate("fresh")


def continued_config(cfg: Config, arm: Arm, model_dir: str | Path | None) -> RunConfig:
    """Phase 2 of `arm`: the base run config continued from `model_dir` (the arm's exported model; None:
    the base model, the same shape, for the checks made before any model exists) on the fresh corpus,
    `continue_passes` passes of plain loss at fresh.lr; the questions are asked by the experiment."""
    b, f = cfg.base, cfg.fresh
    model = replace(b.model, lora=LoraSettings(), random_init=False,
                    **({"name": str(model_dir), "overrides": {}} if model_dir is not None else {}))
    return replace(
        b, name=arm.name + SUFFIX, model=model,
        data=replace(b.data, corpus=f.corpus, limit=f.limit, held_out="", held_out_fraction=0.0),
        goldfish=replace(b.goldfish, enabled=False),
        trainer=replace(b.trainer, epochs=cfg.continue_passes, max_steps=0, lr=f.lr or b.trainer.lr,
                        dp=replace(b.trainer.dp, enabled=False)),
        eval=replace(b.eval, extraction=False, audit=False, mia=False))  # the experiment asks its own


def fresh_data(cfg: Config, tokenizer: Any) -> PreparedData:
    """Phase 2's training rows: the fresh corpus in the fine-tune's tokenizer, cut to its block."""
    rc = continued_config(cfg, cfg.arms[0], None)
    try:
        docs = load_corpus(cfg.fresh.corpus, limit=cfg.fresh.limit or None)
    except ConfigError as e:  # its message names `corpus`: say which key the name came from
        raise fail("fresh.corpus", cfg.fresh.corpus, str(e).split(": ", 1)[-1]) from None
    return prepare_documents(rc, docs, tokenizer=tokenizer)


def run_configs(cfg: Config) -> list[RunConfig]:
    """Every sub-run's RunConfig in training order, each arm's fine-tune then its continuation (the
    latter with the base model's name: its own model exists once the fine-tune has run)."""
    return [rc for arm in cfg.arms for rc in (arm_config(cfg, arm), continued_config(cfg, arm, None))]


def run_data(cfg: Config) -> list[PreparedData]:
    """Each sub-run's training rows as `run` prepares them, writing nothing (the dry run's DP checks)."""
    data = build_corpus(cfg, None)[0]
    fresh = fresh_data(cfg, data.tokenizer)
    return [d for _ in cfg.arms for d in (data, fresh)]


class AfterEachPass(Callback):
    """Trainer callback: `ask(model)` before the first step (pass 0) and after every pass."""

    def __init__(self, ask: ArmQuestions):
        self.ask = ask
        self.records: list[dict[str, Any]] = []

    def on_fit_start(self, trainer: Trainer) -> None:
        """Pass 0: the fine-tuned model, before continued training moves it."""
        self.score(trainer, 0)

    def on_epoch_end(self, trainer: Trainer, epoch: int) -> None:
        """After pass `epoch` over the fresh rows."""
        self.score(trainer, epoch)

    def score(self, trainer: Trainer, label: int) -> None:
        """The answers of the model as it is now (on every rank: a collective under a sharded grid)."""
        model = trainer.model
        was_training = model.training
        model.eval()
        with torch.no_grad():
            values = self.ask(model, downstream=True)
        model.train(was_training)
        self.records.append({"pass": label, "step": trainer.state.step, **values})
        inj = values["injected"]["canaries"]
        method = self.ask.cfg.mia_methods[0]
        trainer.log({"continued_pass": label,
                     "canary_exposure": sum(c["exposure"] for c in inj) / max(1, len(inj)),
                     f"mia_auc_{method}": (values["mia"].get(method) or {}).get("auc")})


def run(cfg: Config, exp: Experiment) -> Outputs | None:
    """Fine-tune every arm on the injected corpus, continue it on fresh data, ask after every pass."""
    data, manifest, dup_tokens, _ = build_corpus(cfg, exp)
    b = cfg.base
    fresh = fresh_data(cfg, data.tokenizer)
    sides = question_sides(cfg, data, manifest)  # chat data: conversations, asked prompt -> answer
    members, nonmembers = sides.members, sides.nonmembers
    exp.check(run_configs(cfg), [d for _ in cfg.arms for d in (data, fresh)])
    save_manifest(manifest, exp)
    reference = reference_model(b, exp.grid_spec)
    questions = PrivacyUtility(cfg, data.tokenizer, members, nonmembers,
                               other_domain(cfg, data.tokenizer, b.data.block_len), reference, seed=b.seed,
                               starts=sides.starts)
    ask = ArmQuestions(cfg, data, manifest, dup_tokens, members, questions, sides.pairs)
    baseline = None
    if cfg.baseline:
        say("base model: its evaluation before fine-tuning")
        baseline = baseline_record(ask.baseline(exp, reference), cfg.counts)
    del reference
    key = cfg.injection_key()
    arms, answers = [], {}  # answers: every pass's own, by row name, for the paired tests
    for arm in cfg.arms:
        first = arm_config(cfg, arm)
        tuned = exp.run(first, data, extra_key=key, per_run_wandb=cfg.per_run_wandb)  # phase 1: its own run
        tuned.pop("reused", None)  # the same fine-tune whether reused or not: not part of its identity
        rc = continued_config(cfg, arm, exp.run_dir(arm.name) / "model")

        def train(rc: RunConfig, run_dir: Path) -> dict[str, Any]:
            probe = AfterEachPass(ask)
            with pipeline.start_run(rc, run_dir, fresh, overwrite=True, grid_spec=exp.grid_spec,
                                    progress=rc.trainer.progress, callbacks=[probe]) as run:
                pipeline.train(run)
                return pipeline.finish(run, extra={"after_pass": probe.records})

        # phase 2 depends on the fine-tune it continues (that training itself: its summary, which a
        # retrained fine-tune never repeats, so phase 2 retrains with it), the fresh rows and the
        # questions (the answers after each pass are taken while it trains: a changed question retrains
        # it); keyed by the base model's name, not the folder it reads the fine-tune from
        after = {"fine_tune": digest(tuned), "fresh": digest(fresh.train_docs),
                 "questions": ask.key, "asked": digest([members, nonmembers, questions.other])}
        summary = exp.run(rc, fresh, train=train, extra_key=after, per_run_wandb=cfg.per_run_wandb,
                          key_config=continued_config(cfg, arm, None))
        if not exp.is_main:
            continue
        passes = [{"pass": r["pass"], "step": r["step"], **arm_record(arm, r, cfg.counts)}
                  for r in summary["after_pass"]]
        answers.update({pass_name(arm.name, r["pass"]): r for r in summary["after_pass"]})
        arms.append({"name": arm.name, "mitigation": arm.mitigation, "overrides": list(arm.overrides),
                     "fine_tune_steps": tuned.get("steps"),
                     "continued_steps": summary.get("steps"),
                     "passes": passes, "reused": summary.get("reused", False)})
    if not exp.is_main:
        return None
    return _outputs(cfg, arms, baseline, len(members), len(nonmembers), len(data.train_docs),
                    len(fresh.train_docs), exp.out, answers)


def pass_name(arm: str, k: int) -> str:
    """The row of `arm` after `k` passes of continued training (0: the fine-tune before any)."""
    return f"{arm}, pass {k}"


def paired(cfg: Config, arms: list[dict[str, Any]], answers: dict[str, Any]
           ) -> tuple[list[Table], dict[str, Any], list[str]]:
    """Two per-document paired tables (memorization.paired): each arm after k passes against itself at
    pass 0 (what continued training removed, document by document), and each arm against the unmitigated
    one (mitigation `none`, else the first arm) after the same passes (whether a mitigation's effect
    lasts)."""
    names = [a["name"] for a in arms]
    ref = next((a["name"] for a in arms if a["mitigation"] == "none"), names[0] if names else "")
    rows = [(pass_name(a["name"], p["pass"]), a["name"], p["pass"]) for a in arms for p in a["passes"]]
    tables, tests, notes = [], {}, []
    asks = (("since_pass_0", "Paired tests: each pass − pass 0 of its arm, document by document",
             [(row, pass_name(arm, 0)) for row, arm, k in rows if k != 0]),
            ("against_reference",
             f"Paired tests: each arm − '{ref}' after as many passes, document by document",
             [(row, pass_name(ref, k)) for row, arm, k in rows if arm != ref]))
    for key, title, pairs in asks:
        table, t, n = paired_table(answers, pairs, paired_questions(list(cfg.mia_methods), item_words(cfg)),
                                   label="model",
                                   resamples=cfg.bootstrap or 1000, seed=cfg.base.seed, title=title,
                                   missing="rerun the experiment: phase 2, asked as it trains, trains again")
        if table:
            tables.append(Table(**table, per_seed=True))
            tests[key] = t
        notes += n
    return tables, tests, notes


MIN_GAIN = 1.0  # bits: below this the fine-tune's exposure gain is within a few secrets' noise (a secret
# nobody trained on scores 0-3 bits), and a share of it would be noise over noise


def kept(value: float | None, start: float | None, floor: float | None) -> float | None:
    """The share of the fine-tune's exposure gain over the base model still there: (value - floor) /
    (start - floor); None without a base model or where the fine-tune gained under MIN_GAIN bits."""
    if value is None or start is None or floor is None or not start - floor >= MIN_GAIN:
        return None
    return (value - floor) / (start - floor)


def _columns(cfg: Config) -> tuple:
    """The per-pass table's columns: the first MIA method, the other held-out corpus and the downstream
    tasks where the experiment has them."""
    many, _ = item_words(cfg)
    cols = [("arm", "arm", "{}"), ("pass", "continued passes", "{}"), ("step", "steps", "{}"),
            ("em_once", f"EM {many} seen once", "{:.0%}"), ("em_dup", f"EM duplicated {many}", "{:.0%}"),
            ("exposure", "canary exposure (bits)", "{:.2f}"), ("kept", "exposure kept", "{:.0%}"),
            ("extracted", "secrets extracted", "{:.0%}"),
            ("auc", f"MIA AUC {cfg.mia_methods[0]} [95% CI]", "{}"), ("val", "held-out loss", "{:.3f}")]
    if cfg.other_held_out:
        cols.append(("other", f"{cfg.other_held_out} loss", "{:.3f}"))
    if cfg.downstream:
        cols.append(("ds", f"{task_label(cfg)} ± SE", "{}"))
    return tuple(cols)


def _row(name: str, p: dict[str, Any], floor: float | None, start: float | None,
         method: str) -> dict[str, Any]:
    exposure = p["canaries"]["exposure_mean"]
    return {"arm": name, "pass": p.get("pass"), "step": p.get("step"),  # the base model: None, shown "-"
            "em_once": p["extraction"]["seen_once"]["exact_match_rate"],
            "em_dup": p["extraction"]["duplicated"]["exact_match_rate"],
            "exposure": exposure, "kept": kept(exposure, start, floor),
            "extracted": p["canaries"]["extracted_rate"], "auc": format_auc(p["mia"].get(method)),
            "val": p["utility"]["val_loss"], "other": p["utility"]["other_val_loss"],
            "ds": format_acc(p["utility"].get("downstream"))}


def _outputs(cfg: Config, arms: list[dict[str, Any]], baseline: dict[str, Any] | None, n_members: int,
             n_nonmembers: int, n_rows: int, n_fresh: int, out: Path,
             answers: dict[str, Any] | None = None) -> Outputs:
    floor = baseline["canaries"]["exposure_mean"] if baseline else None
    method = cfg.mia_methods[0]
    (many, one), chat = item_words(cfg), is_chat_data(cfg.base)
    rows = [_row(BASELINE_ROW, baseline, None, None, method)] if baseline else []
    by_count = []
    for a in arms:
        start = a["passes"][0]["canaries"]["exposure_mean"]
        rows += [_row(a["name"], p, floor, start, method) for p in a["passes"]]
        base_counts = baseline["by_copy_count"] if baseline else {}
        for n in map(str, cfg.counts):
            first = a["passes"][0]["by_copy_count"][n]["canary_exposure"]
            for p in a["passes"]:
                v = p["by_copy_count"][n]
                by_count.append({"arm": a["name"], "pass": p["pass"], "copies": int(n), **v,
                                 "kept": kept(v["canary_exposure"], first,
                                              (base_counts.get(n) or {}).get("canary_exposure"))})
    ccols = (("arm", "arm", "{}"), ("pass", "continued passes", "{}"), ("copies", "copies", "{}"),
             ("canary_exposure", "canary exposure", "{:.2f}"), ("kept", "exposure kept", "{:.0%}"),
             ("canary_extracted", "secrets extracted", "{:.0%}"),
             ("duplicate_exact_match", f"duplicated-{one} EM", "{:.0%}"))
    if splits_by_mask(cfg):
        ccols += MASKED_COLUMNS
    b, f, c = cfg.base, cfg.fresh, cfg.canaries
    notes = [
        f"Phase 1 (each arm's fine-tune): {b.model.name} on {n_rows} rows of {b.data.corpus} "
        f"({n_members} {many} seen once, plus {cfg.duplicates.per_count} duplicated {many} and {c.per_count} "
        f"canaries per copy count {cfg.counts}), {cfg.passes} passes, lr {b.trainer.lr} (arms may "
        "override it).",
        f"Phase 2 (the same for every arm): plain loss, {cfg.continue_passes} passes over {n_fresh} rows of "
        f"'{f.corpus}' (none of the injected items), lr {f.lr or b.trainer.lr}; pass 0 is the fine-tuned "
        "model before its first step.",
        "Questions after every pass: EM = "
        + (f"the greedy answer (its first {b.eval.suffix} tokens) from each conversation's prompt; "
           if chat else f"greedy {b.eval.suffix}-token suffix from the {b.eval.prefix}-token prefix; ")
        + f"canary exposure in bits over the whole secret space "
        f"(max log2|R|); MIA on the {n_members} {many} seen once vs {n_nonmembers} held-out {many}"
        + (" (each answer scored given its prompt)" if chat else "") + "; "
        f"held-out loss on those {many}" + (f" and on '{cfg.other_held_out}' (held-out text of the fresh "
                                          "domain: phase 2 learning it)." if cfg.other_held_out else "."),
    ]
    if splits_by_mask(cfg):
        notes.append(f"By copy count: {MASKED_NOTE}")
    if baseline:
        notes.append(f"'{BASELINE_ROW}': the pretrained weights before fine-tuning "
                     "(OUT/baseline/evals.json). 'exposure kept' = (exposure - the base model's) / "
                     "(exposure at pass 0 - the base model's): the share of the fine-tune's gain left; "
                     "0% = back to a model that never saw the secrets.")
    # beyond greedy and near-verbatim, one row per (arm and pass, documents, scheme)
    records = ([{**baseline, "name": BASELINE_ROW}] if baseline else []) + [
        {**p, "name": f"{a['name']}, pass {p['pass']}"} for a in arms for p in a["passes"]]
    tables = [Table("After each pass of continued training", rows, _columns(cfg), ("arm", "pass")),
              Table("By copy count", by_count, ccols, ("arm", "pass", "copies"))]
    beyond_rows, beyond_cols = beyond_table(records)
    if beyond_rows:
        tables.append(Table("Beyond greedy", beyond_rows, beyond_cols, BEYOND_INDEX))
        notes.append("Beyond greedy: p_z = the probability that a decoding scheme emits the exact "
                     "suffix (one teacher-forced forward); (n, p) = the share of documents n samples give "
                     f"up with probability >= p; 'p_z >= {PZ_FLOOR:g}': the share whose suffix the scheme "
                     "emits at least once in a thousand draws (memorization greedy decoding may not show).")
    near = near_table([{"name": r["name"] + f" ({part})", "near_verbatim": v}
                       for r in records for part, v in r["near_verbatim"].items()])
    if near is not None:
        tables.append(near)
        notes.append("Near-verbatim (base.eval.near_verbatim): a lower bound of the probability that one "
                     f"sample lies within d {change_words(b.eval.nv_distance)[1]} of the suffix "
                     "(evals/near_verbatim.py).")
    paired_tables, tests, paired_notes = paired(cfg, arms, answers or {})
    tables += paired_tables
    notes += paired_notes
    plots = [_plot(arms, baseline, cfg, out / "forgetting.png")]
    return Outputs(title="Forgetting: what a fine-tune memorized, after training goes on without it",
                   kind=cfg.kind, runs=arms, tables=tables, notes=notes, plots=plots,
                   extra={"arms": arms, "baseline": baseline, "continue_passes": cfg.continue_passes,
                          "fresh": {"corpus": f.corpus, "rows": n_fresh}, "paired_tests": tests})


def _np_series(passes: list[dict[str, Any]]) -> list[tuple[str, list[float | None]]]:
    """Per decoding scheme, the (n, p)-extractable share of the leads seen once at the largest n, one
    value per pass ([] when the run measured nothing beyond greedy)."""
    at = [(p.get("sampled") or {}).get("seen_once") for p in passes]
    if not all(at):
        return []
    n, prob = at[0]["np"]["ns"][-1], at[0]["np"]["p"]
    return [(f"(n={n}, p={prob}) {scheme}", [x["np"]["schemes"][scheme][f"n={n}"]["fraction"] for x in at])
            for scheme in at[0]["np"]["schemes"] if scheme != "greedy"]  # greedy: the EM line


def _plot(arms: list[dict[str, Any]], baseline: dict[str, Any] | None, cfg: Config, path: Path) -> Path:
    """Against continued passes: canary exposure per copy count, duplicated-lead EM, MIA AUC, losses."""
    fig, axes = figure(4, width=4.4)
    method = cfg.mia_methods[0]
    many, _ = item_words(cfg)
    colors = [f"C{i}" for i in range(10)]
    styles = ["-", "--", ":", "-."]
    for i, a in enumerate(arms):
        xs = [p["pass"] for p in a["passes"]]
        color = colors[i % len(colors)]
        for j, n in enumerate(cfg.counts):
            axes[0].plot(xs, [p["by_copy_count"][str(n)]["canary_exposure"] for p in a["passes"]], marker="o",
                         color=color, linestyle=styles[j % len(styles)], label=f"{a['name']}, {n} copies")
        axes[1].plot(xs, [p["extraction"]["seen_once"]["exact_match_rate"] for p in a["passes"]], marker="o",
                     color=color, label=f"{a['name']}: greedy")
        for j, (scheme, ns) in enumerate(_np_series(a["passes"])):  # beyond greedy: memorization greedy hides
            axes[1].plot(xs, ns, marker=".", color=color, linestyle=styles[1 + j % 3],
                         label=f"{a['name']}: {scheme}")
        auc = [(p["mia"].get(method) or {}) for p in a["passes"]]
        axes[2].plot(xs, [r.get("auc") for r in auc], marker="o", color=color, label=a["name"])
        if all(r.get("auc_ci") for r in auc):
            axes[2].fill_between(xs, [r["auc_ci"][0] for r in auc], [r["auc_ci"][1] for r in auc],
                                 color=color, alpha=0.15)
        axes[3].plot(xs, [p["utility"]["val_loss"] for p in a["passes"]], marker="o", color=color,
                     label=f"{a['name']}: held-out {many}")
        if a["passes"][0]["utility"]["other_val_loss"] is not None:
            axes[3].plot(xs, [p["utility"]["other_val_loss"] for p in a["passes"]], marker="s", color=color,
                         linestyle="--", label=f"{a['name']}: {cfg.other_held_out}")
    if baseline:
        axes[0].axhline(baseline["canaries"]["exposure_mean"], color="gray", linestyle=":",
                        label=f"{BASELINE_ROW} (all canaries)")
        auc = (baseline["mia"].get(method) or {}).get("auc")
        if auc is not None:
            axes[2].axhline(auc, color="gray", linestyle=":", label=BASELINE_ROW)
        axes[3].axhline(baseline["utility"]["val_loss"], color="gray", linestyle=":",
                        label=f"{BASELINE_ROW}: held-out {many}")
    titles = ("canary exposure (bits)", f"{many} seen once: extractable", f"MIA AUC ({method})",
              "held-out loss")
    for ax, title in zip(axes, titles):
        ax.set(xlabel="passes of continued training on fresh data", title=title)
        ax.legend(fontsize=6)
    axes[1].set_ylim(-0.02, 1.02)
    return save(fig, path)


__all__ = ["Config", "FreshData", "continued_config", "run"]
