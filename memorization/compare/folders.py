"""Per-document answers of result folders and their paired tests: what `memorize compare` and the
experiments' reports read from any run that scored itself.

From each folder it reads
  extraction.jsonl  the greedy suffix of every document: exact match, RougeL, token accuracy
  sampled.jsonl     log p_z per sampling scheme of every (offset, document): (n, p)-extractable or not
                    (greedy's row is the exact match already tested)
  mia.jsonl         every attack's score of every member and non-member: the attack's AUC
and pairs two folders on the documents both scored. A document scored against different prefix or target
tokens in two folders is refused: they did not ask the same question (checked where both hold
extraction.jsonl: sampled.jsonl and mia.jsonl rows carry no tokens, only ids).
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from evals.mia import METHODS
from evals.sampling import extractable
from memorization.paired import Question, align, paired_table, per_document
from memorize_core import ConfigError, fail

FILES = ("extraction.jsonl", "sampled.jsonl", "mia.jsonl")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _lines(path: Path, need: dict[str, Callable[[Any], bool]]) -> list[tuple[int, dict[str, Any]]]:
    """(line number, row) of every JSON row of `path`, each checked to hold every `need` key with a value its
    check accepts."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise fail(str(path), type(e).__name__, f"cannot be read ({e}); check the file and its permissions, "
                   "or score the model again (memorize eval --out)") from None
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise fail(f"{path}", f"line {i}", f"is not JSON ({e.msg}); the file is damaged: score the "
                       "model again (memorize eval --out)") from None
        bad = next((k for k, ok in need.items() if not isinstance(row, dict) or k not in row
                    or not ok(row[k])), None)
        if bad is not None:
            raise fail(f"{path}", f"line {i}", f"has no valid {bad!r} (got "
                       f"{row.get(bad) if isinstance(row, dict) else row!r}); compare reads the files "
                       "memorize train / eval write: score the model again")
        rows.append((i, row))
    return rows


def _keyed(path: Path, rows: list[tuple[int, dict[str, Any]]], key: Callable[[dict[str, Any]], Any]
           ) -> dict[Any, dict[str, Any]]:
    """The rows by `key`, refusing a key two rows share (a concatenated or edited file: which one counts?)."""
    out: dict[Any, dict[str, Any]] = {}
    first: dict[Any, int] = {}
    for i, row in rows:
        k = key(row)
        if k in out:
            raise fail(str(path), f"line {i}", f"repeats {k!r} of line {first[k]}; each document is scored "
                       "once: score the model again into a folder of its own")
        out[k], first[k] = row, i
    return out


def read_folder(path: Path) -> dict[str, dict[Any, Any]]:
    """A folder's per-document answers: {"extraction": {doc: row}, "sampled": {(offset, doc): {scheme:
    log p_z or None}}, "mia": {(id, member): {attack: score}}} (a part missing where its file is). Every
    row is checked as it is read; an attack is a key of evals.mia.METHODS."""
    if not path.is_dir():
        raise fail("RUN", str(path), "is not a folder; pass a run folder (memorize train / demo, an "
                   "experiment's OUT/runs/NAME) or a memorize eval --out folder")
    got: dict[str, dict[Any, Any]] = {}
    if (path / "extraction.jsonl").is_file():
        rows = _lines(path / "extraction.jsonl", {"doc": lambda v: v is not None,
                                                  "exact_match": lambda v: isinstance(v, bool),
                                                  "rougeL": _number, "token_accuracy": _number})
        got["extraction"] = _keyed(path / "extraction.jsonl", rows, lambda r: str(r["doc"]))
    if (path / "sampled.jsonl").is_file():
        rows = _lines(path / "sampled.jsonl", {
            "offset": lambda v: isinstance(v, int), "doc": lambda v: v is not None,
            "logpz": lambda v: isinstance(v, dict) and all(x is None or _number(x) for x in v.values())})
        windows = _keyed(path / "sampled.jsonl", rows, lambda r: (int(r["offset"]), str(r["doc"])))
        got["sampled"] = {k: r["logpz"] for k, r in windows.items()}
    if (path / "mia.jsonl").is_file():
        rows = _lines(path / "mia.jsonl", {"id": lambda v: v is not None,
                                           "member": lambda v: isinstance(v, bool)})
        methods = [m for m in METHODS if all(m in r for _, r in rows)]
        for i, r in rows:
            bad = next((m for m in methods if not _number(r[m])), None)
            if bad is not None:
                raise fail(f"{path / 'mia.jsonl'}", f"line {i}", f"has no finite {bad!r} score (got "
                           f"{r[bad]!r}); score the model again")
        scored = _keyed(path / "mia.jsonl", rows, lambda r: (str(r["id"]), r["member"]))
        got["mia"] = {k: {m: float(r[m]) for m in methods} for k, r in scored.items()}
    if not got:
        raise fail("RUN", str(path), f"holds none of {', '.join(FILES)}; train with evaluation on, or score "
                   "the model with memorize eval --out DIR and compare DIR")
    return got


