"""Reports: report.json (every number), report.md (a table a person reads) and PNG plots."""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TABLE_COLUMNS = (
    ("name", "run", "{}"),
    ("loss", "loss", "{}"),
    ("goldfish_k", "k", "{}"),
    ("goldfish_h", "h", "{}"),
    ("docs", "docs", "{}"),
    ("exact_match_rate", "exact match", "{:.1%}"),
    ("rougeL", "RougeL", "{:.3f}"),
    ("token_accuracy", "token acc", "{:.3f}"),
    ("val_loss", "val loss", "{:.3f}"),
)


def format_cell(value: Any, spec: str) -> str:
    """A table cell: `spec` applied to the value, '-' for None, the value as text where spec does not fit."""
    if value is None:
        return "-"
    try:
        return spec.format(value)
    except (ValueError, TypeError):
        return str(value)


def table_rows(runs: Sequence[dict[str, Any]], columns=TABLE_COLUMNS) -> tuple[list[str], list[list[str]]]:
    """Header and formatted rows for the summary table."""
    header = [title for _, title, _ in columns]
    rows = [[format_cell(run.get(key), spec) for key, _, spec in columns] for run in runs]
    return header, rows


def text_table(runs: Sequence[dict[str, Any]], columns=TABLE_COLUMNS) -> str:
    """A fixed-width table for the terminal."""
    header, rows = table_rows(runs, columns)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def markdown_table(runs: Sequence[dict[str, Any]], columns=TABLE_COLUMNS) -> str:
    """A GitHub-flavoured markdown table."""
    header, rows = table_rows(runs, columns)
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The per-step metrics of a metrics.jsonl file (lines a callback logged, which carry no "loss", are
    left out: Trainer.log)."""
    p = Path(path)
    if not p.is_file():
        return []
    rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    return [r for r in rows if "loss" in r]


def plot_runs(runs: Sequence[dict[str, Any]], curves: dict[str, list[dict[str, Any]]],
              path: str | Path) -> Path:
    """Two panels: training loss per step for each run, and extraction metrics per run."""
    import matplotlib  # deferred: +0.1 s, and +0.4 s for pyplot below; only the report plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: +0.4 s import, after the Agg backend is chosen

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, hist in curves.items():
        if hist:
            ax1.plot([m["step"] for m in hist], [m["loss"] for m in hist], label=f"{name} (supervised)")
            dropped = [(m["step"], m["dropped_loss"]) for m in hist if "dropped_loss" in m]
            if dropped:
                ax1.plot(*zip(*dropped), linestyle="--", alpha=0.7, label=f"{name} (dropped tokens)")
    ax1.set_xlabel("optimizer step")
    ax1.set_ylabel("training loss (nats/token)")
    ax1.set_yscale("log")
    ax1.set_title("Training loss")
    ax1.legend(fontsize=8)
    names = [r["name"] for r in runs]
    metrics = [("exact_match_rate", "exact match"), ("rougeL", "RougeL"), ("token_accuracy", "token acc")]
    width = 0.8 / len(metrics)
    for i, (key, label) in enumerate(metrics):
        xs = [j + (i - 1) * width for j in range(len(runs))]
        ax2.bar(xs, [r.get(key) or 0.0 for r in runs], width=width, label=label)
    ax2.set_xticks(range(len(runs)), names)
    ax2.set_ylim(0, 1.05)
    ax2.set_title("Extraction of training documents (greedy)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def write_report(out_dir: str | Path, *, title: str, runs: list[dict[str, Any]], extra: dict[str, Any],
                 curves: dict[str, list[dict[str, Any]]], notes: Sequence[str] = ()) -> dict[str, Path]:
    """Write report.json, report.md and report.png into out_dir."""
    out = Path(out_dir)
    png = plot_runs(runs, curves, out / "report.png")
    payload = {"title": title, "runs": runs, **extra}
    (out / "report.json").write_text(json.dumps(payload, indent=2))
    md = [f"# {title}", "", markdown_table(runs), ""]
    md += [f"- {n}" for n in notes]
    md += ["", f"![training loss and extraction]({png.name})", ""]
    (out / "report.md").write_text("\n".join(md))
    return {"json": out / "report.json", "md": out / "report.md", "png": png}
