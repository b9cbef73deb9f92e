"""Per-document paired tests of models that answered the same documents: each row against its reference.

Every model of an experiment answers the same documents (the leads, the injected items, the members and
non-members), so a difference between two of them can be tested document by document (evals.paired):
exact McNemar for a yes/no per document, a bootstrap interval and a sign-flip permutation p for a number
per document, a paired bootstrap for a membership AUC. The p-values of one table are adjusted together
(Benjamini-Hochberg) and '*' marks an adjusted p below 0.05. Every experiment that trains more than one
model reports it as a table of one run, which replicates over seeds leave in each seed's report (they
average figures, not p-values); `memorize compare` asks it of any runs' result files.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from evals.paired import adjust, format_test, mcnemar, paired_auc, paired_difference
from memorize_core import ConfigError

LEVEL = 0.05  # the adjusted p below which a cell is starred


@dataclass(frozen=True)
class Question:
    """One column: `get(answers)` gives a model's per-document values (for `kind` "binary" or "number": one
    value per document; for "auc": (member scores, non-member scores)), or None where it has none."""

    key: str
    title: str
    kind: str  # binary | number | auc
    get: Callable[[Mapping[str, Any]], Any]
    fmt: str = "{:+.3f}"


def per_document(key: str, *path: str) -> Callable[[Mapping[str, Any]], Any]:
    """A getter of answers["per_document"][key][path...] (None where the answers lack it)."""
    def get(answers: Mapping[str, Any]) -> Any:
        value: Any = (answers.get("per_document") or {}).get(key)
        for step in path:
            value = value.get(step) if isinstance(value, Mapping) else None
        return value
    return get


def align(row: Mapping[str, Mapping[Any, Any]], ref: Mapping[str, Mapping[Any, Any]]
          ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two models' per-document values keyed by document id ({question key: {id: value}}) as answers whose
    lists pair document by document: for each key both hold, the ids both scored, in the reference's order."""
    a: dict[str, list] = {}
    b: dict[str, list] = {}
    for key, ref_values in ref.items():
        values = row.get(key)
        if values is not None:
            ids = [i for i in ref_values if i in values]
            a[key], b[key] = [values[i] for i in ids], [ref_values[i] for i in ids]
    return {"per_document": a}, {"per_document": b}


def mia_questions(methods: Sequence[str]) -> list[Question]:
    """One AUC column per MIA method, from answers["per_document"]["members" / "nonmembers"][method]."""
    def scores(m: str) -> Callable[[Mapping[str, Any]], Any]:
        def get(answers: Mapping[str, Any]) -> Any:
            pos, neg = per_document("members", m)(answers), per_document("nonmembers", m)(answers)
            return None if pos is None or neg is None else (pos, neg)
        return get

    return [Question(f"auc_{m}", f"MIA AUC {m}", "auc", scores(m)) for m in methods]


def _test(q: Question, a: Any, b: Any, resamples: int, seed: int) -> dict[str, Any]:
    if q.kind == "binary":
        return mcnemar(a, b)
    if q.kind == "number":
        return paired_difference(a, b, resamples=resamples, seed=seed)
    return paired_auc(a[0], a[1], b[0], b[1], resamples=resamples, seed=seed)


