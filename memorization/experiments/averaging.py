"""Tables over seeds: rows matched across replicates, each cell averaged with a Student-t interval, and
each row differenced against a reference row of the same seed (memorization.experiments.replicates).

A cell: the mean over the seeds ± t_{(1+c)/2, n-1} · sd / sqrt(n) (sd with n - 1), or the value itself
where every seed agrees. A difference: row minus reference row, seed by seed, then the same interval;
`*` where it excludes 0. Rows are found by their index columns (Table.index) and, where an index repeats
in one seed, by their order under it. A text cell that stands for a number (reporting.Shown, stored as
`<key>_value`) counts as that number. Every averaged or differenced cell keeps its values in seed order
(None where a seed lacks the row or the value) under the row's `stats`.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memorization.experiments.reporting import figure, save
from memorization.report import format_cell

PLOTTED = 4  # columns of the first table drawn
_COST = re.compile(r"seconds|time|rss|peak|params|trainable|steps?$")  # what a run cost, not what it learnt


def interval(values: Sequence[float], confidence: float) -> dict[str, Any]:
    """Mean, sample sd and the half-width of the Student-t interval of `values` (sd and half None for one)."""
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else None
    half = t_quantile(confidence, n) * sd / math.sqrt(n) if sd is not None else None
    return {"n": n, "mean": mean, "sd": sd, "half": half}


def t_quantile(confidence: float, n: int) -> float:
    """t_{(1+c)/2} at n - 1 degrees of freedom (n >= 2)."""
    from scipy.stats import t  # deferred: scipy.stats +0.3 s, only for replicates

    return float(t.ppf((1 + confidence) / 2, n - 1))


def table_specs(reports: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every table's columns and index, in the first report's order (a table only later seeds have, last);
    tests within one seed (`per_seed`: p-values, not figures to average) are left out."""
    specs: dict[str, dict[str, Any]] = {}
    for rep in reports:
        given = rep.get("table_specs") or {}
        for title, rows in rep.get("tables", {}).items():
            if title in specs or given.get(title, {}).get("per_seed"):
                continue
            if title in given:
                specs[title] = {"columns": [tuple(c) for c in given[title]["columns"]],
                                "index": list(given[title]["index"])}
            elif rows:  # a report written before table_specs: every key a column, the first the index
                keys = list(rows[0])
                specs[title] = {"columns": [(k, k, "{}") for k in keys], "index": keys[:1]}
    return specs


def label(row: dict[str, Any], index: Sequence[str]) -> str:
    """The row's name (its first index value) as text: what a reference names."""
    return str(row.get(index[0]))


def match(reports: Sequence[dict[str, Any]], title: str, index: Sequence[str]) -> dict[str, list]:
    """{row key: [that row in seed i, or None]}, in order of first appearance."""
    matched: dict[str, list] = {}
    for i, rep in enumerate(reports):
        seen: dict[str, int] = {}
        for row in rep.get("tables", {}).get(title, []):
            ident = json.dumps([row.get(c) for c in index], default=str)
            key = f"{ident}#{seen.get(ident, 0)}"
            seen[ident] = seen.get(ident, 0) + 1
            matched.setdefault(key, [None] * len(reports))[i] = row
    return matched


def mean_row(cells: list, spec: dict[str, Any], confidence: float) -> dict[str, Any]:
    """One averaged row: each cell the mean ± half-width, or its value where every seed agrees."""
    n = len(cells)
    present = [r for r in cells if r is not None]
    row: dict[str, Any] = {"stats": {}}
    for key, _, fmt in spec["columns"]:
        raw = [r.get(key) for r in present]
        values = [_value(r, key) if r is not None else None for r in cells]
        if all(json.dumps(v, default=str) == json.dumps(raw[0], default=str) for v in raw):
            row[key] = format_cell(raw[0], fmt)
            nums = [v for v in values if v is not None]
            if nums and all(_number(v) for v in nums):  # kept for the plot and report.json
                row["stats"][key] = {**interval(nums, confidence), "values": values}
            continue
        if any(v is not None and not _number(v) for v in values):
            row[key] = text_cell([r.get(key) if r is not None else None for r in cells])
            row["stats"][key] = {"values": [r.get(key) if r else None for r in cells]}
            continue
        nums = [v for v in values if v is not None]
        if not nums:
            row[key] = "-"
            continue
        st = {**interval(nums, confidence), "values": values}
        row["stats"][key] = st
        row[key] = _pm(st, fmt, n)
    if len(present) < n:
        first = spec["columns"][0][0]
        row[first] = f"{row[first]} ({len(present)} of {n})"
    return row