def _shared(a: dict[Any, Any] | None, b: dict[Any, Any] | None) -> list:
    """The keys both parts hold, in a's order ([] when either folder lacks the part)."""
    return [k for k in a if k in b] if a is not None and b is not None else []


def pair(ref_name: str, ref: dict[str, dict[Any, Any]], name: str, run: dict[str, dict[Any, Any]], n: int,
         p: float) -> tuple[dict[str, Any], dict[str, Any], list[Question], dict[str, int]]:
    """(the run's per-document values, the reference's on the same documents, the questions they answer,
    how many documents each part pairs) for one RUN against REF, on the documents both scored."""
    docs = _shared(ref.get("extraction"), run.get("extraction"))
    for doc in docs:
        a, b = ref["extraction"][doc], run["extraction"][doc]
        if a.get("target_ids") != b.get("target_ids") or a.get("prefix_ids") != b.get("prefix_ids"):
            raise fail("RUN", name, f"scored document {doc!r} with another prefix or suffix than {ref_name}; "
                       "compare runs evaluated with the same eval.prefix / eval.suffix on the same corpus")
    windows = _shared(ref.get("sampled"), run.get("sampled"))
    offsets = sorted({o for o, _ in windows})
    schemes = {}  # per offset; greedy at offset 0 is the exact match extraction.jsonl already gives
    for o in offsets:
        at = [w for w in windows if w[0] == o]
        names = sorted({s for w in at for s in ref["sampled"][w]})
        names = [s for s in names if all(s in ref["sampled"][w] and s in run["sampled"][w] for w in at)
                 and not (s == "greedy" and o == 0 and docs)]
        if names:
            schemes[o] = (at, names)
    scored = _shared(ref.get("mia"), run.get("mia"))
    members, nonmembers = [k for k in scored if k[1]], [k for k in scored if not k[1]]
    attacks = [m for m in METHODS if scored and m in ref["mia"][scored[0]] and m in run["mia"][scored[0]]]
    if len(members) < 2 or len(nonmembers) < 2:
        attacks = []
    values: tuple[dict[str, Any], dict[str, Any]] = ({}, {})
    for per, f in zip(values, (run, ref)):
        if docs:
            rows = [f["extraction"][d] for d in docs]
            per.update(em=[float(r["exact_match"]) for r in rows], rougeL=[float(r["rougeL"]) for r in rows],
                       token_accuracy=[float(r["token_accuracy"]) for r in rows])
        for o, (at, names) in schemes.items():
            for s in names:
                lz = np.array([-np.inf if f["sampled"][w][s] is None else f["sampled"][w][s] for w in at])
                # greedy: its p_z is 1 (log 0) when it emits the suffix, else 0: the exact match at o
                hit = lz > -1e-6 if s == "greedy" else extractable(lz, n, p)
                per[f"np@{o}:{s}"] = [float(x) for x in hit]
        for m in attacks:
            per[f"mia:{m}"] = ([f["mia"][k][m] for k in members], [f["mia"][k][m] for k in nonmembers])
    questions = []
    if docs:
        questions += [Question("em", "EM", "binary", per_document("em"), "{:+.0%}"),
                      Question("rougeL", "RougeL", "number", per_document("rougeL")),
                      Question("token_accuracy", "token accuracy", "number", per_document("token_accuracy"))]
    where = (lambda o: f" @{o}") if len(schemes) > 1 else (lambda o: "")
    questions += [Question(f"np@{o}:{s}", (f"EM @{o}" if s == "greedy" else f"({n}, {p})-extractable {s}")
                           + ("" if s == "greedy" else where(o)), "binary", per_document(f"np@{o}:{s}"),
                           "{:+.0%}") for o, (_, names) in schemes.items() for s in names]
    questions += [Question(f"mia:{m}", f"MIA AUC {m}", "auc", per_document(f"mia:{m}")) for m in attacks]
    counts = {"documents": len(docs), "windows": {str(o): len(at) for o, (at, _) in schemes.items()},
              "members": len(members) if attacks else 0, "nonmembers": len(nonmembers) if attacks else 0}
    return {"per_document": values[0]}, {"per_document": values[1]}, questions, counts


