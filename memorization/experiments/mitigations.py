"""mitigations: goldfish vs DP-SGD vs LoRA vs deduplication on the same fine-tune, one report.

A pretrained model (SmolLM2-135M by default) is fine-tuned on one half of a corpus into which
canaries (secrets from a known space) and duplicated documents were injected at several copy
counts (canary-exposure's injection, with its manifest). Every arm trains on that corpus for the
same number of passes with one mitigation switched on through ordinary run-config overrides (an
arm is data, not code), or on the deduplicated corpus. Then every arm is asked:
  verbatim extraction  greedy suffix from the prefix: on the leads seen once and on the duplicated ones
  secrets              canary exposure and extraction over the secret space, by copy count
  membership           MIA (loss, zlib, min-k++, ref_ratio vs the base model) on the leads seen once
                       vs the held-out half, AUC and TPR@1%FPR with bootstrap CIs
  utility              held-out loss on the non-member half and on another domain; downstream accuracy
                       (lm-eval tasks, `downstream`) beside the un-fine-tuned base model's
  cost                 step time vs the unmitigated arm, peak RSS while training, trainable parameters
The base model itself, before fine-tuning, is asked the same questions (`baseline`): the report's first
row, what every arm's figures are read against (a secret or a lead it already reproduces was not
learnt from this corpus).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from data_pipelines import DedupConfig, tokenize_documents
from evals import extract, extract_pairs, summarize
from evals.near_verbatim import near_verbatim, near_verbatim_pairs
from evals.probabilistic import sampled_extraction, sampled_pairs, split_rows
from memorization.config import RunConfig, change_words
from memorization.eval.exposure import CANARY_SCORES
from memorization.experiments.beyond_greedy import NP_NOTE, near_table, np_plot
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
    split_pairs,
)
from memorization.experiments.pretrained import require_pretrained_split
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
from memorization.experiments.reporting import Outputs, Point, Shown, Table, bar_panels, scatter_panels
from memorization.experiments.runner import Experiment, PeakRSS, digest, load_documents, say
from memorization.experiments.scoring import SAMPLE_COLUMNS, extraction_samples
from memorization.experiments.spec import Arm, with_overrides
from memorization.outputs import check_name
from memorization.paired import Question, mia_questions, paired_table, per_document
from memorization.train.pipeline import run_training
from memorization.train.prepare import (
    PreparedData,
    check_chat_dedup,
    is_chat_data,
    prepare_deduplicated,
    prepare_deduplicated_chat,
)
from memorization.train.run_plan import run_schemes
from memorize_core import fail


def _default_arms() -> list[Arm]:
    # The full comparison (DP-SGD, LoRA, dedup, ...) is configs/experiments/mitigations.yaml: arms are data.
    return [Arm("none", "none"), Arm("goldfish", "goldfish", ["goldfish.enabled=true"])]


@dataclass
class Config(InjectionConfig, MiaSettings):
    """The injected corpus, the arms, and how long every arm trains."""

    passes: int = 3
    arms: list[Arm] = field(default_factory=_default_arms)
    baseline: bool = True  # ask the base model the same questions before fine-tuning: the first row
    dedup: DedupConfig = field(default_factory=lambda: DedupConfig(enabled=True))

    def validate(self, prefix: str = "") -> None:
        """Injection and MIA checks, a pretrained base with a same-distribution split, valid arms."""
        super().validate(prefix)
        self.check()
        if self.passes < 1:
            raise fail("passes", self.passes, "must be >= 1")
        self.dedup.validate("dedup")
        if is_chat_data(self.base) and any(a.dedup for a in self.arms):
            check_chat_dedup(self.dedup, "dedup")
        require_pretrained_split(self.base)
        if not self.arms:
            raise fail("arms", self.arms, "give at least one arm, e.g. [{name: none, mitigation: none}]")
        names = [a.name for a in self.arms]
        for i, a in enumerate(self.arms):
            check_name(f"arms[{i}].name", a.name)  # it names its run folder, OUT/runs/NAME
            rc = arm_config(self, a, f"arms[{i}].overrides")  # every override parses into a valid run config
            if rc.data.dedup != self.base.data.dedup:  # the arms share one prepared corpus
                raise fail(f"arms[{i}].overrides", a.overrides, "data.dedup cannot differ per arm here: "
                           "the arms train on one prepared corpus; set dedup: true on the arm (and the "
                           "experiment's dedup settings) instead")
        if len(set(names)) != len(names):
            raise fail("arms", names, "arm names must be distinct")


def arm_config(cfg: Config, arm: Arm, where: str = "overrides") -> RunConfig:
    """The RunConfig of one arm: the base with the arm's overrides, `passes` epochs, our own evals."""
    base = replace(cfg.base, name=arm.name, data=replace(cfg.base.data, min_tokens=1),
                   trainer=replace(cfg.base.trainer, epochs=cfg.passes, max_steps=0),
                   eval=replace(cfg.base.eval, extraction=False))
    rc = with_overrides(base, arm.overrides, where)
    if rc.goldfish.enabled:
        rc = replace(rc, goldfish=replace(rc.goldfish, token_budget=False))
    return rc


