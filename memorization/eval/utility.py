"""Downstream utility: lm-eval tasks on a model we hold (the bundled offline tasks, or lm-eval's own).

The research layer's glue between the bundled task YAMLs (data_pipelines/tasks, built from real
published data that gensim ships) and the lm-eval adapter that scores with evals' scoring path
(evals/harness.py): `check_tasks` refuses a bad request before any model is loaded, `score_tasks`
runs it (serial or sharded, on every rank), `headline`/`task_table` turn the result into report cells.
"""
from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

from axonn.grid import ProcessGrid
from data_pipelines.downstream import BUNDLED_TASKS, TASK_DIR
from memorize_core import ConfigError, fail

HUB_HINT = ("lm-eval's own tasks (hellaswag, arc_easy, piqa, mmlu, ...) are accepted by name but download "
            "their data from the Hugging Face hub, so they need network")


def parse_tasks(spec: str | Sequence[str] | None) -> list[str]:
    """'a,b' or ['a', 'b'] -> ['a', 'b'] (order kept, duplicates dropped)."""
    if spec is None:
        return []
    parts = spec.split(",") if isinstance(spec, str) else [str(s) for s in spec]
    names = [p.strip() for p in parts if p.strip()]
    return list(dict.fromkeys(names))


def check_tasks(names: Sequence[str], flag: str = "--tasks") -> list[str]:
    """The task names, each bundled or known to lm-eval; else one ConfigError naming the bundled ones."""
    names = parse_tasks(names)
    if not names:
        raise fail(flag, "", f"name at least one task, e.g. {BUNDLED_TASKS[1]}; bundled: "
                   f"{', '.join(BUNDLED_TASKS)}")
    foreign = [n for n in names if n not in BUNDLED_TASKS]
    if foreign:
        known = set(_manager(foreign).all_tasks)
        unknown = [n for n in foreign if n not in known]
        if unknown:
            raise fail(flag, unknown[0], f"is not a bundled task ({', '.join(BUNDLED_TASKS)}) nor one of "
                       f"lm-eval's; {HUB_HINT}")
    return names


# Most in-context examples accepted: published lm-eval results use 0 to 25 (ARC 25, HellaSwag 10, MMLU 5);
# 100 leaves room and still refuses values whose prompts no model's context could hold.
MAX_FEWSHOT = 100


def check_fewshot(value: int | None, flag: str = "--num-fewshot") -> None:
    """None (each task's default) or an integer in [0, MAX_FEWSHOT]."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise fail(flag, value, "pass the number of in-context examples, >= 0 (0 = zero-shot)")
    if value is not None and value > MAX_FEWSHOT:
        raise fail(flag, value, f"must be <= {MAX_FEWSHOT}: every example is a whole question and answer "
                   "in every prompt (published results use 0 to 25); pass e.g. 5")


def _manager(names: Sequence[str]) -> Any:
    from evals.harness import task_manager  # deferred: lm-eval imports in ~3 s

    return task_manager(str(TASK_DIR), defaults=any(n not in BUNDLED_TASKS for n in names))


@contextlib.contextmanager
def stderr_to(path: str | Path | None) -> Iterator[None]:
    """Send file descriptor 2 to `path` (appending) for the block, None: leave it. At the descriptor,
    not sys.stderr, because lm-eval's log lines, tqdm bars and the `git` it runs all write there."""
    if path is None:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "a", encoding="utf-8") as log:
        os.dup2(log.fileno(), 2)
        try:
            with contextlib.redirect_stderr(log):  # where sys.stderr is not descriptor 2 (pytest, IDEs)
                yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def score_tasks(model: Any, tokenizer: Any, names: Sequence[str], *, num_fewshot: int | None = None,
                limit: int | None = None, batch_size: int = 16, grid: ProcessGrid | None = None,
                log: str | Path | None = None) -> dict[str, Any]:
    """lm-eval on `model` (serial, or sharded over `grid`: call on every rank); the run_tasks dict.

    `log`: a file that takes everything lm-eval prints (None: stderr). A hub task that cannot reach
    its data is one ConfigError, not a traceback."""
    from evals.harness import run_tasks  # deferred: lm-eval imports in ~3 s

    names = parse_tasks(names)
    offline = all(n in BUNDLED_TASKS for n in names)
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"} if offline else {}
    try:
        with mock.patch.dict(os.environ, env), stderr_to(log):  # both restored, whatever happens
            return run_tasks(model, tokenizer, names, num_fewshot=num_fewshot, limit=limit,
                             manager=_manager(names), batch_size=batch_size, grid=grid)
    except ConfigError:
        raise
    except (ConnectionError, OSError, TimeoutError) as e:
        hub = [n for n in names if n not in BUNDLED_TASKS]
        raise fail("--tasks", ",".join(hub) or ",".join(names), f"could not load its data "
                   f"({type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}); {HUB_HINT}, "
                   f"or use the bundled offline tasks ({', '.join(BUNDLED_TASKS)})") from None


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The one accuracy a report column shows: the first requested group's, else the first task's
    (acc, acc_stderr, name)."""
    rows = {**result.get("tasks", {}), **result.get("groups", {})}
    order = list(result.get("groups", {})) + list(result.get("tasks", {}))
    for name in order:
        if rows[name].get("acc") is not None:
            return {"task": name, "acc": rows[name]["acc"], "acc_stderr": rows[name].get("acc_stderr")}
    return {"task": None, "acc": None, "acc_stderr": None}


def task_table(result: dict[str, Any]) -> list[str]:
    """Markdown lines: one row per task and group with each metric ± its standard error."""
    rows = [(n, r) for n, r in result.get("groups", {}).items()] + list(result.get("tasks", {}).items())
    metrics = sorted({k for _, r in rows for k in r if k not in ("alias", "n") and not k.endswith("_stderr")
                      and "_stderr[" not in k})
    lines = ["| task | n | shots | " + " | ".join(metrics) + " |", "|---|---|---|" + "---|" * len(metrics)]
    shots = result.get("n_shot", {})
    for name, r in rows:
        cells = []
        for m in metrics:
            v, se = r.get(m), r.get(m.replace("[", "_stderr[", 1) if "[" in m else f"{m}_stderr")
            cells.append("" if v is None else f"{v:.3f}" + (f" ± {se:.3f}" if isinstance(se, float) else ""))
        lines.append(f"| {name} | {r.get('n', '')} | {shots.get(name, '')} | " + " | ".join(cells) + " |")
    return lines
