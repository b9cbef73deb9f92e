"""Experiment outputs: report.json, report.md, PNG figures, the printed table and one W&B run."""
from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from axonn.config import to_dict
from memorization.report import markdown_table, text_table
from memorization.tracking import WandbSink

Columns = Sequence[tuple[str, str, str]]  # (key, title, format) as memorization.report uses


class Shown(str):
    """A cell shown as text that stands for one number (an AUC with its CI, an accuracy ± its SE, an
    audit bound with its counts): report.json keeps that number beside the text as `<key>_value`, so
    replicates over seeds average it (memorization.experiments.replicates)."""

    value: float | None

    def __new__(cls, text: str, value: float | None) -> Shown:
        cell = super().__new__(cls, text)
        cell.value = value
        return cell

    def __getnewargs__(self) -> tuple[str, float | None]:  # copy and pickle rebuild it with its number
        return str(self), self.value


@dataclass
class Table:
    """A titled table of row dicts rendered with `columns`; `index` names the columns that say which
    row is which (default: the first column), so the same row is found in another seed's table. Its first
    name is the row's label (what replicates' differences are taken between: goldfish vs standard), the
    others the context they are paired within (the same model size, pass or copy count). `per_seed`: the
    table holds tests within this one run (p-values: memorization.paired), which replicates
    over seeds do not average; the averaged report points to each seed's."""

    title: str
    rows: list[dict[str, Any]]
    columns: Columns
    index: tuple[str, ...] = ()
    per_seed: bool = False

    def key_columns(self) -> list[str]:
        """The index columns (the first column when none are named)."""
        return list(self.index) or [self.columns[0][0]]


