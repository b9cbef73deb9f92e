"""What every experiment reports beyond greedy exact match: (n, p)-extraction rates per decoding scheme
and exact match at each prefix offset, from each run's `sampled` summary (memorization.train.pipeline's
sampled_results: one forward per window, evals/probabilistic.py), and where eval.near_verbatim is set the
near-verbatim bounds (evals/near_verbatim.py) from each run's `near_verbatim` summary."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from memorization.config import change_words
from memorization.experiments.reporting import Table, figure, save

NP_NOTE = ("Beyond greedy (after {passes} passes): p_z = the probability that a decoding scheme emits the "
           "suffix exactly, from one teacher-forced forward per window; (n, p)-extractable = 1 - (1 - p_z)^n "
           ">= p (Hayes et al. 2024), i.e. n samples recover the suffix verbatim with probability >= p. "
           "Offsets: the prefix starts that many tokens into the document (documents too short for an "
           "offset are left out there).")


def _label(run: dict[str, Any], key: str) -> str:
    return str(run.get(key) or run.get("name"))


def np_table(runs: list[dict[str, Any]], key: str = "name") -> Table | None:
    """One row per (run, offset, scheme): the fraction (n, p)-extractable for each n, greedy first."""
    rows, ns, p = [], [], None
    for r in runs:
        s = r.get("sampled")
        if not s:
            continue
        for off, at in s["offsets"].items():
            summary = at.get("np")
            if not summary:
                continue
            ns, p = summary["ns"], summary["p"]
            for scheme, per in summary["schemes"].items():
                rows.append({"run": _label(r, key), "offset": int(off), "docs": at["docs"], "scheme": scheme,
                             **{f"n{n}": per[f"n={n}"]["fraction"] for n in ns}})
    if not rows:
        return None
    cols = [("run", "run", "{}"), ("offset", "prefix offset", "{}"), ("docs", "docs", "{}"),
            ("scheme", "decoding", "{}")]
    cols += [(f"n{n}", f"(n={n}, p={p})", "{:.0%}") for n in ns]
    return Table("Extraction beyond greedy: (n, p)-extractable fraction", rows, tuple(cols),
                 ("run", "offset", "scheme"))


def offset_table(runs: list[dict[str, Any]], key: str = "name") -> Table | None:
    """Greedy exact match at each prefix offset into the documents (one row per run)."""
    rows, offsets = [], []
    for r in runs:
        s = r.get("sampled")
        if not s or len(s["offsets"]) < 2:
            continue
        offsets = sorted(int(o) for o in s["offsets"])
        rows.append({"run": _label(r, key), **{f"em{o}": s["offsets"][str(o)]["exact_match_rate"]
                                               for o in offsets},
                     **{f"docs{o}": s["offsets"][str(o)]["docs"] for o in offsets}})
    if not rows:
        return None
    cols = [("run", "run", "{}")]
    cols += [(f"em{o}", f"EM at offset {o} (docs)", "{:.0%}") for o in offsets]
    return Table("Exact match by prefix offset", rows, tuple(cols))


def near_table(runs: list[dict[str, Any]], key: str = "name") -> Table | None:
    """Near-verbatim (eval.near_verbatim): one row per (run, offset, scheme), the fraction of documents whose
    lower bound of P(a sample within d changes, by the run's eval.nv_distance) passes the (n, p) test at the
    largest n, per d."""
    rows, ds, n_max, p, distance = [], [], None, None, None
    for r in runs:
        nv = r.get("near_verbatim")
        if not nv:
            continue
        distance = nv.get("distance")
        for off, at in nv["offsets"].items():
            for scheme, summary in (at.get("np") or {}).items():
                if not summary:
                    continue
                ds, n_max, p = list(summary["schemes"]), summary["ns"][-1], summary["p"]
                rows.append({"run": _label(r, key), "offset": int(off), "docs": at["docs"], "scheme": scheme,
                             **{d: summary["schemes"][d][f"n={n_max}"]["fraction"] for d in ds},
                             "median": at["median_log10"][scheme][ds[-1]]})
    if not rows:
        return None
    cols = [("run", "run", "{}"), ("offset", "prefix offset", "{}"), ("docs", "docs", "{}"),
            ("scheme", "decoding", "{}")]
    word, phrase = change_words(distance)
    cols += [(d, f"<= {d[2:]} {word}", "{:.0%}") for d in ds]
    cols += [("median", f"median log10 P(<= {ds[-1][2:]} {word})", "{:.1f}")]
    return Table(f"Near-verbatim: (n={n_max}, p={p})-extractable within d {phrase} (a lower bound)",
                 rows, tuple(cols), ("run", "offset", "scheme"))


def np_plot(runs: list[dict[str, Any]], path: Path, key: str = "name", offset: int = 0) -> Path | None:
    """Extractable fraction vs n (log scale), one panel per decoding scheme, one line per run."""
    found = [(r, r["sampled"]["offsets"].get(str(offset), {}).get("np")) for r in runs if r.get("sampled")]
    found = [(r, s) for r, s in found if s]
    if not found:
        return None
    schemes = list(found[0][1]["schemes"])
    fig, axes = figure(len(schemes), width=3.6, height=3.4)
    for ax, scheme in zip(axes, schemes):
        for r, s in found:
            per = s["schemes"].get(scheme)
            if per:
                ax.plot(s["ns"], [per[f"n={n}"]["fraction"] for n in s["ns"]], marker="o",
                        label=_label(r, key))
        ax.set_xscale("log")
        ax.set(xlabel="samples n", ylabel=f"(n, p={found[0][1]['p']})-extractable", ylim=(-0.02, 1.02),
               title=scheme)
    axes[0].legend(fontsize=6)
    return save(fig, path)


def beyond_greedy(runs: list[dict[str, Any]], out: Path, name: str, key: str = "name"
                  ) -> tuple[list[Table], list[Path]]:
    """The tables and the plot (OUT/<name>-np.png) an experiment adds for its runs' `sampled` summaries."""
    tables = [np_table(runs, key), offset_table(runs, key), near_table(runs, key)]
    tables = [t for t in tables if t is not None]
    plot = np_plot(runs, out / f"{name}-np.png", key)
    return tables, [plot] if plot is not None else []


__all__ = ["NP_NOTE", "beyond_greedy", "near_table", "np_plot", "np_table", "offset_table"]
