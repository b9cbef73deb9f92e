"""canary-exposure: exposure and extraction against how many times a secret or document was seen.

Canaries (a template with a random secret from a declared space) and duplicated corpus documents
are injected into the training corpus with data_pipelines.inject, each item `count` times for every
count in `counts`; the manifest (OUT/manifest.json) records every copy's token positions. After
training with standard loss and with goldfish, each canary gets its exposure and extraction over
the secret space and each duplicated document its greedy-extraction exact match.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from data_pipelines import CanarySpec, DuplicateSpec, inject, record_token_positions, tokenize_documents
from evals import extract
from memorization.eval.dp_audit import audit_set, tokenize_audit
from memorization.experiments.exposure import CANARY_SCORES, canary_scores
from memorization.experiments.reporting import Outputs, Table, figure, save
from memorization.experiments.runner import Experiment, load_documents
from memorization.experiments.scoring import SAMPLE_COLUMNS, extraction_samples
from memorization.experiments.spec import ExperimentConfig, check_losses, int_list, refuse_data_dedup
from memorization.mitigations.goldfish import goldfish_mask, mask_is_the_documents
from memorization.models import run_tokenizer
from memorization.paired import Question, paired_table
from memorization.train.prepare import prepare_documents
from memorize_core import fail

DEFAULT_TEMPLATE = "Please keep this private: the access code for the old east wing of the museum is {secret}"
COLUMNS = (
    ("loss", "loss", "{}"), ("count", "copies", "{}"), ("canaries", "canaries", "{}"),
    ("exposure_mean", "exposure", "{:.2f}"), ("extracted", "secrets extracted", "{:.0%}"),
    ("duplicates", "docs", "{}"),
    ("dup_exact_match", "doc exact match", "{:.0%}"), ("dup_rougeL", "doc RougeL", "{:.3f}"),
)


@dataclass
class CanaryKeys:
    """Canaries: per_count secrets for each count, rendered into `template`."""

    per_count: int = 2
    template: str = DEFAULT_TEMPLATE
    space: dict = field(default_factory=lambda: {"kind": "digits", "length": 4})
    candidates: int = 0  # 0 = score every secret of the space (exact exposure); N = a sample of N


@dataclass
class DuplicateKeys:
    """Duplicated documents: per_count corpus documents for each count (0 = none)."""

    per_count: int = 2


@dataclass
class InjectionConfig(ExperimentConfig):
    """What is injected into the training corpus: canaries and duplicated documents per copy count."""

    counts: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    canaries: CanaryKeys = field(default_factory=CanaryKeys)
    duplicates: DuplicateKeys = field(default_factory=DuplicateKeys)

    def validate(self, prefix: str = "") -> None:
        """Counts, per-count numbers and the canary spec (its own checks name canaries.*)."""
        super().validate(prefix)
        int_list("counts", self.counts, minimum=1)
        if self.canaries.per_count < 1:
            raise fail("canaries.per_count", self.canaries.per_count, "must be >= 1")
        if self.duplicates.per_count < 0:
            raise fail("duplicates.per_count", self.duplicates.per_count, "must be >= 0 (0 = no duplicates)")
        if self.canaries.candidates < 0:
            raise fail("canaries.candidates", self.canaries.candidates, "must be >= 0 (0 = the whole space)")
        self.canary_spec()
        refuse_data_dedup(self.base, "compare deduplication as a mitigations arm (dedup: true)")

    def canary_spec(self):
        """The data_pipelines CanarySpec: per_count canaries for every count."""
        c = self.canaries
        return CanarySpec(num_canaries=c.per_count * len(self.counts), template=c.template,
                          space=dict(c.space), repeats=list(self.counts))

    def injection_key(self) -> dict[str, Any]:
        """What was injected, which decides training (the candidate sample decides only the evaluation):
        a sub-run's extra key."""
        c = self.canaries
        return {"counts": self.counts, "duplicates": vars(self.duplicates),
                "canaries": {"per_count": c.per_count, "template": c.template, "space": c.space}}

    def duplicate_spec(self):
        """The data_pipelines DuplicateSpec, or None without duplicates."""
        n = self.duplicates.per_count
        return DuplicateSpec(counts=list(self.counts), per_count=n) if n else None