def with_values(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows with each Shown cell's number beside it as `<key>_value` (a twin already there is kept)."""
    out = []
    for row in rows:
        r = dict(row)
        for k, v in row.items():
            if isinstance(v, Shown):
                r.setdefault(f"{k}_value", v.value)
        out.append(r)
    return out


@dataclass
class Outputs:
    """Everything an experiment reports; `write` puts it on disk, in W&B and on the terminal."""

    title: str
    kind: str
    runs: list[dict[str, Any]]
    tables: list[Table]
    notes: list[str] = field(default_factory=list)
    plots: list[Path] = field(default_factory=list)
    samples: list[list[Any]] = field(default_factory=list)
    sample_columns: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def figure(n_panels: int = 1, width: float = 5.5, height: float = 4.0):
    """A matplotlib (fig, axes list) on the Agg backend (no display needed)."""
    import matplotlib  # deferred: matplotlib +0.7 s

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: matplotlib +0.7 s

    fig, axes = plt.subplots(1, n_panels, figsize=(width * n_panels, height), squeeze=False)
    return fig, list(axes[0])


def save(fig: Any, path: Path) -> Path:
    """Save a figure compactly (small PNGs keep docs commit-sized) and close it."""
    import matplotlib.pyplot as plt  # deferred: matplotlib +0.7 s

    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


@dataclass
class Point:
    """One labelled point of a scatter panel: (x, y), an optional y error bar, a marker area."""

    label: str
    x: float | None
    y: float | None
    err: float | None = None
    size: float = 80.0


def scatter_panels(panels: Sequence[tuple[str, str, Sequence[Point]]], title: str, path: Path) -> Path:
    """One scatter panel per (x label, y label, points), each point annotated with its label; points
    without an x or y are left out."""
    fig, axes = figure(len(panels), width=5.2)
    for ax, (xlabel, ylabel, points) in zip(axes, panels):
        for p in points:
            if p.x is None or p.y is None:
                continue
            ax.scatter([p.x], [p.y], s=p.size, alpha=0.7)
            if p.err:
                ax.errorbar([p.x], [p.y], yerr=[p.err], fmt="none", ecolor="gray", alpha=0.6)
            ax.annotate(p.label, (p.x, p.y), fontsize=7, xytext=(4, 4), textcoords="offset points")
        ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    return save(fig, path)


def bar_panels(names: Sequence[str], metrics: Sequence[tuple[str, Sequence[float | None]]],
               path: Path) -> Path:
    """One bar chart per (title, value per name); a missing value is drawn as 0."""
    fig, axes = figure(len(metrics), width=3.2, height=3.6)
    for ax, (title, values) in zip(axes, metrics):
        ax.bar(range(len(names)), [v or 0 for v in values], color="tab:blue")
        ax.set_xticks(range(len(names)), labels=list(names), rotation=60, ha="right", fontsize=7)
        ax.set_title(title, fontsize=9)
    return save(fig, path)


def json_safe(obj: Any) -> Any:
    """JSON-safe: NaN/inf become null so report.json is strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def write_outputs(out_dir: Path, o: Outputs, exp_cfg: Any, seconds: float) -> dict[str, Any]:
    """Write report.json/report.md, log the W&B run, print the summary table; return the report."""
    report = json_safe({"title": o.title, "kind": o.kind, "name": exp_cfg.name, "seconds": round(seconds, 1),
                     "runs": o.runs, "tables": {t.title: with_values(t.rows) for t in o.tables},
                     "table_specs": {t.title: {"columns": [list(c) for c in t.columns],
                                               "index": t.key_columns(),
                                               **({"per_seed": True} if t.per_seed else {})}
                                     for t in o.tables},
                     "plots": [p.name for p in o.plots], "notes": o.notes, "config": to_dict(exp_cfg),
                     **o.extra})
    report["wandb"] = _log_wandb(out_dir, o, exp_cfg, seconds)
    (out_dir / "report.json").write_text(json.dumps(report, indent=2))
    md = [f"# {o.title}", ""]
    for t in o.tables:
        md += [f"## {t.title}", "", markdown_table(t.rows, t.columns), ""]
    md += [f"- {n}" for n in o.notes] + [f"- Wall time: {seconds:.0f} s.", ""]
    md += [f"![{p.stem}]({p.name})\n" for p in o.plots]
    own = sorted((out_dir / "runs").glob("*/report.md"))  # each sub-run's report (memorize train's)
    if own:
        md += ["## Each run's own report", ""]
        md += [f"- [{p.parent.name}]({p.relative_to(out_dir).as_posix()})" for p in own] + [""]
    (out_dir / "report.md").write_text("\n".join(md))
    main = o.tables[0]
    print()
    print(text_table(main.rows, main.columns))
    print(f"\nreport: {out_dir / 'report.md'}  ({seconds:.0f} s)", flush=True)
    return report


def _log_wandb(out_dir: Path, o: Outputs, exp_cfg: Any, seconds: float) -> str | None:
    """One W&B run for the experiment: summary tables, sample generations and the plots."""
    wcfg = exp_cfg.base.wandb
    wcfg = replace(wcfg, group=wcfg.group or exp_cfg.name)
    sink = WandbSink(wcfg, name=exp_cfg.name, out_dir=out_dir, config=to_dict(exp_cfg))
    if sink.run is None:
        return None
    for t in o.tables:
        keys = [k for k, _, _ in t.columns]
        rows = [[_cell(r.get(k)) for k in keys] for r in t.rows]
        sink.log_table(table_key(t.title), keys, rows)
    if o.samples:
        sink.log_table("samples", o.sample_columns, o.samples)
    for p in o.plots:
        sink.log_image(p.stem, p)
    sink.summary({"seconds": round(seconds, 1), "runs": len(o.runs)})
    where = sink.run_dir
    sink.close()
    return where


def table_key(title: str) -> str:
    """A table's W&B key: its title in lower-case words joined by '_', cut to 60 characters with a digest
    of the whole title (W&B names the table's artifact after it and refuses names over 128 characters)."""
    key = re.sub(r"[^a-z0-9]+", "_", title.lower()).strip("_") or "table"
    return key if len(key) <= 60 else f"{key[:51]}_{hashlib.sha1(title.encode()).hexdigest()[:8]}"


def _cell(v: Any) -> Any:
    return v if isinstance(v, (int, float, str, bool)) or v is None else str(v)

