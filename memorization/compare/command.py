"""`memorize compare REF RUN [RUN ...]`: does RUN memorize less (or more) than REF, document by document?

Any folders that hold per-document result files can be compared: a `memorize train` or `memorize demo`
run, a `memorize eval --out` folder, an experiment's sub-run that scored itself in place
(pretrained-memorization's OUT/runs/NAME; mitigations' arms keep their answers in evals.json and test
them in their own report). From each it reads
  extraction.jsonl  the greedy suffix of every document: exact match, RougeL, token accuracy
  sampled.jsonl     log p_z per sampling scheme of every (offset, document): (n, p)-extractable or not
                    (greedy's row is the exact match already tested)
  mia.jsonl         every attack's score of every member and non-member: the attack's AUC
and tests each RUN against REF on the documents those two scored (memorization.paired: exact McNemar,
bootstrap + permutation, paired-bootstrap AUC; Benjamini-Hochberg over the table). A document scored against
different prefix or target tokens in two folders is refused: they did not ask the same question (checked
where both hold extraction.jsonl: sampled.jsonl and mia.jsonl rows carry no tokens, only ids). The table is
printed; with --out it is also written as report.json and report.md.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from evals.mia import METHODS
from evals.sampling import extractable
from memorization.outputs import check_writable, write_files
from memorization.paired import Question, paired_table, per_document
from memorization.report import markdown_table, text_table
from memorize_core import fail

FILES = ("extraction.jsonl", "sampled.jsonl", "mia.jsonl")
WRITES = ("report.json", "report.md")  # what --out receives (and --overwrite replaces)


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


def _pair(ref_name: str, ref: dict[str, dict[Any, Any]], name: str, run: dict[str, dict[Any, Any]], n: int,
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


def _names(paths: Sequence[Path]) -> list[str]:
    """Short names: each folder's last part, else its path as given where two would clash."""
    short = [p.name or str(p) for p in paths]
    return short if len(set(short)) == len(short) else [str(p) for p in paths]


def compare_folders(reference: str, runs: Sequence[str], *, n: int = 1000, p: float = 0.5,
                    bootstrap: int = 1000, seed: int = 0, out: str | None = None,
                    overwrite: bool = False) -> dict[str, Any]:
    """Test every folder of `runs` against `reference`, each on the documents it and the reference both
    scored; the report."""
    if not runs:
        raise fail("RUN", "[]", "name at least one folder to compare with the reference")
    paths = [Path(reference), *map(Path, runs)]
    if len({pth.resolve() for pth in paths}) < len(paths):
        raise fail("RUN", [str(pth) for pth in paths], "names one folder twice; compare different runs")
    if isinstance(bootstrap, bool) or not isinstance(bootstrap, int) or bootstrap < 1:
        raise fail("--bootstrap", bootstrap, "pass the number of resamples, an integer >= 1, e.g. 1000")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise fail("--seed", seed, "pass an integer seed >= 0, e.g. 0")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise fail("--n", n, "the number of draws must be an integer >= 1, e.g. 1000")
    if not 0 < p < 1:
        raise fail("--p", p, "the probability must be in (0, 1), e.g. 0.5")
    if out is not None:
        target = Path(out)
        if any(target.resolve() == pth.resolve() for pth in paths):
            raise fail("--out", out, "is one of the compared folders; write the comparison to a folder of "
                       "its own")
        check_writable("--out", target)
        taken = [f for f in WRITES if (target / f).exists()]
        if taken and not overwrite:
            raise fail("--out", out, f"already holds {', '.join(taken)}; choose a new folder or pass "
                       "--overwrite")
    names = _names(paths)
    folders = {name: read_folder(pth) for name, pth in zip(names, paths)}
    ref_name = names[0]
    answers: dict[str, Any] = {}
    aligned: dict[str, Any] = {}
    questions: dict[str, Question] = {}
    counts: dict[str, dict[str, int]] = {}
    for name in names[1:]:
        answers[name], aligned[name], asked, counts[name] = _pair(ref_name, folders[ref_name], name,
                                                                  folders[name], n, p)
        if not asked:
            raise fail("RUN", str(paths[names.index(name)]), f"shares no scored document with {ref_name} "
                       "(no extraction, sampled or MIA rows in common); compare runs evaluated on the same "
                       "corpus and split")
        questions.update({q.key: q for q in asked})
    table, tests, paired_notes = paired_table(answers, [(name, ref_name) for name in names[1:]],
                                              list(questions.values()), label="run", resamples=bootstrap,
                                              seed=seed, aligned=aligned)
    if table is None:  # every run answers some question: only answers that cannot be paired get here
        raise fail("RUN", names[1:], "; ".join(paired_notes) or "no test could be run against the reference")
    scored = []
    for name, c in counts.items():
        parts = [f"{c['documents']} documents (greedy)"] if c["documents"] else []
        parts += ["sampled at offset " + ", ".join(f"{o}: {k}" for o, k in c["windows"].items())
                  + f" ((n, p) = ({n}, {p}))"] if c["windows"] else []
        parts += [f"{c['members']} members, {c['nonmembers']} non-members (MIA)"] if c["members"] else []
        scored.append(f"{name}: {', '.join(parts)}")
    report = {"title": table["title"], "reference": str(paths[0]), "runs": [str(pth) for pth in paths[1:]],
              "names": names, "counts": counts, "np": {"n": n, "p": p}, "bootstrap": bootstrap, "seed": seed,
              "tests": tests, "rows": table["rows"], "columns": [list(c) for c in table["columns"]],
              "notes": [f"Paired with {ref_name} on the documents both scored: {'; '.join(scored)}.",
                        *paired_notes]}
    print(text_table(table["rows"], table["columns"]))
    for line in report["notes"]:
        print(f"- {line}")
    if out is not None:
        md = [f"# {table['title']}", "", markdown_table(table["rows"], table["columns"]), ""]
        md += [f"- {line}" for line in report["notes"]] + [""]
        files = {"report.json": json.dumps(report, indent=2) + "\n", "report.md": "\n".join(md)}
        write_files(Path(out), files, replace=WRITES)
        print(f"\nreport: {Path(out) / 'report.md'}")
    return report


def cmd_compare(args: Any) -> int:
    """The CLI entry (memorization.cli)."""
    compare_folders(args.reference, args.runs, n=args.n, p=args.p, bootstrap=args.bootstrap, seed=args.seed,
                    out=args.out, overwrite=args.overwrite)
    return 0