def run_configs(cfg: Config) -> list[RunConfig]:
    """Every arm's RunConfig, in training order (memorization.train.run_plan checks them all first)."""
    return [arm_config(cfg, arm) for arm in cfg.arms]


def run_data(cfg: Config) -> list[PreparedData]:
    """Each arm's training rows as `run` prepares them (the injected corpus, or its deduplicated copy),
    writing nothing: what a dry run counts for DP-SGD's row checks."""
    data, _, _, injected_docs = build_corpus(cfg, None)
    dedup = _deduplicated(cfg, data, injected_docs)[0] if any(a.dedup for a in cfg.arms) else None
    return [dedup if a.dedup else data for a in cfg.arms]


def _deduplicated(cfg: Config, data: PreparedData, injected_docs: list) -> tuple[PreparedData, Any]:
    """The injected corpus after deduplication, and the dedup manifest (saved as OUT/dedup.json by
    the caller once every arm passed its checks)."""
    if data.is_chat:  # whole conversations removed
        return prepare_deduplicated_chat(cfg.base, data, injected_docs, cfg.dedup)
    return prepare_deduplicated(data, injected_docs, cfg.dedup, cfg.base.data.block_len)


def lead_ids(data: PreparedData, manifest: Any) -> list[str]:
    """The ids of the corpus documents trained on once (the injected copies and the audit's canaries left
    out), in training order: the members of every membership question."""
    injected = {cid for it in manifest.items for cid in it.copy_ids}
    return [i for i in data.train_doc_ids if i not in injected and not str(i).startswith("audit-")]


def members_and_nonmembers(cfg: InjectionConfig, data: PreparedData, manifest: Any) -> tuple[list, list]:
    """(the corpus documents trained on once, `lead_ids`' tokens; the held-out documents cut and filtered
    like them): the two sides every membership question reads."""
    b = cfg.base
    leads = set(lead_ids(data, manifest))
    members = [t for i, t in zip(data.train_doc_ids, data.train_docs) if i in leads]
    _, held, _ = load_documents(b)
    nonmembers = list(tokenize_documents(held, data.tokenizer, max_tokens=b.data.block_len,
                                         min_tokens=min(b.data.min_tokens, b.data.block_len)))
    return members, nonmembers


class Sides(NamedTuple):
    """What the membership and extraction questions read: the members (the corpus items trained on once)
    and non-members (held out) as token lists; on chat data each one's first scored token (its answer
    after the prompt: evals.mia.score_sequences' starts) and the members' (prompts, responses), what
    extraction asks (None on plain documents: prefix -> suffix)."""

    members: list[list[int]]
    nonmembers: list[list[int]]
    starts: tuple[list[int], list[int]] | None = None
    pairs: tuple[list[list[int]], list[list[int]]] | None = None


def question_sides(cfg: InjectionConfig, data: PreparedData, manifest: Any) -> Sides:
    """The members and non-members of `members_and_nonmembers`; on chat data the conversations trained on
    once and the held-out ones (PreparedData.held_out_docs: rendered as the rows are), scored on their
    answers."""
    if not data.is_chat:
        return Sides(*members_and_nonmembers(cfg, data, manifest))
    once = set(lead_ids(data, manifest))
    rows = [j for j, i in enumerate(data.train_doc_ids) if i in once]
    return Sides([data.train_docs[j] for j in rows], data.held_out_docs or [],
                 ([len(data.prompts[j]) for j in rows], data.held_out_starts or []),
                 ([data.prompts[j] for j in rows], [data.responses[j] for j in rows]))


