"""goldfish-near-duplicates: does goldfish still stop extraction when the copies are near-copies?

Goldfish's guarantee is per exact copy: a dropped token is dropped in every copy, because the mask is
a function of the token ids. A near-copy (a few words edited) changes the hash keys of the h windows
after each edit, so across many near-copies the union of supervised tokens can cover the original.
One cell per (copies n, edit rate r, strategy): `clusters` documents of the base corpus each appear n
times (copy 0 verbatim, the others with each word edited at rate r: data_pipelines.inject), a model is
trained on that corpus (a tiny one from scratch, or a pretrained one fine-tuned), and the cell reports
extraction of the originals (greedy suffix from the prefix: exact match, RougeL), their mask coverage
(the share of each original's suffix tokens supervised in at least one copy:
memorization.mitigations.coverage) and the held-out loss. With one copy every edit rate trains the
same corpus, so that cell is trained once. A pretrained base is also asked the same questions before
fine-tuning (`baseline`, the "0 copies" row): a hit it already makes is not learnt from the copies.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from data_pipelines import DedupConfig, DuplicateSpec, inject, tokenize_documents
from evals import extract
from evals.near_verbatim import near_verbatim
from evals.perplexity import corpus_loss
from evals.probabilistic import np_rates, sampled_extraction
from memorization.config import RunConfig, change_words
from memorization.experiments.questions import reference_model
from memorization.experiments.reporting import Outputs, Table, save
from memorization.experiments.runner import Experiment, digest, load_documents, say
from memorization.experiments.spec import ExperimentConfig, choice_list, int_list, refuse_data_dedup
from memorization.mitigations.coverage import Cluster, audit, clusters_from_manifest
from memorization.mitigations.goldfish import STRATEGIES
from memorization.models import is_pretrained, run_tokenizer
from memorization.paired import Question, paired_table, per_document
from memorization.train.prepare import PreparedData, prepare_deduplicated, prepare_documents
from memorization.train.run_plan import run_schemes
from memorize_core import fail

# none: standard loss; dedup: standard loss on the corpus after `dedup` (near-document dedup by default);
# dedup+S: goldfish strategy S on that corpus
REFERENCE = "none"  # replicates' paired differences: each strategy against standard loss, cell by cell
CHOICES = ("none",) + STRATEGIES + ("dedup",) + tuple(f"dedup+{s}" for s in STRATEGIES)


def is_dedup(strategy: str) -> bool:
    """Whether a grid strategy trains on the deduplicated corpus (dedup, dedup+S)."""
    return strategy.startswith("dedup")
COLUMNS = (
    ("strategy", "strategy", "{}"), ("copies", "copies", "{}"), ("edit_rate", "edit rate", "{:.0%}"),
    ("exact_match_rate", "EM", "{:.0%}"), ("rougeL", "RougeL", "{:.3f}"),
    ("np_best", "(n=1000, p=0.5), best scheme", "{:.0%}"),
    ("single_copy_suffix", "one copy supervises", "{:.0%}"),
    ("suffix_coverage", "copies supervise", "{:.0%}"),
    ("fully_covered", "suffix 100%", "{}"), ("val_loss", "held-out loss", "{:.3f}"),
)


@dataclass
class Config(ExperimentConfig):
    """The grid: copies x edit rates x strategies (goldfish k and h from base.goldfish)."""

    copies: list[int] = field(default_factory=lambda: [1, 4, 16, 64])
    edit_rates: list[float] = field(default_factory=lambda: [0.0, 0.01, 0.05, 0.1])
    strategies: list[str] = field(default_factory=lambda: ["none", "hash", "hash-table", "apertus", "static"])
    clusters: int = 4  # originals copied in every cell
    edit_unit: str = "word"  # word: edit the text's words; token: edit its token ids
    # a pretrained base is evaluated once before fine-tuning, the report's "base model" row (a model
    # trained from scratch starts from noise: no row)
    baseline: bool = True
    # what the dedup strategies train after: Lee et al.'s exact passes plus near-document dedup at a
    # Jaccard similarity (of 5-token windows) low enough for copies edited at ~10% of words
    dedup: DedupConfig = field(default_factory=lambda: DedupConfig(enabled=True, near_documents=True,
                                                                   near_threshold=0.3))

    def validate(self, prefix: str = "") -> None:
        """Copies >= 1, rates in [0, 1], known strategies, at least one cluster."""
        super().validate(prefix)
        int_list("copies", self.copies, minimum=1)
        if not self.edit_rates or len(set(self.edit_rates)) != len(self.edit_rates):
            raise fail("edit_rates", self.edit_rates, "give distinct rates in [0, 1], e.g. [0, 0.05]")
        for i, r in enumerate(self.edit_rates):
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r <= 1:
                raise fail(f"edit_rates[{i}]", r, "must be a fraction in [0, 1], e.g. 0.05")
        choice_list("strategies", self.strategies, CHOICES)
        int_list("clusters", [self.clusters], minimum=1)
        DuplicateSpec(counts=[1], edit_unit=self.edit_unit)  # checks the unit
        self.dedup.validate("dedup")
        refuse_data_dedup(self.base, "use the dedup or dedup+S strategies (the experiment's dedup settings)")
        if any(map(is_dedup, self.strategies)) and not self.dedup.enabled:
            raise fail("dedup.enabled", False, "the dedup strategies train on the deduplicated corpus: set "
                       "it true, or drop them from strategies")


def cells(cfg: Config) -> list[tuple[int, float]]:
    """The (copies, edit rate) corpora, in training order; one copy is one corpus whatever the rate."""
    out: list[tuple[int, float]] = []
    for r in cfg.edit_rates:
        for n in cfg.copies:
            cell = (n, 0.0 if n == 1 else float(r))
            if cell not in out:
                out.append(cell)
    return out


def goldfish_of(strategy: str) -> str | None:
    """The goldfish strategy of a grid strategy (none, dedup: None)."""
    s = strategy.removeprefix("dedup").removeprefix("+")
    return None if s in ("", "none") else s


def cell_config(cfg: Config, strategy: str, n: int, rate: float) -> RunConfig:
    """The RunConfig of one cell: the base with this strategy (none, dedup: standard loss), all rows kept."""
    b = cfg.base
    g = goldfish_of(strategy)
    gold = replace(b.goldfish, enabled=g is not None, strategy=g or b.goldfish.strategy, token_budget=False)
    return replace(b, name=f"{strategy}-x{n}-r{rate:g}", goldfish=gold, data=replace(b.data, min_tokens=1),
                   eval=replace(b.eval, extraction=False))


def run_configs(cfg: Config) -> list[RunConfig]:
    """Every sub-run's RunConfig, in training order (memorization.train.run_plan checks them all first)."""
    return [cell_config(cfg, s, n, r) for n, r in cells(cfg) for s in cfg.strategies]