def folder_table(folders: Mapping[str, Path], pairs: Sequence[tuple[str, str]], *, title: str = "",
                 label: str = "run", n: int = 1000, p: float = 0.5, bootstrap: int = 1000, seed: int = 0,
                 extra: Mapping[str, Mapping[str, Mapping[str, float]]] | None = None,
                 extra_questions: Sequence[Question] = ()
                 ) -> tuple[dict[str, Any] | None, dict[str, Any], list[str]]:
    """An experiment's paired table of its sub-runs' result folders: each (row, reference) of `pairs`
    (names of `folders`) tested on what both scored (memorization.paired.paired_table's triple).
    `extra[name]` adds values the folders do not hold ({question key: {document id: value}}, e.g. exact
    match after an earlier pass), paired by id and asked by `extra_questions`, first. A folder that cannot
    be read or paired leaves its row out with a note saying why: a report is never lost to one run's
    files."""
    read: dict[str, Any] = {}
    notes: list[str] = []
    for name in dict.fromkeys(x for pr in pairs for x in pr):
        try:
            read[name] = read_folder(Path(folders[name]))
        except ConfigError as e:
            notes.append(f"No paired tests for {name}: {e}")
    answers: dict[str, Any] = {}
    aligned: dict[str, Any] = {}
    questions: dict[str, Question] = {}
    kept = []
    for name, ref in pairs:
        if name not in read or ref not in read:
            continue
        try:
            answers[name], aligned[name], asked, _ = pair(ref, read[ref], name, read[name], n, p)
        except ConfigError as e:
            notes.append(f"No paired tests for {name} against {ref}: {e}")
            continue
        if extra and name in extra and ref in extra:
            more, more_ref = align(extra[name], extra[ref])
            answers[name]["per_document"].update(more["per_document"])
            aligned[name]["per_document"].update(more_ref["per_document"])
            asked = [q for q in extra_questions if q.key in more["per_document"]] + asked
        if asked:
            questions.update({q.key: q for q in asked})
            kept.append((name, ref))
        else:
            notes.append(f"No paired tests for {name}: it shares no scored document with {ref}.")
    if not kept:
        return None, {}, notes
    order = [q for q in extra_questions if q.key in questions]
    order += [q for k, q in questions.items() if all(k != x.key for x in order)]
    table, tests, more = paired_table(answers, kept, order, label=label, resamples=bootstrap, seed=seed,
                                      aligned=aligned, title=title)
    return table, tests, notes + more


__all__ = ["FILES", "folder_table", "pair", "read_folder"]