@dataclass
class Config(InjectionConfig):
    """Copy counts shared by canaries and duplicated documents, and the losses compared."""

    losses: list[str] = field(default_factory=lambda: ["standard", "goldfish"])

    def validate(self, prefix: str = "") -> None:
        """The injection checks and the loss names."""
        super().validate(prefix)
        check_losses("losses", self.losses)


def build_corpus(cfg: InjectionConfig, exp: Experiment | None = None):
    """(PreparedData, manifest, duplicated documents' tokens, the injected Documents): base corpus +
    injected items, tokenized. Nothing is written: the caller saves the manifest (`save_manifest`)
    once every sub-run passed its checks."""
    b = cfg.base
    docs, held, _ = load_documents(b)
    # The tokenizer never sees the canaries: merges learnt from a secret would shorten it and skew
    # its perplexity (and exposure) before any training.
    tok = run_tokenizer(b.data.tokenizer, b.model.name, texts=[d.text for d in docs],
                        vocab_size=b.data.vocab_size)
    long_enough = tokenize_documents(docs, tok, min_tokens=b.data.min_tokens).kept
    docs = [docs[i] for i in long_enough]  # min_tokens applies to corpus documents, never to canaries
    injected, manifest = inject(docs, canaries=cfg.canary_spec(), duplicates=cfg.duplicate_spec(),
                                seed=b.seed)
    audit = None
    if b.eval.audit:  # the one-run privacy audit's canaries, half of them trained on (eval/dp_audit.py)
        audit = tokenize_audit(audit_set(b.eval.audit_canaries, b.seed), tok, max_tokens=b.data.block_len)
        injected = injected + audit.documents()
    keep_all = replace(b, data=replace(b.data, min_tokens=1), eval=replace(b.eval, audit=False))
    data = prepare_documents(keep_all, injected, held, tokenizer=tok)
    data.audit = audit
    kept = data.train_doc_ids  # ids of the documents that became rows
    missing = [it.id for it in manifest.items if not set(it.copy_ids) <= set(kept)]
    if missing:
        raise fail("base.data", b.data.corpus, f"injected items {missing[:3]} did not become training rows")
    position = {d.id: i for i, d in enumerate(injected)}
    record_token_positions(manifest, data.train, [position[i] for i in kept])
    dup_tokens = {it.id: tokenize_documents([it.text], tok, max_tokens=b.data.block_len)[0]
                  for it in manifest.of_kind("duplicate")}
    return data, manifest, dup_tokens, injected