def _base(cfg: Config) -> tuple[list, list | None, Any]:
    """(base documents long enough for prefix + suffix, held-out documents, the shared tokenizer)."""
    b = cfg.base
    docs, held, _ = load_documents(b)
    tok = run_tokenizer(b.data.tokenizer, b.model.name, texts=[d.text for d in docs],
                        vocab_size=b.data.vocab_size)
    docs = [docs[i] for i in tokenize_documents(docs, tok, min_tokens=b.data.min_tokens).kept]
    if len(docs) <= cfg.clusters:
        raise fail("clusters", cfg.clusters, f"needs more than {cfg.clusters} base documents of >= "
                   f"{b.data.min_tokens} tokens; the corpus has {len(docs)}: lower it or raise data.limit")
    return docs, held, tok


def run(cfg: Config, exp: Experiment) -> Outputs | None:
    """Train every cell (reusing finished ones) and report extraction, coverage and held-out loss."""
    b = cfg.base
    docs, held, tok = _base(cfg)
    corpora = {}
    for n, r in cells(cfg):
        spec = DuplicateSpec(counts=[n], per_count=cfg.clusters, edit_rate=r, edit_unit=cfg.edit_unit)
        injected, manifest = inject(docs, duplicates=spec, seed=b.seed, tokenizer=tok)
        keep_all = replace(b, data=replace(b.data, min_tokens=1))  # a near-copy may come out shorter
        data = prepare_documents(keep_all, injected, held, tokenizer=tok)
        clusters = clusters_from_manifest(injected, manifest, tok, max_tokens=b.data.block_len)
        corpora[(n, r)] = (data, clusters, spec)
        if any(map(is_dedup, cfg.strategies)):  # the same corpus after cfg.dedup
            ddata, dman = prepare_deduplicated(data, injected, cfg.dedup, b.data.block_len)
            corpora[(n, r, "dedup")] = (ddata, _surviving(clusters, ddata), dman)
    exp.check(run_configs(cfg), [_corpus(corpora, s, n, r)[0] for n, r in cells(cfg) for s in cfg.strategies])
    for (n, r, *dedup), (_, _, dman) in corpora.items():
        if dedup and exp.is_main:  # what the dedup strategies' cells lost, per corpus
            dman.save(exp.out / f"dedup-x{n}-r{r:g}.json", overwrite=True)
    gold = b.goldfish
    schemes = run_schemes(b)  # (n, p) extraction of the originals beside greedy (evals/probabilistic.py)
    # the originals and the held-out documents are the same in every cell (one seeded choice)
    originals = [c.original for c in corpora[cells(cfg)[0]][1]]
    held_docs = corpora[cells(cfg)[0]][0].held_out_docs
    if any([c.original for c in clusters] != originals for _, clusters, _ in corpora.values()):
        raise RuntimeError("goldfish-near-duplicates: the cells copy different originals; evaluate per cell")

    def evaluate(model, run_dir) -> dict[str, Any]:
        res = extract(model, originals, prefix_len=b.eval.prefix, suffix_len=b.eval.suffix, tokenizer=tok,
                      batch_size=b.eval.batch_size, decode=b.eval.decode)
        beyond = sampled_extraction(model, originals, prefix_len=b.eval.prefix, suffix_len=b.eval.suffix,
                                    schemes=schemes, ns=b.eval.np_ns, p=b.eval.np_p,
                                    batch_size=b.eval.batch_size) if schemes else None
        # base.eval.near_verbatim: a sample within that many changes of the original's suffix
        near = (near_verbatim(model, originals, schemes=schemes, **b.eval.near_args())
                if schemes and b.eval.near_verbatim else None)
        # the held-out documents' loss, as the trainer's validation scores them (per-document rows)
        held = corpus_loss(model, held_docs, batch_size=b.eval.batch_size)["loss"] if held_docs else None
        return {"extraction": [{"exact_match": x.exact_match, "rougeL": x.rougeL} for x in res],
                "np": np_rates(beyond) if beyond else {},
                "near_np": _near_rates(near, b.eval.near_verbatim) if near else {}, "held_out_loss": held}

    # everything evaluate reads beside the model (the cells run with eval.extraction off, so their run key
    # holds no sampling settings: they are here)
    eval_key = {"prefix": b.eval.prefix, "suffix": b.eval.suffix, "held_out_loss": True,
                "schemes": b.eval.sampling, "np": [b.eval.np_ns, b.eval.np_p], **b.eval.near_key()}
    rows, base = [], None  # the cells; the base model's row
    answers: dict[str, Any] = {}  # each cell's per-original extraction, for the paired tests
    pretrained = is_pretrained(b.model.name) and not b.model.random_init
    if cfg.baseline and pretrained:
        key = {"model": b.model.name, "overrides": b.model.overrides, "originals": digest(originals),
               "held_out": digest(held_docs), "eval": eval_key, "seed": b.seed}
        say("base model: its evaluation before fine-tuning")
        values = exp.baseline(key, lambda: reference_model(b, exp.grid_spec), evaluate)
        if exp.is_main:
            base = {"name": "base-model", "strategy": "base model", "copies": 0, "edit_rate": None,
                    **_scores(values), "suffix_coverage": None, "coverage": None, "single_copy_suffix": None,
                    "fully_covered": "", "train_seconds": None, "rows": 0}
    for n, r in cells(cfg):
        spec = corpora[(n, r)][2]
        for strategy in cfg.strategies:
            data, clusters, dman = _corpus(corpora, strategy, n, r)
            rc = cell_config(cfg, strategy, n, r)
            extra = {"duplicates": vars(spec), "seed": b.seed}
            if is_dedup(strategy):
                extra["dedup"] = cfg.dedup.key()
            summary = exp.run(rc, data, evaluate=evaluate, per_run_wandb=cfg.per_run_wandb, extra_key=extra,
                              eval_key=eval_key)
            if not exp.is_main:
                continue
            answers[rc.name] = {"per_document": {
                "em": [float(x["exact_match"]) for x in summary["extraction"]],
                "rougeL": [float(x["rougeL"]) for x in summary["extraction"]]}}
            g = goldfish_of(strategy) or "none"
            cov = audit(clusters, [g], gold.k, gold.h, prefix=b.eval.prefix, suffix=b.eval.suffix,
                        seed=rc.goldfish.seed)["strategies"][g]
            rows.append({"name": rc.name, "strategy": strategy, "copies": n, "edit_rate": r,
                         "copies_trained": sum(len(c.copies) for c in clusters) / len(clusters),
                         **_scores(summary),
                         "suffix_coverage": cov["suffix_coverage"], "coverage": cov["coverage"],
                         "single_copy_suffix": cov["single_copy_suffix"],
                         "fully_covered": f"{cov['clusters_fully_covered']}/{len(clusters)}",
                         "train_seconds": summary.get("train_seconds"), "rows": len(data.train)})
            say(f"{rc.name}: EM {rows[-1]['exact_match_rate']:.0%}, suffix coverage "
                f"{rows[-1]['suffix_coverage']:.0%}")
    if not exp.is_main:
        return None
    grid = _expand(rows, cfg)
    table = ([base] if base else []) + grid
    notes = [
        f"Corpus: {b.data.corpus} (limit {b.data.limit}), {len(docs)} base documents of >= "
        f"{b.data.min_tokens} tokens; {cfg.clusters} of them are copied n times per cell (copy 0 verbatim, "
        f"the others edited: each {cfg.edit_unit} substituted, preceded by an insertion or deleted with "
        f"probability r); rows cut to {b.data.block_len} tokens; model "
        f"{b.model.name}{f' {b.model.overrides}' if b.model.overrides else ''} "
        f"{'fine-tuned from its pretrained weights' if pretrained else 'from scratch'}, "
        f"{b.trainer.epochs} epochs, lr {b.trainer.lr}.",
        f"Goldfish k={gold.k}, h={gold.h} for every strategy; none = standard loss.",
        f"EM / RougeL: greedy {b.eval.suffix} tokens from the first {b.eval.prefix} of each original.",
        "Coverage: the share of each original's suffix tokens supervised in at least one copy (copies "
        "aligned to the original by difflib on token ids); 'one copy': what one exact copy supervises. "
        "'suffix 100%': clusters whose whole suffix is supervised somewhere (goldfish withholds nothing).",
        f"Held-out loss: {b.data.held_out or f'a {b.data.held_out_fraction:.0%} split of {b.data.corpus}'}"
        " (each document cut to the block, scored after training).",
        "One copy is the same corpus at every edit rate: that cell is trained once, repeated in the table.",
    ]
    if base:
        notes.append("Base model: the pretrained weights before fine-tuning, asked the same questions (0 "
                     "copies; OUT/baseline/evals.json): what it already reproduces is not learnt from the "
                     "copies.")
    elif pretrained:
        notes.append("No base-model row (baseline: false).")
    plot = _plot(table, cfg, exp.out / "goldfish-near-duplicates.png")
    title = "Goldfish under near-duplicates: extraction and mask coverage vs copies and edit rate"
    columns = COLUMNS
    if any(map(is_dedup, cfg.strategies)):
        columns = (*COLUMNS[:2], ("copies_trained", "copies trained", "{:.1f}"), *COLUMNS[2:])
        notes.append(f"dedup: the cell's corpus after deduplication ({cfg.dedup.describe()}: the "
                     "earliest copy in corpus order stays, which may be an edited one; OUT/dedup-xN-rR.json "
                     "lists every removal); dedup+S: goldfish strategy S on it. 'copies trained': copies "
                     "per original left (coverage counts only those).")
    if b.eval.near_verbatim:  # after the (n, p) column
        at = [c[0] for c in columns].index("np_best") + 1
        word, phrase = change_words(b.eval.nv_distance)
        columns = (*columns[:at], ("near_best", f"within {b.eval.near_verbatim} {word}, best scheme",
                                   "{:.0%}"), *columns[at:])
        notes.append(f"Within {b.eval.near_verbatim} {word}: the share of originals whose lower bound of "
                     f"P(a sample lies within {b.eval.near_verbatim} {phrase} of the suffix) passes the same "
                     "(n, p) test, under the scheme where it is largest (evals/near_verbatim.py).")
    paired, tests, paired_notes = paired_table(answers, paired_pairs(cfg), PAIRED_QUESTIONS, label="cell",
                                               resamples=1000, seed=b.seed)
    notes += paired_notes
    return Outputs(title=title, kind=cfg.kind, runs=grid, notes=notes, plots=[plot],
                   tables=[Table("Cells", table, columns, ("strategy", "copies", "edit_rate")),
                           *([Table(**paired, per_seed=True)] if paired else [])],
                   extra={"baseline": base, "paired_tests": tests})


