"""`memorize compare REF RUN [RUN ...]`: does RUN memorize less (or more) than REF, document by document?

Any folders that hold per-document result files can be compared: a `memorize train` or `memorize demo`
run, a `memorize eval --out` folder, an experiment's sub-run that scored itself in place
(pretrained-memorization's OUT/runs/NAME; mitigations' arms keep their answers in evals.json and test
them in their own report). From each it reads
  extraction.jsonl  the greedy suffix of every document: exact match, RougeL, token accuracy
  sampled.jsonl     log p_z per sampling scheme of every (offset, document): (n, p)-extractable or not
                    (greedy's row is the exact match already tested)
  mia.jsonl         every attack's score of every member and non-member: the attack's AUC
and tests each RUN against REF on the documents every folder scored (memorization.paired: exact McNemar,
bootstrap + Wilcoxon, paired-bootstrap AUC; Benjamini-Hochberg over the table). A document scored against
different target tokens in two folders is refused: they did not ask the same question. The table is
printed; with --out it is also written as report.json and report.md.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from evals.sampling import extractable
from memorization.outputs import check_writable, write_files
from memorization.paired import Question, paired_table, per_document
from memorization.report import markdown_table, text_table
from memorize_core import fail

FILES = ("extraction.jsonl", "sampled.jsonl", "mia.jsonl")
WRITES = ("report.json", "report.md")  # what --out receives (and --overwrite replaces)


def _lines(path: Path) -> list[dict[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise fail(str(path), f"line {i}", f"is not JSON ({e.msg}); the file is damaged: "
                               "score the model again (memorize eval --out)") from None
    return rows


def read_folder(path: Path) -> dict[str, dict[Any, Any]]:
    """A folder's per-document answers: {"extraction": {doc: row}, "sampled": {(offset, doc): {scheme:
    log p_z}}, "mia": {(id, member): {attack: score}}} (a part missing where its file is)."""
    if not path.is_dir():
        raise fail("RUN", str(path), "is not a folder; pass a run folder (memorize train / demo, an "
                   "experiment's OUT/runs/NAME) or a memorize eval --out folder")
    got: dict[str, dict[Any, Any]] = {}
    if (path / "extraction.jsonl").is_file():
        got["extraction"] = {str(r["doc"]): r for r in _lines(path / "extraction.jsonl")}
    if (path / "sampled.jsonl").is_file():
        got["sampled"] = {(int(r["offset"]), str(r["doc"])): r["logpz"]
                          for r in _lines(path / "sampled.jsonl")}
    if (path / "mia.jsonl").is_file():
        got["mia"] = {(str(r["id"]), bool(r["member"])): {k: v for k, v in r.items()
                                                          if k not in ("id", "member")}
                      for r in _lines(path / "mia.jsonl")}
    if not got:
        raise fail("RUN", str(path), f"holds none of {', '.join(FILES)}; train with evaluation on, or score "
                   "the model with memorize eval --out DIR and compare DIR")
    return got


def _common(folders: dict[str, dict[str, dict[Any, Any]]], part: str) -> list:
    """The keys of `part` every folder holds, in the first folder's order ([] if any folder lacks it)."""
    parts = [f.get(part) for f in folders.values()]
    if any(p is None for p in parts):
        return []
    first, *rest = parts
    return [k for k in first if all(k in p for p in rest)]


def _check_targets(folders: dict[str, dict[str, dict[Any, Any]]], docs: list[str]) -> None:
    ref_name, ref = next(iter(folders.items()))
    for name, f in list(folders.items())[1:]:
        for doc in docs:
            a, b = ref["extraction"][doc], f["extraction"][doc]
            if a.get("target_ids") != b.get("target_ids") or a.get("prefix_ids") != b.get("prefix_ids"):
                raise fail("RUN", name, f"scored document {doc!r} with another prefix or suffix than "
                           f"{ref_name}; compare runs evaluated with the same eval.prefix / eval.suffix on "
                           "the same corpus")


