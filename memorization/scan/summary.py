"""The report of a corpus scan: report.json, report.md and four PNGs, built from the written parts.

- the exact-match rate with a 95% Wilson interval, mean leading-match length, token accuracy, suffix
  loss (and, with --generate, the mean memorization score and RougeL);
- the distribution of memorization scores (Biderman et al. 2023's fraction of the S continuation tokens
  reproduced, with --generate; else the leading-match fraction lead / S, a lower bound of it);
- the exact-match rate by position in the source (training order, in 20 bins of rows);
- the rate by duplicate count, when the rows carry one (--manifest, or --count-key on JSONL);
- the top memorized windows as text (exact first, then by leading-match length and suffix loss);
- probabilistic extraction (Hayes et al. 2024): per --sampling scheme and greedy, the fraction of rows
  (n, p)-extractable for each n of --np-n at --np-p (evals.sampling.np_summary of the rows' log p_z),
  over all rows and, with --offsets stride:N, per window offset (the same position in every sequence;
  random:K offsets differ from sequence to sequence, so they are not split), and its plot against n;
- with --near-verbatim D, the search's lower bounds (memorization/scan/near.py): per scheme and d <= D
  the fraction of all rows (n, p)-extractable within d changes (with --offsets stride:N also per window
  offset), the likeliest near-copies with what they change, and its plot against d.
The parts are read column by column, so the report of a million rows needs a few of its columns only.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from evals.sampling import np_summary
from memorization.config import change_words
from memorization.scan.parts import PARTS, PNGS, logpz_columns, logpz_values, read_parts

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


def _columns(out: Path, fmt: str, generate: bool, schemes: Sequence[str]) -> dict[str, np.ndarray]:
    names = ["row", "offset", "exact_match", "lead", "token_accuracy", "suffix_loss", "count"]
    names += ["memorization_score", "rougeL"] if generate else []
    names += logpz_columns(schemes)
    if fmt == "parquet" and any((out / PARTS).glob("part-*.parquet")):  # columnar, no Python objects
        table = pq.read_table(out / PARTS, columns=names)
        cols = {c: table.column(c).to_numpy() for c in names if c != "count"}
        return {**cols, "count": table.column("count").fill_null(-1).to_numpy().astype(np.int64)}
    cols: dict[str, list] = {c: [] for c in names}
    for part in read_parts(out, fmt, names):
        for c in names:
            cols[c] += part[c]
    count = np.array([-1 if v is None else v for v in cols.pop("count")], dtype=np.int64)
    lz = {c: np.array(logpz_values(cols.pop(c)), dtype=np.float64) for c in logpz_columns(schemes)}
    return {**{c: np.asarray(v) for c, v in cols.items()}, "count": count, **lz}


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


def _np(c: dict[str, np.ndarray], schemes: Sequence[str], ns: Sequence[int], p: float,
        sel: np.ndarray | slice = slice(None)) -> dict[str, Any]:
    """np_summary of the rows `sel`: greedy (its exact matches) and every scheme's log p_z."""
    return np_summary({name: c[f"logpz/{name}"][sel] for name in schemes}, ns, p,
                      greedy=c["exact_match"][sel].astype(bool))