class ArmQuestions:
    """The questions every model of a fine-tune with injected items is asked (verbatim extraction of
    the leads seen once, the secrets, beyond greedy and near-verbatim, membership and utility), on
    every rank, on the model's own grid; `key` is what the answers depend on besides the model."""

    def __init__(self, cfg: Config, data: PreparedData, manifest: Any, dup_tokens: dict[str, list[int]],
                 members: list[list[int]], questions: PrivacyUtility,
                 pairs: tuple[list[list[int]], list[list[int]]] | None = None):
        """`pairs`: chat data's members as (prompts, responses) (Sides.pairs): extraction is the greedy
        response from each prompt, beyond greedy and near-verbatim each response from its whole prompt
        (evals.probabilistic.sampled_pairs, evals.near_verbatim.near_verbatim_pairs)."""
        self.cfg, self.data, self.manifest, self.dup_tokens = cfg, data, manifest, dup_tokens
        self.members, self.questions, self.pairs = members, questions, pairs
        self.dup_docs = list(dup_tokens.values())
        b = cfg.base
        self.schemes = run_schemes(b)
        self.key = {"mia": cfg.mia_methods, "k": cfg.mia_k, "bootstrap": cfg.bootstrap, **b.eval.near_key(),
                    "schemes": b.eval.sampling, "np": [b.eval.np_ns, b.eval.np_p],
                    "candidates": cfg.canaries.candidates,
                    "other": [cfg.other_held_out, cfg.other_held_out_limit],
                    "downstream": [cfg.downstream, cfg.downstream_limit, cfg.downstream_fewshot],
                    "per_document": 1,  # what paired tests read (answers cached without it: asked again)
                    "canary_scores": CANARY_SCORES}
        if pairs:  # chat data's questions: 2 = beyond greedy from each prompt, 3 = near-verbatim too
            self.key["chat"] = 3 if b.eval.near_verbatim else 2

    def __call__(self, model: Any, downstream: bool = True) -> dict[str, Any]:
        """Every answer of `model` (the downstream tasks too when asked and the experiment names some)."""
        b, data = self.cfg.base, self.data
        e = b.eval
        members, dup_docs, schemes = self.members, self.dup_docs, self.schemes
        if self.pairs:  # chat data: each conversation's answer from its prompt
            results = extract_pairs(model, *self.pairs, tokenizer=data.tokenizer, batch_size=e.batch_size)
            asked = {"seen_once": self.pairs, "duplicated": split_pairs(dup_docs)}
            beyond = {name: beyond_summary(sampled_pairs(model, *pairs, schemes=schemes, ns=e.np_ns, p=e.np_p,
                                                         batch_size=e.batch_size))
                      for name, pairs in asked.items() if schemes and pairs[0]}
            near = {name: split_rows(near_verbatim_pairs(model, *pairs, schemes=schemes,
                                                         **e.near_args(window=False)))[0]
                    for name, pairs in asked.items() if e.near_verbatim and schemes and pairs[0]}
        else:
            results = extract(model, members, prefix_len=e.prefix, suffix_len=e.suffix,
                              tokenizer=data.tokenizer, batch_size=e.batch_size, decode=e.decode)
            parts = (("seen_once", members), ("duplicated", dup_docs))
            beyond = {name: beyond_summary(sampled_extraction(
                          model, docs, prefix_len=e.prefix, suffix_len=e.suffix, schemes=schemes, offsets=[0],
                          ns=e.np_ns, p=e.np_p, batch_size=e.batch_size))
                      for name, docs in parts if schemes and docs}
            # base.eval.near_verbatim: the bound of a sample within d changes (eval.nv_distance), beside p_z
            near = {name: split_rows(near_verbatim(model, docs, schemes=schemes, **e.near_args()))[0]
                    for name, docs in parts if e.near_verbatim and schemes and docs}
        seen_once = summarize(results)
        answers = self.questions(model, downstream=downstream, per_document=True)
        answers["per_document"].update(seen_once_exact_match=[float(r.exact_match) for r in results],
                                       seen_once_rougeL=[r.rougeL for r in results])
        return {"seen_once": {k: seen_once[k] for k in ("docs", "exact_match_rate", "rougeL")},
                "injected": score_injected(model, self.cfg, data.tokenizer, self.manifest, self.dup_tokens),
                "sampled": beyond, "near_verbatim": near, **answers}

    def baseline(self, exp: Experiment, reference: Any) -> dict[str, Any]:
        """The answers of the base model (`reference`, the weights every run starts from), cached in
        OUT/baseline under the model, a digest of every evaluated input and `key`."""
        b, q = self.cfg.base, self.questions
        inputs = {"members": self.members, "nonmembers": q.sets["nonmembers"], "duplicated": self.dup_docs,
                  "other": q.other, **({"starts": q.starts, "pairs": self.pairs} if self.pairs else {}),
                  "injected": [[it.id, it.text, it.count, it.secret] for it in self.manifest.items]}
        return exp.baseline({"model": b.model.name, "overrides": b.model.overrides, "seed": b.seed,
                             "inputs": digest(inputs), "eval": self.key, "prefix": b.eval.prefix,
                             "suffix": b.eval.suffix}, lambda r=reference: r, lambda model, _d: self(model))