def delta_rows(matched: dict[str, list], spec: dict[str, Any], ref: str, confidence: float) -> list[dict]:
    """Each row minus the reference row with the same other index values, seed by seed; where part of
    the index is no column of the table, its text columns come along (text_cell) to tell rows apart."""
    index = spec["index"]
    hidden = set(index) - {c for c, _, _ in spec["columns"]}
    by_rest = {_rest(key): key for key, cells in matched.items() if label(present(cells), index) == ref}
    out = []
    for key, cells in matched.items():
        ref_key = by_rest.get(_rest(key))
        if ref_key is None or ref_key == key:
            continue
        refs, n = matched[ref_key], len(cells)
        shown = present(cells)
        row: dict[str, Any] = {c: format_cell(shown.get(c), f) for c, _, f in spec["columns"] if c in index}
        both = sum(a is not None and b is not None for a, b in zip(cells, refs))
        if both < n:
            first = spec["columns"][0][0]
            row[first] = f"{row[first]} ({both} of {n})"
        row["stats"] = {}
        for c, _, fmt in spec["columns"]:
            if c in index:
                continue
            if hidden and _text_column(cells, c):  # what tells rows apart where the index is not shown
                row[c] = text_cell([r.get(c) if r is not None else None for r in cells])
                continue
            diffs = [_value(a, c) - _value(b, c) if a is not None and b is not None
                     and _number(_value(a, c)) and _number(_value(b, c)) else None
                     for a, b in zip(cells, refs)]
            nums = [d for d in diffs if d is not None]
            if not nums:
                row[c] = "-"
                continue
            st = {**interval(nums, confidence), "values": diffs}
            st["excludes_zero"] = bool(st["half"] is not None and abs(st["mean"]) > st["half"])
            row["stats"][c] = st
            row[c] = _pm(st, fmt, n, signed=True)
        out.append(row)
    return out


def moved_columns(rows: list[dict], spec: dict[str, Any]) -> list[tuple]:
    """The index columns, the text carried where part of the index is not a column (delta_rows), and those
    in which some row's difference is not 0 in some seed."""
    return [tuple(c) for c in spec["columns"] if c[0] in spec["index"] or any(
        c[0] in r and c[0] not in r["stats"] and r[c[0]] not in ("-", "") or
        any(v not in (None, 0) for v in r["stats"].get(c[0], {}).get("values", [])) for r in rows)]