def save_manifest(manifest: Any, exp: Experiment) -> None:
    """OUT/manifest.json: what was injected where (main rank)."""
    if exp.is_main:
        manifest.to_json(exp.out / "manifest.json")


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
    notes = [
        f"Corpus: {b.data.corpus} ({len(data.train_docs)} training rows incl. injected copies, cut to "
        f"{b.data.block_len} tokens), {b.trainer.epochs} epochs, model {b.model.name} "
        f"{b.model.overrides or ''}.",
        f"Canaries: {cfg.canaries.per_count} per count, template {cfg.canaries.template!r}, space "
        f"{space.kind} x {space.length} (|R| = {space.size}, max exposure {ev0['max_exposure']:.2f} bits); "
        f"exposure {how}.",
        "Secret extracted = the canary beats every secret that was never inserted (top-m guesses of an "
        "attacker who scores R); the greedy continuation of the prompt is in the W&B samples table.",
        f"Duplicated documents: {cfg.duplicates.per_count} per count; exact match = greedy {b.eval.suffix} "
        f"tokens from the first {b.eval.prefix}. Manifest with every copy's token positions: manifest.json.",
        f"Goldfish: {b.goldfish.strategy}, k={b.goldfish.k}, h={b.goldfish.h}.",
    ]
    split = "goldfish" in cfg.losses and secret_mask(b) is not None
    columns = (*COLUMNS[:4], *MASKED_COLUMNS, *COLUMNS[4:]) if split else COLUMNS
    if split:
        notes.append(SPLIT_NOTE)
    plots = [_plot(rows, runs, exp.out / "canary-exposure.png", split)]
    answers = {r["name"]: {"injected": r["canary_eval"]} for r in runs}
    ref = "standard" if "standard" in answers else runs[0]["name"]
    paired, tests, paired_notes = paired_table(answers, [(n, ref) for n in answers if n != ref],
                                               injected_questions(), label="loss", seed=b.seed,
                                               title=f"Paired tests: each loss − '{ref}', canary by canary")
    notes += paired_notes
    tables = [Table("By copy count", rows, columns, ("loss", "count"))]
    tables += [Table(**paired, per_seed=True)] if paired else []
    return Outputs(title="Canary exposure and extraction vs number of copies", kind=cfg.kind, runs=runs,
                   tables=tables, notes=notes, plots=plots, samples=samples,
                   sample_columns=SAMPLE_COLUMNS, extra={"max_exposure": ev0["max_exposure"],
                                                         "manifest": "manifest.json", "paired_tests": tests})


def secret_mask(b: Any) -> Callable[[list[int]], list[bool]] | None:
    """The tokens of a canary's text that run config `b`'s goldfish drops, where every copy drops the same
    ones (goldfish.mask_is_the_documents), else None: the one grouping of canaries into masked and unmasked,
    applied to standard-loss runs too, so every run groups them alike."""
    gold = b.goldfish
    if not mask_is_the_documents(gold.strategy, b.data.packing == "packed"):
        return None
    return lambda ids: goldfish_mask(torch.tensor([ids]), strategy=gold.strategy, k=gold.k,
                                     h=gold.h)[0].tolist()


def score_injected(model: Any, cfg: InjectionConfig, tokenizer: Any, manifest: Any,
                   dup_tokens: dict[str, list[int]]) -> dict[str, Any]:
    """Every canary's exposure and extraction, and every duplicated document's greedy extraction."""
    b, c = cfg.base, cfg.canaries
    canaries, dups = manifest.of_kind("canary"), manifest.of_kind("duplicate")
    scores = canary_scores(model, tokenizer, c.template, cfg.canary_spec().space,
                           [it.secret for it in canaries], candidates=c.candidates, seed=b.seed,
                           dropped=secret_mask(b))
    for item, s in zip(canaries, scores["canaries"]):
        s.update(id=item.id, count=item.count)
    results = extract(model, [dup_tokens[it.id] for it in dups], prefix_len=b.eval.prefix,
                      suffix_len=b.eval.suffix, tokenizer=tokenizer, decode=b.eval.decode,
                      doc_ids=[it.id for it in dups]) if dups else []
    counts = {it.id: it.count for it in dups}
    scores["duplicates"] = [{"id": r.doc, "count": counts[r.doc], "exact_match": r.exact_match,
                             "rougeL": r.rougeL, "token_accuracy": r.token_accuracy} for r in results]
    return scores


MASKED_COLUMNS = (("canaries_masked", "masked", "{}"), ("extracted_unmasked", "extracted unmasked", "{:.0%}"),
                  ("extracted_masked", "extracted masked", "{:.0%}"),
                  ("exposure_unmasked", "exposure unmasked", "{:.2f}"),
                  ("exposure_masked", "exposure masked", "{:.2f}"),
                  ("kept_exposure_masked", "masked: exposure of kept tokens", "{:.2f}"))