def run(cfg: Config, exp: Experiment) -> Outputs | None:
    """Train every arm on the injected corpus (or its deduplicated copy); ask each the five questions."""
    data, manifest, dup_tokens, injected_docs = build_corpus(cfg, exp)
    b = cfg.base
    sides = question_sides(cfg, data, manifest)
    members, nonmembers = sides.members, sides.nonmembers
    dedup_data = dedup_manifest = None
    if any(a.dedup for a in cfg.arms):
        dedup_data, dedup_manifest = _deduplicated(cfg, data, injected_docs)
        say(f"dedup: {len(injected_docs)} -> {len(dedup_data.train_docs)} documents "
            f"({dedup_manifest.counts})")
    # every arm on the rows it trains on (DP-SGD's delta < 1/N, ...) before anything is written
    exp.check(run_configs(cfg), [dedup_data if a.dedup else data for a in cfg.arms])
    save_manifest(manifest, exp)
    if dedup_manifest is not None and exp.is_main:
        dedup_manifest.save(exp.out / "dedup.json", overwrite=True)
    # every rank asks the questions: each arm's model is scored on its run's grid (Experiment.eval_model)
    reference = reference_model(b, exp.grid_spec)
    questions = PrivacyUtility(cfg, data.tokenizer, members, nonmembers,
                               other_domain(cfg, data.tokenizer, b.data.block_len), reference, seed=b.seed,
                               starts=sides.starts)
    ask = ArmQuestions(cfg, data, manifest, dup_tokens, members, questions, sides.pairs)
    key = cfg.injection_key()

    def evaluate(model: Any, run_dir: Path) -> dict[str, Any]:
        return ask(model)

    baseline = None
    answers: dict[str, Any] = {}  # every row's answers, for the per-document paired tests
    if cfg.baseline:  # the model every arm starts from, asked the same questions (cached in OUT/baseline)
        say("base model: its evaluation before fine-tuning")
        values = ask.baseline(exp, reference)
        baseline = baseline_record(values, cfg.counts)
        base_downstream = values.get("downstream")
        answers[BASELINE_ROW] = _without_ref_ratio(values)
    else:
        base_downstream = questions.downstream(reference)  # what fine-tuning starts from (None: no tasks)
    del reference

    arms, samples = [], []
    for arm in cfg.arms:
        rc = arm_config(cfg, arm)
        arm_data = dedup_data if arm.dedup else data

        def train(rc: RunConfig, run_dir: Path, arm_data: PreparedData = arm_data) -> dict[str, Any]:
            with PeakRSS() as peak:
                summary = run_training(rc, run_dir, overwrite=True, grid_spec=exp.grid_spec, data=arm_data,
                                       progress=rc.trainer.progress)
            if exp.is_main:  # one writer: another rank rewriting run.json raced the main rank's read
                _annotate(run_dir, {"peak_rss_bytes": peak.peak})
            return summary

        extra = {**key, "dedup": cfg.dedup.key() if arm.dedup else None}
        summary = exp.run(rc, arm_data, train=train, evaluate=evaluate, extra_key=extra,
                          eval_key=ask.key, per_run_wandb=cfg.per_run_wandb)
        if not exp.is_main:
            continue
        arms.append(arm_record(arm, summary, cfg.counts))
        answers[arm.name] = summary
        samples += extraction_samples(arm.name, exp.run_dir(arm.name), data.tokenizer, min(cfg.samples, 2))
    if not exp.is_main:
        return None
    _relative_cost(arms)
    return _outputs(cfg, arms, len(members), len(nonmembers), len(data.train_docs),
                    len(dedup_data.train_docs) if dedup_data else None, exp.out, samples, base_downstream,
                    baseline, answers)


REFERENCE = "none"  # replicates' paired differences: each arm against the unmitigated fine-tune
BASELINE_ROW = "base model"  # the un-fine-tuned row (arm names are folder names: no spaces, no clash)
PZ_FLOOR = 1e-3  # "hidden" memorization: a suffix some scheme emits at least once in a thousand draws


def _without_ref_ratio(values: dict[str, Any]) -> dict[str, Any]:
    """The base model's answers without its per-document ref_ratio scores (against itself: 0 for every
    document), as baseline_record drops its AUC."""
    per = values.get("per_document")
    if not per:
        return values
    sides = ("members", "nonmembers")
    per = {k: ({m: v for m, v in side.items() if m != "ref_ratio"} if k in sides else side)
           for k, side in per.items()}
    return {**values, "per_document": per}