def text_cell(texts: Sequence[Any]) -> str:
    """The seeds' texts of one cell as one: the text where they agree; where they differ only in their
    numbers, the text with each seed's number in turn ('seen_once (39/42/40)', '?' for a seed without the
    cell); else 'varies'."""
    shown = [None if t is None else str(t) for t in texts]
    given = [t for t in shown if t is not None]
    if len(set(given)) == 1:  # a seed without the row is marked on the row's first cell: '(k of n)'
        return given[0]
    number = re.compile(r"\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
    if not given or len({number.sub("#", t) for t in given}) > 1:
        return "varies"
    found = [number.findall(t) if t is not None else None for t in shown]
    slots = len(found[shown.index(given[0])])
    parts = number.split(given[0])
    cells = ["/".join(f[i] if f is not None else "?" for f in found) for i in range(slots)]
    return parts[0] + "".join(c + rest for c, rest in zip(cells, parts[1:]))


def _text_column(cells: list, key: str) -> bool:
    """Whether every seed's cell is text that stands for no number (no `<key>_value` twin)."""
    rows = [r for r in cells if r is not None]
    return bool(rows) and all(isinstance(r.get(key), str) and f"{key}_value" not in r for r in rows)


def present(cells: list) -> dict[str, Any]:
    """The first seed's copy of a matched row (some seed has it)."""
    return next(r for r in cells if r is not None)


def _rest(key: str) -> str:
    """A row key without its label: the other index values and the repeat number."""
    ident, nth = key.rsplit("#", 1)
    return json.dumps(json.loads(ident)[1:]) + "#" + nth


def _value(row: dict[str, Any], key: str) -> Any:
    """The cell's number where it has one (its `<key>_value` twin for text such as an AUC with its CI);
    NaN, stored as null, counts as missing."""
    v = row.get(key)
    twin = f"{key}_value"
    v = row[twin] if isinstance(v, str) and twin in row else v
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _num_spec(spec: str, sign: str = "") -> str:
    """The column's number format for a mean (a plain '{}' or '{:,}' column holds counts: 3 digits), with
    `sign` '+' (a difference) or '-' (a half-width: no sign) in place of the column's own."""
    if spec in ("{}", "{:,}") or not spec.startswith("{:"):
        spec = "{:.3g}"
    if not sign:
        return spec
    return "{:" + ("+" if sign == "+" else "") + spec[2:].lstrip("+- ")


def _pm(st: dict[str, Any], fmt: str, n: int, signed: bool = False) -> str:
    """'mean ± half' ('in every seed' when they all agree, '*' where a difference's interval excludes 0,
    '(k of n)' when only k seeds have it)."""
    text = _num_spec(fmt, "+" if signed else "").format(st["mean"])
    if st["n"] == n and st["sd"] is not None and st["sd"] <= 1e-12 * max(1.0, abs(st["mean"])):
        text += " in every seed"  # equal but for rounding
    elif st["half"] is not None:
        text += " ± " + _num_spec(fmt, "-").format(st["half"]) + ("*" if st.get("excludes_zero") else "")
    return text + (f" ({st['n']} of {n})" if st["n"] < n else "")


def plot(rows: list[dict[str, Any]], spec: dict[str, Any], path: Path, seeds: Sequence[Any],
         prefer: Sequence[str] = ()) -> Path | None:
    """The first table's measures (those in `prefer`, the columns its differences moved, else those that
    vary between seeds): each seed's value as a dot, the mean with its interval."""
    varies = [k for k, _, _ in spec["columns"] if any(len({json.dumps(v) for v in r["stats"].get(k, {}).get(
        "values", [])}) > 1 for r in rows)]
    titles = {k: t for k, t, _ in spec["columns"]}
    keys = [(k, titles[k]) for k in (list(prefer) or varies) if k in titles and not _COST.search(k)
            and k not in spec["index"]][:PLOTTED]
    if not keys:
        return None
    labels = [", ".join(str(r.get(c, "")) for c in spec["index"]) for r in rows]
    fig, axes = figure(len(keys), width=max(3.6, 0.5 * len(rows) + 1.5), height=3.8)
    for ax, (key, title) in zip(axes, keys):
        legend = True
        for j, r in enumerate(rows):
            st = r["stats"].get(key)
            if not st or "mean" not in st:
                continue
            vals = [v for v in st["values"] if v is not None]
            xs = [j + 0.12 * (i - (len(vals) - 1) / 2) / max(len(vals), 1) for i in range(len(vals))]
            ax.scatter(xs, vals, s=14, color="tab:blue", alpha=0.6, label="a seed" if legend else None)
            ax.errorbar([j], [st["mean"]], yerr=[st["half"] or 0], fmt="D", color="black", capsize=4,
                        markersize=4, label="mean ± CI" if legend else None)
            legend = False
        ax.set_xticks(range(len(rows)), labels, rotation=45, ha="right", fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"Over seeds {list(seeds)}", fontsize=9)
    return save(fig, path)
