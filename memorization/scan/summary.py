"""The report of a corpus scan: report.json, report.md and three PNGs, built from the written parts.

- the exact-match rate with a 95% Wilson interval, mean leading-match length, token accuracy, suffix
  loss (and, with --generate, the mean memorization score and RougeL);
- the distribution of memorization scores (Biderman et al. 2023's fraction of the S continuation tokens
  reproduced, with --generate; else the leading-match fraction lead / S, a lower bound of it);
- the exact-match rate by position in the source (training order, in 20 bins of rows);
- the rate by duplicate count, when the rows carry one (--manifest, or --count-key on JSONL);
- the top memorized windows as text (exact first, then by leading-match length and suffix loss).
The parts are read column by column, so the report of a million rows needs a few of its columns only.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from memorization.scan.parts import PARTS, PNGS, read_parts

POSITION_BINS = 20
Z95 = 1.959963984540054


def wilson(k: int, n: int) -> list[float]:
    """95% Wilson score interval of a rate k / n ([nan, nan] for n = 0)."""
    if n == 0:
        return [math.nan, math.nan]
    p = k / n
    den = 1 + Z95 ** 2 / n
    mid = (p + Z95 ** 2 / (2 * n)) / den
    half = Z95 * math.sqrt(p * (1 - p) / n + Z95 ** 2 / (4 * n * n)) / den
    return [0.0 if k == 0 else max(0.0, mid - half), 1.0 if k == n else min(1.0, mid + half)]


def _columns(out: Path, fmt: str, generate: bool) -> dict[str, np.ndarray]:
    names = ["row", "exact_match", "lead", "token_accuracy", "suffix_loss", "count"]
    names += ["memorization_score", "rougeL"] if generate else []
    if fmt == "parquet" and any((out / PARTS).glob("part-*.parquet")):  # columnar, no Python objects
        table = pq.read_table(out / PARTS, columns=names)
        cols = {c: table.column(c).to_numpy() for c in names if c != "count"}
        return {**cols, "count": table.column("count").fill_null(-1).to_numpy().astype(np.int64)}
    cols: dict[str, list] = {c: [] for c in names}
    for part in read_parts(out, fmt, names):
        for c in names:
            cols[c] += part[c]
    count = np.array([-1 if v is None else v for v in cols.pop("count")], dtype=np.int64)
    return {**{c: np.asarray(v) for c, v in cols.items()}, "count": count}


def _top(out: Path, fmt: str, order: list[int], n: int, text: Callable[[list[int]], str]) -> list[dict]:
    want = set(order[:n])
    found: dict[int, dict] = {}
    names = ["row", "doc_id", "doc_offset", "exact_match", "lead", "suffix_loss", "prefix_ids", "suffix_ids"]
    for part in read_parts(out, fmt, names):
        for i, row in enumerate(part["row"]):
            if row in want:
                r = {c: part[c][i] for c in names}
                r["prefix"], r["suffix"] = text(r.pop("prefix_ids")), text(r.pop("suffix_ids"))
                found[row] = r
    return [found[r] for r in order[:n] if r in found]


def build_report(out: Path, *, fmt: str, suffix: int, generate: bool, header: dict[str, Any],
                 text: Callable[[list[int]], str], top: int = 20) -> dict[str, Any]:
    """The report dict of the scan written in OUT (see the module docstring)."""
    c = _columns(out, fmt, generate)
    n = len(c["row"])
    k = int(c["exact_match"].sum()) if n else 0
    score = c["memorization_score"] if generate else (c["lead"] / suffix if n else np.zeros(0))
    summary = {"windows": n, "exact_matches": k, "exact_match_rate": k / n if n else math.nan,
               "exact_match_ci95": wilson(k, n),
               **{f"{m}_mean": float(c[m].mean()) if n else math.nan
                  for m in ("lead", "token_accuracy", "suffix_loss") + (("memorization_score", "rougeL")
                                                                        if generate else ())}}
    edges = np.linspace(0, 1, suffix + 2)  # one bin per possible fraction 0, 1/S, ..., 1
    hist = np.histogram(score, bins=edges)[0].tolist() if n else []
    order_rows = np.argsort(c["row"]) if n else np.zeros(0, int)
    positions = []
    for chunk in np.array_split(order_rows, min(POSITION_BINS, n)) if n else []:
        kk, nn = int(c["exact_match"][chunk].sum()), len(chunk)
        positions.append({"first_row": int(c["row"][chunk[0]]), "last_row": int(c["row"][chunk[-1]]),
                          "windows": nn, "exact_match_rate": kk / nn, "ci95": wilson(kk, nn)})
    by_count = []
    for value in sorted(set(c["count"].tolist()) - {-1}):
        sel = c["count"] == value
        kk, nn = int(c["exact_match"][sel].sum()), int(sel.sum())
        by_count.append({"count": value, "windows": nn, "exact_match_rate": kk / nn, "ci95": wilson(kk, nn)})
    rank = sorted(range(n), key=lambda i: (-int(c["exact_match"][i]), -int(c["lead"][i]),
                                           float(c["suffix_loss"][i])))
    top_rows = _top(out, fmt, [int(c["row"][i]) for i in rank], top, text) if n else []
    return {**header, "summary": summary,
            "score_distribution": {"score": "memorization_score" if generate else "lead / suffix",
                                   "bins": [round(float(e), 6) for e in edges[:-1]], "windows": hist},
            "by_position": positions, "by_count": by_count, "top": top_rows}


def _ci(rate: float, ci: list[float]) -> str:
    return f"{rate:.4f} [{ci[0]:.4f}, {ci[1]:.4f}]"


def markdown(report: dict[str, Any]) -> str:
    """report.md: the summary, rate by position and by duplicate count, the top memorized windows."""
    s = report["summary"]
    sel = report["selection"]
    lines = [f"# memorize scan: `{report['model']}` on `{report['data']}`", "",
             f"Windows of {sel['prefix']} prefix + {sel['suffix']} suffix tokens (offsets {sel['offsets']}, "
             f"seq-len {sel['seq_len']}); {report['sequences']} sequences read, {report['short']} shorter "
             f"than prefix + suffix skipped; grid {report['grid']}; {report['seconds']:.1f} s.", "",
             "| metric | value |", "|---|---|",
             f"| windows | {s['windows']} |", f"| exact matches | {s['exact_matches']} |",
             f"| exact-match rate [95% CI] | {_ci(s['exact_match_rate'], s['exact_match_ci95'])} |"]
    lines += [f"| {k.removesuffix('_mean')} (mean) | {v:.4f} |" for k, v in s.items() if k.endswith("_mean")]
    lines += ["", f"![score distribution]({PNGS[0]}) ![by position]({PNGS[1]})", "",
              "## Exact match by position in the source (training order)", "",
              "| rows | windows | exact-match rate [95% CI] |", "|---|---|---|"]
    lines += [f"| {p['first_row']}–{p['last_row']} | {p['windows']} | "
              f"{_ci(p['exact_match_rate'], p['ci95'])} |" for p in report["by_position"]]
    if report["by_count"]:
        lines += ["", "## Exact match by duplicate count", "", f"![by count]({PNGS[2]})", "",
                  "| count | windows | exact-match rate [95% CI] |", "|---|---|---|"]
        lines += [f"| {b['count']} | {b['windows']} | {_ci(b['exact_match_rate'], b['ci95'])} |"
                  for b in report["by_count"]]
    lines += ["", "## Top memorized windows", "", "| row | doc | offset | lead | loss | prefix | suffix |",
              "|---|---|---|---|---|---|---|"]
    for t in report["top"]:
        cells = [str(t["row"]), str(t["doc_id"]), str(t["doc_offset"]), str(t["lead"]),
                 f"{t['suffix_loss']:.3f}", _cell(t["prefix"]), _cell(t["suffix"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:200]


def plot(report: dict[str, Any], folder: Path) -> list[Path]:
    """The three PNGs (the duplicate-count one only when rows carry counts); their paths."""
    import matplotlib  # deferred: +0.5 s with pyplot; only the report needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: after the Agg backend is chosen

    paths = []
    dist, pos, cnt = report["score_distribution"], report["by_position"], report["by_count"]

    def scores(ax: Any) -> None:
        ax.bar(dist["bins"], dist["windows"], width=0.9 / max(1, len(dist["bins"])), align="edge")
        ax.set(xlabel=dist["score"], ylabel="windows", yscale="log", title="Memorization scores")

    def position(ax: Any) -> None:
        ax.plot([p["first_row"] for p in pos], [p["exact_match_rate"] for p in pos], marker="o")
        ax.set(xlabel="row (training order)", ylabel="exact-match rate", title="Exact match by position")

    def counts(ax: Any) -> None:
        ax.plot([b["count"] for b in cnt], [b["exact_match_rate"] for b in cnt], marker="o")
        ax.set(xscale="log", xlabel="duplicate count", ylabel="exact-match rate",
               title="Exact match by duplicate count")

    figs = [(PNGS[0], scores), (PNGS[1], position)] + ([(PNGS[2], counts)] if cnt else [])
    for name, draw in figs:
        fig, ax = plt.subplots(figsize=(6, 4))
        draw(ax)
        fig.tight_layout()
        fig.savefig(folder / name, dpi=100)
        plt.close(fig)
        paths.append(folder / name)
    return paths


def dumps(report: dict[str, Any]) -> str:
    """report.json's text (NaN written as null)."""
    def clean(v: Any) -> Any:
        if isinstance(v, float) and math.isnan(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, list):
            return [clean(x) for x in v]
        if isinstance(v, np.generic):
            return clean(v.item())
        return v
    return json.dumps(clean(report), indent=1) + "\n"


__all__ = ["build_report", "dumps", "markdown", "plot", "wilson"]