def paired_questions(methods: list[str], items: tuple[str, str] = ("leads", "lead")) -> list[Question]:
    """What the paired tests compare between two models of the comparison (docs/mitigations.md); `items`
    names the corpus items (plural, singular: `item_words`)."""
    many, one = items
    return [Question("em_once", f"EM {many} seen once", "binary", per_document("seen_once_exact_match"),
                     "{:+.0%}"),
            Question("rouge_once", f"ROUGE-L {many} seen once", "number", per_document("seen_once_rougeL")),
            *injected_questions(many),
            Question("nll", f"held-out NLL per {one}", "number", per_document("nonmember_nll")),
            *mia_questions(methods)]


def beyond_summary(result: dict[str, Any]) -> dict[str, Any]:
    """The (n, p) summary at offset 0 and, per scheme, the share of documents with p_z >= PZ_FLOOR."""
    at = result["offsets"]["0"]
    floor = math.log(PZ_FLOOR)
    share = {}
    for name in ["greedy", *result["schemes"]]:
        vals = [r["logpz"][name] for r in at["rows"]]
        share[name] = sum(v is not None and v >= floor for v in vals) / len(vals) if vals else None
    return {"docs": at["docs"], "np": at["np"], "pz_at_least_1e-3": share}


def _annotate(run_dir: Path, values: dict[str, Any]) -> None:
    """Add values to a finished run's run.json summary; call on the main rank only (one writer).

    Written to a side file and renamed over run.json, so a reader never sees it half written.
    """
    path = run_dir / "run.json"
    if path.is_file():
        payload = json.loads(path.read_text())
        payload["summary"].update(values)
        tmp = path.with_name("run.json.tmp")
        tmp.write_text(json.dumps(payload, indent=2))
        os.replace(tmp, path)


MASKED_NOTE = SPLIT_NOTE + (" An arm that overrides goldfish's k, h or strategy is still grouped by "
                            "base.goldfish.")


def splits_by_mask(cfg: Config) -> bool:
    """Whether the by-count tables split the canaries by the goldfish mask: some arm trains with the goldfish
    loss, and base.goldfish's mask is the same in every copy (injection.secret_mask)."""
    if secret_mask(cfg.base) is None:
        return False
    return any(arm_config(cfg, a).goldfish.enabled for a in cfg.arms)


def arm_record(arm: Arm, s: dict[str, Any], counts: list[int]) -> dict[str, Any]:
    """One arm's numbers (or the base model's: no training, no cost) under the stable keys documented in
    docs/mitigations.md."""
    inj = s["injected"]
    dups, canaries = inj["duplicates"], inj["canaries"]
    by_count = {}
    for n in counts:
        cs = [c for c in canaries if c["count"] == n]
        ds = [d for d in dups if d["count"] == n]
        by_count[str(n)] = {"canary_exposure": _mean([c["exposure"] for c in cs]),
                            "canary_extracted": _mean([float(c["extracted"]) for c in cs]),
                            "duplicate_exact_match": _mean([float(d["exact_match"]) for d in ds]),
                            **masked_split(cs)}
    steps = s.get("steps") or 0
    return {
        "name": arm.name, "mitigation": arm.mitigation, "overrides": list(arm.overrides), "dedup": arm.dedup,
        "extraction": {"seen_once": s["seen_once"],
                       "duplicated": {"docs": len(dups),
                                      "exact_match_rate": _mean([float(d["exact_match"]) for d in dups]),
                                      "rougeL": _mean([d["rougeL"] for d in dups])}},
        "canaries": {"count": len(canaries), "exposure_mean": _mean([c["exposure"] for c in canaries]),
                     "extracted_rate": _mean([float(c["extracted"]) for c in canaries]),
                     "max_exposure": inj["max_exposure"]},
        "by_copy_count": by_count,
        "mia": s["mia"],
        "utility": {"val_loss": s["val_loss"], "other_val_loss": s["other_val_loss"],
                    "downstream": s.get("downstream")},
        "privacy": {"epsilon": s.get("epsilon"), "delta": s.get("delta")},
        "audit": s.get("audit"),
        "sampled": s.get("sampled") or {},
        "near_verbatim": s.get("near_verbatim") or {},
        "cost": {"steps": steps, "train_seconds": s.get("train_seconds"),
                 "step_seconds": (s.get("train_seconds") or 0) / steps if steps else None,
                 "peak_rss_gb": (s.get("peak_rss_bytes") or 0) / 2**30 or None,
                 "trainable_params": s.get("trainable_params", s.get("params")),
                 "step_time_vs_none": None},  # _relative_cost, among the trained arms
        "reused": s.get("reused", False),
    }