PAIRED_QUESTIONS = [Question("em", "EM of the originals", "binary", per_document("em"), "{:+.0%}"),
                    Question("rougeL", "RougeL", "number", per_document("rougeL"))]


def paired_pairs(cfg: Config) -> list[tuple[str, str]]:
    """(cell, reference) of the paired tests: every strategy's cell against standard loss (none) on the same
    corpus (copies, edit rate); none when the grid trains no `none` cell."""
    if REFERENCE not in cfg.strategies:
        return []
    return [(cell_config(cfg, s, n, r).name, cell_config(cfg, REFERENCE, n, r).name)
            for n, r in cells(cfg) for s in cfg.strategies if s != REFERENCE]


def _expand(rows: list[dict[str, Any]], cfg: Config) -> list[dict[str, Any]]:
    """Every (rate, copies, strategy) row of the grid, the one-copy cell repeated at each rate."""
    by = {(x["strategy"], x["copies"], x["edit_rate"]): x for x in rows}
    out = []
    for r in cfg.edit_rates:
        for n in cfg.copies:
            for s in cfg.strategies:
                out.append({**by[(s, n, 0.0 if n == 1 else float(r))], "edit_rate": float(r)})
    return out


def _surviving(clusters: list[Cluster], data: PreparedData) -> list[Cluster]:
    """Each cluster with only the copies the deduplicated corpus still trains on, as it trains on them
    (the span pass may have cut a kept copy)."""
    kept = dict(zip(data.train_doc_ids, data.train_docs))
    return [Cluster(c.id, c.original, [list(kept[i]) for i in c.member_ids if i in kept],
                    [i for i in c.member_ids if i in kept]) for c in clusters]