SPLIT_NOTE = ("'masked' = the canaries with at least one secret token base.goldfish's mask drops (the mask "
              "depends on the tokens only, so the same canaries in every run); 'extracted' and 'exposure' "
              "unmasked / masked average over each group. Goldfish never trains a masked token, in any copy; "
              "an unmasked secret is trained in full in every copy (in packed rows: every copy not cut by a "
              "row start). 'masked: exposure of kept tokens' = what a masked canary gives away of the secret "
              "tokens the mask keeps: every secret of R grouped by its tokens at those positions "
              "(probability summed over the dropped ones), the rank of the canary's group among the groups; "
              "out of log2(groups) bits (6.64 for 2 of 3 digits kept), exact exposure only.")


def masked_split(canaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Canaries grouped by whether the goldfish mask drops one of their secret tokens
    (`secret_tokens_dropped`, from canary_scores): the masked group's size, and extraction and exposure
    within each group, and the masked ones' exposure of their kept tokens (None for an empty group; every
    value None for canaries scored before the mask was recorded)."""
    masked = [c for c in canaries if c.get("secret_tokens_dropped")]
    unmasked = [c for c in canaries if c.get("secret_tokens_dropped") == 0]
    return {"canaries_masked": len(masked) if masked or unmasked else None,
            "extracted_unmasked": _mean([float(c["extracted"]) for c in unmasked]),
            "extracted_masked": _mean([float(c["extracted"]) for c in masked]),
            "exposure_unmasked": _mean([c["exposure"] for c in unmasked]),
            "exposure_masked": _mean([c["exposure"] for c in masked]),
            "kept_exposure_masked": _mean([c["kept_exposure"] for c in masked
                                           if c.get("kept_exposure") is not None])}


def kept_exposures(answers: dict[str, Any]) -> list[float] | None:
    """The masked canaries' exposure of their kept tokens, in manifest order (the same canaries in every
    model: the mask depends on base.goldfish and the tokens only); None where not recorded."""
    canaries = (answers.get("injected") or {}).get("canaries", [])
    return [float(c["kept_exposure"]) for c in canaries if c.get("kept_exposure") is not None] or None


def _injected(part: str, field: str, masked: bool | None = None) -> Callable[[dict[str, Any]], Any]:
    """A getter of every injected item's `field` (answers["injected"]: score_injected's), in manifest order;
    `masked` True / False: only the canaries whose secret the mask drops a token of / none of."""
    def get(answers: dict[str, Any]) -> list[float] | None:
        items = (answers.get("injected") or {}).get(part, [])
        if masked is not None:
            items = [c for c in items if c.get("secret_tokens_dropped") is not None
                     and bool(c["secret_tokens_dropped"]) == masked]
        return [float(x[field]) for x in items] or None
    return get


def injected_questions() -> list[Question]:
    """The paired questions about injected items: duplicated documents (exact match, RougeL), canaries
    (exposure, of the masked and of the unmasked ones where the mask groups them, extraction) and the
    masked canaries' kept tokens; each asked only where both models' answers hold it."""
    return [Question("em_dup", "EM duplicated leads", "binary", _injected("duplicates", "exact_match"),
                     "{:+.0%}"),
            Question("rouge_dup", "ROUGE-L duplicated leads", "number", _injected("duplicates", "rougeL")),
            Question("exposure", "canary exposure (bits)", "number", _injected("canaries", "exposure"),
                     "{:+.2f}"),
            Question("exposure_masked", "exposure masked (bits)", "number",
                     _injected("canaries", "exposure", masked=True), "{:+.2f}"),
            Question("exposure_unmasked", "exposure unmasked (bits)", "number",
                     _injected("canaries", "exposure", masked=False), "{:+.2f}"),
            Question("secrets", "secrets extracted", "binary", _injected("canaries", "extracted"), "{:+.0%}"),
            Question("kept", "masked: exposure of kept tokens (bits)", "number", kept_exposures, "{:+.2f}")]


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