def baseline_record(values: dict[str, Any], counts: list[int]) -> dict[str, Any]:
    """The base model's answers (ArmQuestions.baseline) as a row of the tables, named BASELINE_ROW."""
    record = arm_record(Arm(BASELINE_ROW, "not fine-tuned"), values, counts)
    record["mia"].pop("ref_ratio", None)  # against itself: 0 for every row, chance by construction
    return record


def _relative_cost(arms: list[dict[str, Any]]) -> None:
    """cost.step_time_vs_none: each arm's step time over the unmitigated arm's (None without one)."""
    ref = next((a["cost"]["step_seconds"] for a in arms if a["mitigation"] == "none"), None)
    for a in arms:
        st = a["cost"]["step_seconds"]
        a["cost"]["step_time_vs_none"] = st / ref if ref and st else None


BEYOND_INDEX = ("arm", "part", "scheme")  # which row of beyond_table is which (not its document count)


def beyond_table(arms: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], tuple]:
    """One row per (arm, documents, scheme): (n, p) fractions and the share with p_z >= PZ_FLOOR."""
    rows, ns, p = [], [], None
    for a in arms:
        for part, v in a["sampled"].items():
            ns, p = v["np"]["ns"], v["np"]["p"]
            for scheme, per in v["np"]["schemes"].items():
                rows.append({"arm": a["name"], "part": part, "docs": f"{part} ({v['docs']})",
                             "scheme": scheme,
                             "pz": v["pz_at_least_1e-3"].get(scheme),
                             **{f"n{n}": per[f"n={n}"]["fraction"] for n in ns}})
    cols = [("arm", "arm", "{}"), ("docs", "documents", "{}"), ("scheme", "decoding", "{}")]
    cols += [(f"n{n}", f"(n={n}, p={p})", "{:.0%}") for n in ns] + [("pz", f"p_z >= {PZ_FLOOR:g}", "{:.0%}")]
    return rows, tuple(cols)


