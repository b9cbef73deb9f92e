"""`memorize compare REF RUN [RUN ...]`: does RUN memorize less (or more) than REF, document by document?

Any folders that hold per-document result files can be compared: a `memorize train` or `memorize demo`
run, a `memorize eval --out` folder, an experiment's sub-run that scored itself in place
(pretrained-memorization's OUT/runs/NAME; mitigations' arms keep their answers in evals.json and test
them in their own report). It reads their per-document result files
(memorization.compare.folders) and tests each RUN against REF on the documents those two scored
(memorization.paired: exact McNemar, bootstrap + permutation, paired-bootstrap AUC; Benjamini-Hochberg over
the table). The table is printed; with --out it is also written as report.json and report.md.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memorization.compare.folders import pair, read_folder
from memorization.outputs import check_writable, write_files
from memorization.paired import Question, paired_table
from memorization.report import markdown_table, text_table
from memorize_core import fail

WRITES = ("report.json", "report.md")  # what --out receives (and --overwrite replaces)


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
        answers[name], aligned[name], asked, counts[name] = pair(ref_name, folders[ref_name], name,
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