def _corpus(corpora: dict, strategy: str, n: int, r: float) -> tuple:
    """(prepared data, clusters, dedup manifest or spec) a strategy's cell trains on."""
    return corpora[(n, r, "dedup")] if is_dedup(strategy) else corpora[(n, r)]


def _scores(s: dict[str, Any]) -> dict[str, Any]:
    """A cell's (or the base model's) extraction figures and held-out loss from its evaluation."""
    ext = s["extraction"]
    return {"exact_match_rate": _mean([x["exact_match"] for x in ext]),
            "rougeL": _mean([x["rougeL"] for x in ext]), "extracted_docs": len(ext),
            "np_best": max((v for k, v in (s.get("np") or {}).items() if k != "greedy"), default=None),
            "near_best": max((s.get("near_np") or {}).values(), default=None),
            "val_loss": s.get("held_out_loss")}


def _near_rates(result: dict[str, Any], d: int) -> dict[str, float]:
    """scheme -> the fraction of documents whose near-verbatim bound within d changes passes (n, p) at the
    largest n, offset 0 (of evals.near_verbatim.near_verbatim)."""
    summaries = result["offsets"]["0"]["np"] or {}
    return {name: s["schemes"][f"d={d}"][f"n={max(s['ns'])}"]["fraction"]
            for name, s in summaries.items() if s}