def _answers(folders: dict[str, dict[str, dict[Any, Any]]], n: int, p: float
             ) -> tuple[dict[str, dict[str, Any]], list[Question], dict[str, int]]:
    """Each folder's per-document values on the shared documents, the questions, and how many documents
    each part pairs."""
    docs = _common(folders, "extraction")
    if docs:
        _check_targets(folders, docs)
    windows = _common(folders, "sampled")
    scored = _common(folders, "mia")
    schemes = [s for s in (folders[next(iter(folders))]["sampled"][windows[0]] if windows else {})
               if s != "greedy" and all(s in f["sampled"][windows[0]] for f in folders.values())]
    offsets = sorted({o for o, _ in windows})
    attacks = [m for m in (folders[next(iter(folders))]["mia"][scored[0]] if scored else {})
               if all(m in f["mia"][scored[0]] for f in folders.values())]
    members = [k for k in scored if k[1]]
    nonmembers = [k for k in scored if not k[1]]
    if len(members) < 2 or len(nonmembers) < 2:
        attacks = []
    answers: dict[str, dict[str, Any]] = {}
    for name, f in folders.items():
        per: dict[str, Any] = {}
        if docs:
            rows = [f["extraction"][d] for d in docs]
            per.update(em=[float(r["exact_match"]) for r in rows], rougeL=[float(r["rougeL"]) for r in rows],
                       token_accuracy=[float(r["token_accuracy"]) for r in rows])
        for o in offsets:
            at = [w for w in windows if w[0] == o]
            for s in schemes:
                lz = np.array([-np.inf if f["sampled"][w][s] is None else f["sampled"][w][s] for w in at])
                per[f"np@{o}:{s}"] = [float(x) for x in extractable(lz, n, p)]
        for m in attacks:
            per[f"mia:{m}"] = ([float(f["mia"][k][m]) for k in members],
                               [float(f["mia"][k][m]) for k in nonmembers])
        answers[name] = {"per_document": per}
    questions = []
    if docs:
        questions += [Question("em", "EM", "binary", per_document("em"), "{:+.0%}"),
                      Question("rougeL", "RougeL", "number", per_document("rougeL")),
                      Question("token_accuracy", "token accuracy", "number", per_document("token_accuracy"))]
    at_title = (lambda o: f" @{o}") if len(offsets) > 1 else (lambda o: "")
    questions += [Question(f"np@{o}:{s}", f"({n}, {p})-extractable {s}{at_title(o)}", "binary",
                           per_document(f"np@{o}:{s}"), "{:+.0%}") for o in offsets for s in schemes]
    questions += [Question(f"mia:{m}", f"MIA AUC {m}", "auc", per_document(f"mia:{m}")) for m in attacks]
    counts = {"documents": len(docs),
              "windows": len([w for w in windows if w[0] == offsets[0]]) if offsets and schemes else 0,
              "members": len(members) if attacks else 0, "nonmembers": len(nonmembers) if attacks else 0}
    return answers, questions, counts


def _names(paths: Sequence[Path]) -> list[str]:
    """Short names: each folder's last part, else its path as given where two would clash."""
    short = [p.name or str(p) for p in paths]
    return short if len(set(short)) == len(short) else [str(p) for p in paths]


def compare_folders(reference: str, runs: Sequence[str], *, n: int = 1000, p: float = 0.5,
                    bootstrap: int = 1000, seed: int = 0, out: str | None = None,
                    overwrite: bool = False) -> dict[str, Any]:
    """Test every folder of `runs` against `reference` on the documents all of them scored; the report."""
    if not runs:
        raise fail("RUN", "[]", "name at least one folder to compare with the reference")
    paths = [Path(reference), *map(Path, runs)]
    if len({pth.resolve() for pth in paths}) < len(paths):
        raise fail("RUN", [str(pth) for pth in paths], "names one folder twice; compare different runs")
    if isinstance(bootstrap, bool) or not isinstance(bootstrap, int) or bootstrap < 1:
        raise fail("--bootstrap", bootstrap, "pass the number of resamples, an integer >= 1, e.g. 1000")
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
    answers, questions, counts = _answers(folders, n, p)
    if not questions:
        raise fail("RUN", [str(pth) for pth in paths], "share no scored document (no extraction, sampled or "
                   "MIA rows in common); compare runs evaluated on the same corpus and split")
    table, tests, paired_notes = paired_table(answers, [(name, names[0]) for name in names[1:]], questions,
                                              label="run", resamples=bootstrap, seed=seed)
    if table is None:  # every folder answers every question asked: only a run with no test at all
        raise fail("RUN", names[1:], "no test could be run against the reference")
    scored = [f"{counts['documents']} documents (greedy extraction)"] if counts["documents"] else []
    scored += [f"{counts['windows']} documents per offset (sampled; (n, p) = ({n}, {p}))"] \
        if counts["windows"] else []
    scored += [f"{counts['members']} members and {counts['nonmembers']} non-members (MIA)"] \
        if counts["members"] else []
    report = {"title": table["title"], "reference": str(paths[0]), "runs": [str(pth) for pth in paths[1:]],
              "names": names, "counts": counts, "np": {"n": n, "p": p}, "bootstrap": bootstrap, "seed": seed,
              "tests": tests, "rows": table["rows"], "columns": [list(c) for c in table["columns"]],
              "notes": [f"Scored in every folder: {'; '.join(scored)}; documents only some folders scored "
                        "are left out.", *paired_notes]}
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
