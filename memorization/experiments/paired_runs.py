"""Per-document paired tests of an experiment's sub-runs from the result files each one wrote (OUT/runs/NAME:
extraction.jsonl, sampled.jsonl, mia.jsonl), as one report table; what `memorize compare` does by hand."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from memorization.compare.folders import folder_table
from memorization.config import RunConfig
from memorization.experiments.reporting import Table
from memorization.experiments.runner import Experiment
from memorization.paired import Question


def against(names: Sequence[str], reference: str) -> list[tuple[str, str]]:
    """(run, reference) for every other run, or none when no run is the reference."""
    return [(n, reference) for n in names if n != reference] if reference in names else []


def paired_runs(exp: Experiment, pairs: Sequence[tuple[str, str]], base: RunConfig, *, title: str = "",
                extra: dict[str, dict[str, dict[str, float]]] | None = None,
                extra_questions: Sequence[Question] = ()) -> tuple[list[Table], dict[str, Any], list[str]]:
    """([the table] or [] when no pair could be tested, {run: {question: test}}, notes): each (run,
    reference) of `pairs`, sub-runs of `exp`, on the documents both scored (and on `extra`, values by
    document id the folders do not hold: compare.folders.folder_table); (n, p) from the largest of
    base.eval.np_ns and np_p, the bootstrap seeded by base.seed. A per-seed table: replicates keep it in
    each seed's report."""
    if not pairs:
        return [], {}, []
    dirs = {name: exp.run_dir(name) for pr in pairs for name in pr}
    table, tests, notes = folder_table(dirs, pairs, title=title, n=max(base.eval.np_ns), p=base.eval.np_p,
                                       seed=base.seed, extra=extra, extra_questions=extra_questions)
    return ([Table(**table, per_seed=True)] if table else []), tests, notes


__all__ = ["against", "paired_runs"]