def _mean(values: list) -> float | None:
    return sum(map(float, values)) / len(values) if values else None


def _plot(rows: list[dict[str, Any]], cfg: Config, path):
    """EM (top), suffix coverage and, with base.eval.near_verbatim, the share of originals (n, p)-extractable
    within that many changes (bottom) vs copies, one panel per edit rate, one line per strategy; the base
    model's value (before fine-tuning) a dashed grey line."""
    import matplotlib  # deferred: matplotlib +0.7 s

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: matplotlib +0.7 s

    n = len(cfg.edit_rates)
    panels = [("exact_match_rate", "exact match of the originals"),
              ("suffix_coverage", "suffix coverage (union of copies)")]
    d = cfg.base.eval.near_verbatim
    if d:
        word = change_words(cfg.base.eval.nv_distance)[0]
        panels.append(("near_best", f"(n={max(cfg.base.eval.np_ns)}, p={cfg.base.eval.np_p}) within {d} "
                                    f"{word}"))
    fig, axes = plt.subplots(len(panels), n, figsize=(3.6 * n, 3.2 * len(panels)), squeeze=False,
                             sharey="row")
    for j, r in enumerate(cfg.edit_rates):
        for s in cfg.strategies:
            mine = sorted((x for x in rows if x["strategy"] == s and x["edit_rate"] == r),
                          key=lambda x: x["copies"])
            xs = [x["copies"] for x in mine]
            style = dict(marker="o", label=s, linestyle=":" if s == "none" else "-")
            for i, (key, _) in enumerate(panels):
                axes[i][j].plot(xs, [x[key] for x in mine], **style)
        for base in (x for x in rows if x["copies"] == 0):  # the pretrained model before fine-tuning
            for i, (key, _) in enumerate(panels):
                if base[key] is not None:
                    axes[i][j].axhline(base[key], color="grey", linestyle="--", linewidth=1,
                                       label="base model" if i == 0 and j == 0 else None)
        for i, (_, label) in enumerate(panels):
            ax = axes[i][j]
            ax.set_xscale("log", base=2)
            ax.set(ylim=(-0.03, 1.03), xlabel="copies", title=f"edit rate {r:.0%}")
            if j == 0:
                ax.set_ylabel(label)
    axes[0][0].legend(fontsize=7)
    return save(fig, path)