def build_report(out: Path, *, fmt: str, suffix: int, generate: bool, header: dict[str, Any],
                 text: Callable[[list[int]], str], top: int = 20, schemes: Sequence[str] = (),
                 ns: Sequence[int] = (1, 10, 100, 1000), p: float = 0.5, by_offset: bool = False
                 ) -> dict[str, Any]:
    """The report dict of the scan written in OUT (see the module docstring)."""
    c = _columns(out, fmt, generate, schemes)
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
    overall = _np(c, schemes, ns, p)
    most = f"n={max(ns)}"
    summary["np_extractable"] = {"n": max(ns), "p": p,
                                 **{k: v[most]["fraction"] for k, v in overall["schemes"].items()}}
    offsets = sorted(set(c["offset"].tolist())) if by_offset and n else []
    sampling = {"schemes": list(schemes), "ns": list(ns), "p": p, "np": overall,
                "by_offset": {str(o): _np(c, schemes, ns, p, c["offset"] == o) for o in offsets}
                if len(offsets) > 1 else {}}
    return {**header, "summary": summary, "sampling": sampling,
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
    lines += _np_lines(report)
    lines += _near_lines(report)
    lines += ["", "## Top memorized windows", "", "| row | doc | offset | lead | loss | prefix | suffix |",
              "|---|---|---|---|---|---|---|"]
    for t in report["top"]:
        cells = [str(t["row"]), str(t["doc_id"]), str(t["doc_offset"]), str(t["lead"]),
                 f"{t['suffix_loss']:.3f}", _cell(t["prefix"]), _cell(t["suffix"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _np_lines(report: dict[str, Any]) -> list[str]:
    """report.md's (n, p) tables: all rows, then per offset when the report splits them."""
    smp = report.get("sampling")
    if not smp:
        return []
    ns = smp["ns"]
    lines = ["", "## Probabilistic extraction: (n, p)-extractable fraction", "",
             f"A row is (n, p)-extractable under a sampling scheme when n samples from its prefix give the "
             f"exact suffix at least once with probability >= p = {smp['p']} (Hayes et al. 2024), from "
             "log p_z of the one forward; greedy is extractable for every n iff an exact match.", "",
             f"![(n, p) by n]({PNGS[3]})", ""]
    head = ["offset", "scheme"] + [f"n={n}" for n in ns]
    groups = [("all", smp["np"])] + list(smp["by_offset"].items())
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for offset, summ in groups:
        for name, per in summ["schemes"].items():
            cells = [f"{per[f'n={n}']['fraction']:.4f} ({per[f'n={n}']['count']})" for n in ns]
            lines.append("| " + " | ".join([str(offset), f"`{name}`", *cells]) + " |")
    return lines


def _near_lines(report: dict[str, Any]) -> list[str]:
    """report.md's near-verbatim section: the lower bounds per scheme and d, the likeliest near-copies."""
    nv = report.get("near_verbatim")
    if not nv:
        return []
    ns, word = nv["ns"], change_words(nv["distance"])[1]
    lines = ["", f"## Near-verbatim extraction: within d {word} (lower bound)", "",
             f"A row counts when the probability that a sample lies within d {word} of its suffix passes the "
             f"(n, p = {nv['p']}) test; the probability is the lower bound of a beam search ({nv['beams']} "
             f"paths per d; evals/near_verbatim.py) run on the {nv['searched']} of {nv['windows']} windows "
             f"the forward ranks likeliest (`--nv-rows {nv['asked']}`, by the log-prob of their suffix's S - "
             f"{nv['max_edits']} likeliest tokens); the others count by their exact copy's p_z, so every "
             "fraction is a lower bound, at least the exact one above (d = 0: the exact copy). Rows: "
             "near_verbatim.jsonl; "
             f"{nv['seconds']:.1f} s.", "", f"![near-verbatim by d]({PNGS[4]})", ""]
    head = ["scheme", "d"] + [f"n={n}" for n in ns]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, per in nv["np"].items():
        for d, cells in per.items():
            vals = [f"{cells[f'n={n}']['fraction']:.4f} ({cells[f'n={n}']['count']})" for n in ns]
            lines.append("| " + " | ".join([f"`{name}`", d.removeprefix("d="), *vals]) + " |")
    if nv.get("by_offset"):
        d = f"d={nv['max_edits']}"
        lines += ["", f"Per window offset, within {nv['max_edits']} {word}:", "",
                  "| " + " | ".join(["offset", "scheme", *(f"n={n}" for n in ns)]) + " |",
                  "|" + "---|" * (2 + len(ns))]
        for offset, per_scheme in nv["by_offset"].items():
            for name, per in per_scheme.items():
                vals = [f"{per[d][f'n={n}']['fraction']:.4f} ({per[d][f'n={n}']['count']})" for n in ns]
                lines.append("| " + " | ".join([offset, f"`{name}`", *vals]) + " |")
    if nv["examples"]:
        lines += ["", "Likeliest near-copies (`[-removed-]{+added+}`):", "",
                  "| row | scheme | changes | log10 P | near-copy |", "|---|---|---|---|---|"]
        lines += [f"| {x['row']} | `{x['scheme']}` | {x['edits']} | {x['logp'] / math.log(10):.2f} | "
                  f"{_cell(x['diff'])} |" for x in nv["examples"]]
    return lines


def extractable_fractions(section: dict[str, Any]) -> dict[str, Any]:
    """The report summary's line: per scheme, the fraction of all rows (n, p)-extractable within D changes
    at the largest n."""
    d, n = section["max_edits"], max(section["ns"])
    return {"d": d, "n": n, "p": section["p"], "distance": section["distance"],
            **{name: per[f"d={d}"][f"n={n}"]["fraction"] for name, per in section["np"].items()}}


def plot_near(section: dict[str, Any], ax: Any) -> None:
    """The fraction of all rows (n, p)-extractable at the largest n against the changes allowed."""
    n = max(section["ns"])
    ds = list(range(section["max_edits"] + 1))
    for name, per in section["np"].items():
        ax.plot(ds, [per[f"d={d}"][f"n={n}"]["fraction"] for d in ds], marker="o", label=name)
    word = change_words(section["distance"])[1]
    ax.set(xlabel=f"within d {word}", ylabel=f"(n={n}, p={section['p']})-extractable fraction (lower bound)",
           title=f"Near-verbatim ({section['searched']} of {section['windows']} windows searched)")
    ax.set_xticks(ds)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="small")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:200]


def plot(report: dict[str, Any], folder: Path) -> list[Path]:
    """The PNGs (the duplicate-count one only when rows carry counts, (n, p) with a summary); their paths."""
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

    def extractable(ax: Any) -> None:
        smp = report["sampling"]
        for name, per in smp["np"]["schemes"].items():
            ax.plot(smp["ns"], [per[f"n={n}"]["fraction"] for n in smp["ns"]], marker="o", label=name,
                    linestyle="--" if name == "greedy" else "-")
        ax.set(xscale="log", xlabel="samples n", ylabel=f"(n, p={smp['p']})-extractable fraction",
               title="Probabilistic extraction")
        ax.legend(fontsize="small")

    figs = [(PNGS[0], scores), (PNGS[1], position)] + ([(PNGS[2], counts)] if cnt else [])
    figs += [(PNGS[3], extractable)] if report.get("sampling") else []
    if report.get("near_verbatim"):
        figs.append((PNGS[4], lambda ax: plot_near(report["near_verbatim"], ax)))
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


__all__ = ["build_report", "dumps", "extractable_fractions", "markdown", "plot", "plot_near", "wilson"]