def paired_table(answers: Mapping[str, Mapping[str, Any] | None], pairs: Sequence[tuple[str, str]],
                 questions: Sequence[Question], *, label: str = "arm", resamples: int = 1000, seed: int = 0,
                 missing: str = "delete OUT/runs/*/evals.json and rerun: scored again, not retrained",
                 aligned: Mapping[str, Mapping[str, Any]] | None = None, title: str = ""
                 ) -> tuple[dict[str, Any] | None, dict[str, dict[str, Any]], list[str]]:
    """(the table: {title, rows, columns, index}; {row: {question key: test, with its "reference"}};
    notes): each (row, reference) of `pairs` (names of `answers`, each model's answers) tested on every
    question both answer, in that order. `aligned[row]`, where given, is the reference's answers on that
    row's documents (when each row shares a different set of documents with the reference). `title`
    names the table where a report has more than one (default: what each row is tested against).

    A row without per-document answers (kept before they were stored) or whose answers cannot be paired
    is left out with a note saying which and why (`missing`: how to get them); no table (None) when no row
    is left."""
    tests: dict[str, dict[str, Any]] = {}
    against: dict[str, str] = {}
    lacking, refused = [], []
    for name, ref in pairs:
        ans, base = answers.get(name), (aligned or {}).get(name) or answers.get(ref)
        row = {}
        for q in questions:
            a, b = (q.get(ans), q.get(base)) if ans and base else (None, None)
            if a is not None and b is not None:
                try:
                    row[q.key] = _test(q, a, b, resamples, seed)
                except ConfigError as e:  # answers that do not pair (another length, a non-finite value)
                    refused.append((name, f"{name}, {q.title} ({e})"))
        if row:
            tests[name], against[name] = row, ref
        elif all(n != name for n, _ in refused):
            lacking.append(name)
    notes = []
    if lacking:
        notes.append(f"No per-document paired tests for {', '.join(lacking)}: no per-document scores on both "
                     f"sides (kept before they were stored; {missing}).")
    if refused:
        notes.append("WARNING: per-document scores that do not pair, not tested: "
                     + "; ".join(why for _, why in refused) + ".")
    if not tests:
        return None, {}, notes
    flat = [(name, key) for name, row in tests.items() for key in row]
    for (name, key), p in zip(flat, adjust([tests[n][k]["p_value"] for n, k in flat])):
        tests[name][key]["p_adjusted"] = p
    fmts = {q.key: q.fmt for q in questions}
    refs = sorted(set(against.values()))
    many = len(refs) > 1
    rows = [{label: name, **({"reference": against[name]} if many else {}),
             **{k: format_test(t, fmts[k], t["p_adjusted"], LEVEL) for k, t in row.items()}}
            for name, row in tests.items()]
    asked = [q for q in questions if any(q.key in row for row in tests.values())]
    cols = ((label, label, "{}"), *((("reference", "minus", "{}"),) if many else ()),
            *((q.key, q.title, "{}") for q in asked))
    title = title or (f"Paired tests: each {label} − its reference, document by document" if many else
                      f"Paired tests: each {label} − '{refs[0]}', document by document")
    notes.insert(0, " ".join([
        f"{title}: exact match by the exact McNemar test (in brackets: the documents only the row gets right",
        "vs only the reference does); numbers per document by the mean difference, its",
        f"{resamples}-resample bootstrap 95% interval and the p of a sign-flip permutation test of the mean;",
        "MIA AUCs by a paired bootstrap of members and non-members (p from z = difference / bootstrap sd).",
        f"Each cell shows its test's own p; '*' marks a Benjamini-Hochberg adjusted p < {LEVEL} over the",
        f"table's {len(flat)} tests (report.json: p_adjusted). They hold the trained models fixed (do these",
        "models differ on these documents?); another draw of the corpus and data order adds its own spread",
        "(seeds: replicate.seeds)."]))
    for name, row in tests.items():
        for t in row.values():
            t["reference"] = against[name]
    notes += _undecidable(asked, tests)
    return {"title": title, "rows": rows, "columns": cols, "index": (label,)}, tests, notes


def _undecidable(questions: Sequence[Question], tests: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """A note naming the columns no outcome could make significant: with n paired items the exact tests'
    smallest two-sided p is 2^(1-n) (every item changed, all one way), at or above LEVEL for n <= 5."""
    few = []
    for q in questions:
        ns = [row[q.key]["n"] for row in tests.values() if q.key in row and "n" in row[q.key]]
        if ns and 2.0 ** (1 - min(ns)) >= LEVEL:
            some = "" if min(ns) == max(ns) else " in some rows"
            few.append(f"'{q.title}' ({min(ns)} items{some}: p >= {2.0 ** (1 - min(ns)):.3g})")
    if not few:
        return []
    return [f"Too few items for a test to decide, whatever the models did: {', '.join(few)}. More of them "
            "(more canaries or duplicated documents per copy count, more documents) let it decide; until "
            "then the size of the difference, and its agreement over seeds, is the evidence."]