def _audit_cell(audit: dict[str, Any] | None) -> Shown | str:
    """The audit's epsilon lower bound as a table cell: 'bound (correct/guesses)', flagged above nominal."""
    if not audit:
        return ""
    flag = " ABOVE NOMINAL" if audit["above_nominal"] else ""
    return Shown(f"{audit['eps_lower_bound']:.2f} ({audit['correct']}/{audit['guesses']}){flag}",
                 audit["eps_lower_bound"])


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def _outputs(cfg: Config, arms: list[dict[str, Any]], n_members: int, n_nonmembers: int, n_rows: int,
             n_dedup: int | None, out: Path, samples: list[list[Any]],
             base_downstream: dict[str, Any] | None = None,
             baseline: dict[str, Any] | None = None,
             answers: dict[str, Any] | None = None) -> Outputs:
    methods = cfg.mia_methods
    many, one = item_words(cfg)
    trained, arms = arms, ([baseline] if baseline else []) + arms  # the tables and plots lead with the base
    rows = []
    for a in arms:
        row = {"arm": a["name"], "mitigation": a["mitigation"],
               "em_once": a["extraction"]["seen_once"]["exact_match_rate"],
               "em_dup": a["extraction"]["duplicated"]["exact_match_rate"],
               "exposure": a["canaries"]["exposure_mean"], "extracted": a["canaries"]["extracted_rate"],
               "val": a["utility"]["val_loss"], "other": a["utility"]["other_val_loss"],
               "time": a["cost"]["step_time_vs_none"], "rss": a["cost"]["peak_rss_gb"],
               "trainable": a["cost"]["trainable_params"], "eps": a["privacy"]["epsilon"],
               "eps_lb": _audit_cell(a.get("audit")),
               "ds": format_acc(a["utility"].get("downstream"))}
        for m in methods:
            row[f"auc_{m}"] = format_auc(a["mia"].get(m))
        rows.append(row)
    cols = [("arm", "arm", "{}"), ("mitigation", "mitigation", "{}"),
            ("em_once", f"EM {many} seen once", "{:.0%}"),
            ("em_dup", f"EM duplicated {many}", "{:.0%}"), ("exposure", "canary exposure (bits)", "{:.2f}"),
            ("extracted", "secrets extracted", "{:.0%}")]
    cols += [(f"auc_{m}", f"MIA AUC {m} [95% CI]", "{}") for m in methods]
    cols += [("val", "val loss", "{:.3f}")] + ([("other", f"{cfg.other_held_out} loss", "{:.3f}")]
                                               if cfg.other_held_out else [])
    if cfg.downstream:
        cols += [("ds", f"{task_label(cfg)} ± SE", "{}")]
    cols += [
             ("time", "step time x", "{:.2f}"), ("rss", "peak RSS GiB", "{:.1f}"),
             ("trainable", "trainable params", "{:,}"), ("eps", "epsilon", "{:.2f}")]
    if any(a.get("audit") for a in arms):
        cols += [("eps_lb", "audit epsilon >= (95%)", "{}")]
    by_count = [{"arm": a["name"], "copies": int(n), **v}
                for a in arms for n, v in a["by_copy_count"].items()]
    ccols = [("arm", "arm", "{}"), ("copies", "copies", "{}"),
             ("canary_exposure", "canary exposure", "{:.2f}"),
             ("canary_extracted", "secrets extracted", "{:.0%}"),
             ("duplicate_exact_match", f"duplicated-{one} EM", "{:.0%}")]
    if splits_by_mask(cfg):
        ccols += MASKED_COLUMNS
    b = cfg.base
    c = cfg.canaries
    chat = is_chat_data(b)
    notes = [
        f"Model: {b.model.name}, its own tokenizer. Training rows: {n_rows} "
        f"({n_members} {b.data.corpus} {many} seen "
        f"once, plus {cfg.duplicates.per_count} duplicated {many} and {c.per_count} canaries per copy count "
        f"{cfg.counts}); {cfg.passes} passes, lr {b.trainer.lr} (arms may override it), batch "
        f"{b.trainer.batch_size}. Non-members: {n_nonmembers} held-out {many}.",
        f"Canaries: {c.template!r} with a secret from {c.space}"
        + (f", each the answer to the user turn {c.prompt!r}" if chat else "")
        + "; exposure in bits over the whole space "
        "(maximum log2|R|); 'secrets extracted' = the canary beats every never-inserted secret.",
        (f"EM: the greedy answer (its first {b.eval.suffix} tokens) from the conversation's prompt, in the "
         "chat template. MIA scores each conversation's answer given its prompt (the tokens the fine-tune "
         "trains on), on the conversations seen once vs the held-out ones; the held-out loss is over those "
         "answers. " if chat else
         f"EM: greedy {b.eval.suffix}-token suffix from the {b.eval.prefix}-token prefix. "
         "MIA on the leads seen once vs the held-out leads; ")
        + f"95% CIs from {cfg.bootstrap} bootstrap resamples.",
        f"Dedup: {cfg.dedup.describe()}"
        + (f" ({n_rows} -> {n_dedup} rows; manifest dedup.json)." if n_dedup else "."),
        "Cost: step time relative to the 'none' arm measured in this run; peak RSS of the whole process "
        "while the arm trained; trainable parameters (LoRA: adapters only).",
    ]
    if splits_by_mask(cfg):
        notes.append(f"By copy count: {MASKED_NOTE}")
    audited = [a for a in arms if a.get("audit")]
    if audited:
        au = audited[0]["audit"]
        notes.append(
            f"Audit (one training run, Steinke et al. 2023): {au['m']} random-word canaries, each trained on "
            f"with probability 1/2 ({au['included']} were); score = minus the canary's mean token loss; "
            f"guesses on the highest and lowest scores, over a pre-registered list of guess counts with "
            f"Bonferroni correction; 'audit epsilon >=' is the lower bound at {au['confidence']:.0%} "
            "(a lower bound: it can show a run leaks more than its epsilon, never certify that it does not).")
        over = [a["name"] for a in audited if a["audit"]["above_nominal"]]
        notes.append("WARNING: the audit bound exceeds the accountant's epsilon for " + ", ".join(over)
                     + ": the DP-SGD implementation or its accounting is wrong." if over else
                     "No DP arm's audit bound exceeds its accountant's epsilon.")
    if baseline:
        notes.append(f"'{BASELINE_ROW}': the pretrained weights before fine-tuning, asked the same questions "
                     "(OUT/baseline/evals.json): a lead or secret it already reproduces, or a membership "
                     "signal it already shows, was not learnt from this corpus (no ref_ratio: its reference "
                     "is itself).")
    if cfg.downstream:
        notes.append(f"Downstream: accuracy ± standard error (lm-eval) on {', '.join(cfg.downstream)} "
                     f"({limit_words(cfg)}); the un-fine-tuned base model scores "
                     f"{format_acc(base_downstream) or 'n/a'}.")
    plots = [_plot_scatter(arms, out / "mitigations-tradeoff.png"),
             _plot_bars(arms, methods, out / "mitigations-bars.png")]
    beyond_rows, beyond_cols = beyond_table(arms)
    extra_tables = [Table("Beyond greedy", beyond_rows, beyond_cols, BEYOND_INDEX)] if beyond_rows else []
    if beyond_rows:
        np_note = NP_NOTE.format(passes=cfg.passes)
        if chat:  # no offsets: each answer from its whole prompt
            np_note = (np_note[:np_note.index(" Offsets:")] + " On chat data the suffix is each answer's "
                       f"first {b.eval.suffix} tokens, from its whole prompt.")
        notes.append(np_note + f" 'p_z >= {PZ_FLOOR:g}': the share of documents "
                     "whose suffix the scheme emits at least once in a thousand draws.")
        as_runs = [{"name": f"{a['name']} ({part})", "sampled": {"offsets": {"0": v}}}
                   for a in arms for part, v in a["sampled"].items()]
        plot = np_plot(as_runs, out / "mitigations-np.png")
        plots += [plot] if plot else []
    near = near_table([{"name": f"{a['name']} ({part})", "near_verbatim": v}
                       for a in arms for part, v in a["near_verbatim"].items()])
    if near is not None:
        extra_tables.append(near)
        notes.append("Near-verbatim (base.eval.near_verbatim): a lower bound of the probability that one "
                     f"sample lies within d {change_words(cfg.base.eval.nv_distance)[1]} of the suffix "
                     "(d = 0: the exact copy), from a beam search kept inside that neighbourhood "
                     "(evals/near_verbatim.py); a fraction counts the "
                     "documents whose bound alone passes the (n, p) test.")
    reference = next((a["name"] for a in trained if a["name"] == REFERENCE), None) or \
        next((a["name"] for a in trained if a["mitigation"] == "none"), trained[0]["name"] if trained else "")
    pairs = [(name, reference) for name in (answers or {}) if name != reference]
    paired, tests, paired_notes = paired_table(answers or {}, pairs, paired_questions(methods, (many, one)),
                                               resamples=cfg.bootstrap or 1000, seed=b.seed)
    extra_tables += [Table(**paired, per_seed=True)] if paired else []
    notes += paired_notes
    return Outputs(title="Which mitigation? Privacy, utility and cost on one fine-tune", kind=cfg.kind,
                   runs=trained,
                   tables=[Table("Arms", rows, tuple(cols)),
                           Table("By copy count", by_count, tuple(ccols), ("arm", "copies")), *extra_tables],
                   notes=notes, plots=plots, samples=samples, sample_columns=SAMPLE_COLUMNS,
                   extra={"arms": trained, "baseline": baseline, "passes": cfg.passes,
                          "base_downstream": base_downstream, "paired_tests": tests})


def _downstream_acc(a: dict[str, Any]) -> tuple[float | None, float | None]:
    head = (a["utility"].get("downstream") or {}).get("headline") or {}
    return head.get("acc"), head.get("acc_stderr")


def _plot_scatter(arms: list[dict[str, Any]], path: Path) -> Path:
    """Privacy (duplicated-lead exact match, MIA AUC) vs utility (held-out loss, and downstream accuracy
    with its standard error when the experiment scores tasks); marker area = step time."""
    utilities = [("val", "held-out loss (lower = more useful)")]
    if any(_downstream_acc(a)[0] is not None for a in arms):
        utilities.append(("acc", "downstream accuracy (higher = more useful)"))
    panels = []
    for ukey, ulabel in utilities:
        for key, label in (("em_dup", "exact match, duplicated leads"), ("auc", "MIA AUC (loss)")):
            points = []
            for a in arms:
                x = (a["extraction"]["duplicated"]["exact_match_rate"] if key == "em_dup"
                     else a["mia"].get("loss", {}).get("auc"))
                y, err = (a["utility"]["val_loss"], None) if ukey == "val" else _downstream_acc(a)
                points.append(Point(a["name"], x, y, err, 80 * (a["cost"]["step_time_vs_none"] or 1.0)))
            panels.append((f"{label} (lower = more private)", ulabel, points))
    return scatter_panels(panels, "privacy vs utility (marker: step time)", path)


def _plot_bars(arms: list[dict[str, Any]], methods: list[str], path: Path) -> Path:
    """One bar chart per metric across arms."""
    metrics = [("EM duplicated", lambda a: a["extraction"]["duplicated"]["exact_match_rate"]),
               ("canary exposure (bits)", lambda a: a["canaries"]["exposure_mean"]),
               ("MIA AUC (best method)", lambda a: max((v["auc"] for v in a["mia"].values()), default=None)),
               ("held-out loss", lambda a: a["utility"]["val_loss"]),
               ("downstream accuracy", lambda a: _downstream_acc(a)[0]),
               ("step time x", lambda a: a["cost"]["step_time_vs_none"])]
    return bar_panels([a["name"] for a in arms], [(t, [get(a) for a in arms]) for t, get in metrics], path)


__all__ = ["Arm", "Config", "arm_config", "run"]
