"""report.png of `memorize eval`: one panel per scored section that has a picture.

- extraction: how many suffix tokens each document's greedy (or beam) continuation matches before its
  first miss (the longest common prefix), a bar per length; a bar at the suffix length is an exact match;
- beyond greedy: the fraction of documents whose suffix probability p_z under a decoding scheme is at least
  x, against log10 x, one line per scheme (colour, greedy included) and prefix offset (line style); a
  dotted line per n marks the p_z from which n samples extract with probability p, so the (n, p)
  fractions of report.md are where the curves cross those lines;
- near-verbatim: the same curves for the lower bound of P(a sample lies within d changed tokens of the
  suffix), a colour per d (d = 0: the exact copy) and a line style per scheme;
- membership inference: each attack's ROC curve on log-log axes (members the positive class), its AUC in
  the legend, where the low-FPR region that matters for privacy is visible (Carlini et al. 2022).
"""
from __future__ import annotations

import io
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from sklearn.metrics import roc_curve

from evals import ExtractionResult
from memorization.config import change_words

_STYLES = ("-", "--", ":", "-.")
PANEL_PX = 460  # the width of one panel in report.png


def extraction_panel(ax: Any, ex: dict[str, Any], results: Sequence[ExtractionResult]) -> None:
    """The matched-length histogram of `results` (`ex`: the section's suffix and beams) on `ax`."""
    lcp = np.array([r.lcp for r in results], dtype=np.int64)
    suffix = int(ex["suffix"])
    counts = np.bincount(np.clip(lcp, 0, suffix), minlength=suffix + 1)
    colours = ["tab:blue"] * suffix + ["tab:red"]
    ax.bar(np.arange(suffix + 1), counts, width=0.9, color=colours)
    how = "greedy" if ex["beams"] == 1 else f"{ex['beams']} beams"
    ax.set_title(f"Extraction ({how}): {int(counts[-1])}/{len(results)} exact", fontsize=10)
    ax.set_xlabel(f"suffix tokens matched before the first miss (of {suffix})")
    ax.set_ylabel("documents")


def pz_curves(rows: Sequence[dict[str, Any]]) -> dict[tuple[int, str], np.ndarray]:
    """sampled.jsonl's rows as {(offset, scheme): log10 p_z per document} (-inf where p_z = 0)."""
    by_offset: dict[int, list[dict[str, float | None]]] = {}
    for r in rows:
        by_offset.setdefault(int(r["offset"]), []).append(r["logpz"])
    return {(off, name): np.array([-np.inf if d[name] is None else d[name] / np.log(10) for d in docs])
            for off, docs in by_offset.items() for name in docs[0]}


def np_threshold(n: int, p: float) -> float:
    """log10 of the smallest p_z that n samples extract with probability p: 1 - (1 - p)^(1/n)."""
    return float(np.log10(-np.expm1(np.log1p(-p) / n)))


def _survival(ax: Any, curves: Sequence[tuple[np.ndarray, str, str, str]], p: float, ns: Sequence[int]
              ) -> None:
    """Each (log10 values, colour, line style, label) as the fraction of documents at or above x, and a
    dotted line at each n's (n, p) threshold; every finite value and line in view, 0 on the right edge."""
    lines = [np_threshold(n, p) for n in ns]
    finite = np.concatenate([c[np.isfinite(c)] for c, *_ in curves] + [np.array([0.0, *lines])])
    lo = max(-300.0, float(finite.min()) * 1.05 - 1.0)
    x = np.linspace(lo, 0.0, 400)
    for c, colour, style, label in curves:
        ax.plot(x, (c[None, :] >= x[:, None]).mean(1), color=colour, linestyle=style, label=label)
    for i, at in enumerate(lines):
        ax.axvline(at, color="grey", linestyle=":", linewidth=0.8,
                   label=f"n = {', '.join(map(str, ns))} (right to left)" if i == 0 else None)
    ax.set_xlim(lo, 0.0)
    ax.set_ylim(-0.02, 1.06)


def sampled_panel(ax: Any, smp: dict[str, Any], rows: Sequence[dict[str, Any]]) -> None:
    """The p_z curves of sampled.jsonl's `rows` and the (n, p) lines of `smp` (its ns and p) on `ax`."""
    curves = pz_curves(rows)
    colours: dict[str, str] = {}
    offsets = sorted({off for off, _ in curves})
    styled = [(c, colours.setdefault(name, f"C{len(colours)}"), _STYLES[offsets.index(off) % len(_STYLES)],
               f"{name}, offset {off}") for (off, name), c in curves.items()]
    p = float(smp["p"])
    _survival(ax, styled, p, smp["ns"])
    ax.set_xlabel("log10 p_z (the suffix's probability under the scheme)")
    ax.set_ylabel("fraction of documents with p_z at least")
    ax.set_title(f"Beyond greedy: right of a line, (n, p={p})-extractable", fontsize=10)
    ax.legend(fontsize=6, loc="best")


def near_panel(ax: Any, nv: dict[str, Any], rows: Sequence[dict[str, Any]]) -> None:
    """Near-verbatim: the fraction of documents whose bound of P(within d changed tokens) is at least x,
    against log10 x, a colour per d and a line style per scheme (the first offset), with the (n, p) lines."""
    offset = min(int(r["offset"]) for r in rows)
    at = [r for r in rows if int(r["offset"]) == offset]
    word, phrase = change_words(nv.get("distance"))
    styled = [(np.array([-np.inf if r["bound"][name][d] is None else r["bound"][name][d] for r in at])
               / np.log(10), f"C{d}", _STYLES[i % len(_STYLES)], f"{name}, <= {d} {word}")
              for i, name in enumerate(nv["schemes"]) for d in range(int(nv["max_edits"]) + 1)]
    p = float(nv["p"])
    _survival(ax, styled, p, nv["ns"])
    ax.set_xlabel(f"log10 P(a sample within d {phrase}), lower bound")
    ax.set_ylabel("fraction of documents with it at least")
    ax.set_title(f"Near-verbatim, offset {offset}: right of a line, (n, p={p})", fontsize=10)
    ax.legend(fontsize=5, loc="center left")  # the curves run along the top and the bottom


def _mia(ax: Any, mia: dict[str, Any], rows: Sequence[dict[str, Any]]) -> None:
    y = np.array([r["member"] for r in rows], dtype=np.int64)
    floor = 1.0 / max(1, int((y == 0).sum()))  # the smallest non-zero FPR this many non-members can show
    for method, got in mia["methods"].items():
        fpr, tpr, _ = roc_curve(y, np.array([r[method] for r in rows], dtype=np.float64))
        low = floor / 2  # zeros drawn at half the floor on the log axes
        ax.plot(np.maximum(fpr, low), np.maximum(tpr, low), label=f"{method} (AUC {got['auc']:.3f})")
    grid = np.logspace(np.log10(floor / 2), 0, 50)
    ax.plot(grid, grid, color="grey", linestyle=":", label="chance")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("false positive rate")
    ax.set_ylabel("true positive rate")
    c = mia["counts"]
    ax.set_title(f"Membership inference: {c['members']} members vs {c['non_members']}", fontsize=10)
    ax.legend(fontsize=6)


def eval_png(report: dict[str, Any], results: Sequence[ExtractionResult],
             sampled_rows: Sequence[dict[str, Any]] | None, mia_rows: Sequence[dict[str, Any]] | None,
             near_rows: Sequence[dict[str, Any]] | None = None) -> bytes | None:
    """The PNG of report.png for a `memorize eval` report (None when no section has a picture)."""
    panels = []
    if report.get("extraction") and results:
        panels.append(lambda ax: extraction_panel(ax, report["extraction"], results))
    if sampled_rows:  # rows come with the section
        panels.append(lambda ax: sampled_panel(ax, report["sampled"], sampled_rows))
    if near_rows:
        panels.append(lambda ax: near_panel(ax, report["near_verbatim"], near_rows))
    if mia_rows:
        panels.append(lambda ax: _mia(ax, report["mia"], mia_rows))
    return panels_png(panels) if panels else None


def best_effort(draw: Callable[..., bytes | None], *args: Any) -> bytes | None:
    """`draw(*args)`, or None with a warning on stderr when drawing fails: a plot never costs the
    results it shows (they are written without it)."""
    try:
        return draw(*args)
    except Exception as e:  # matplotlib's failures have many types (fonts, backends, bad values)
        print(f"warning: report.png not drawn ({type(e).__name__}: {e}); the results are written without "
              "it", file=sys.stderr)
        return None


def panels_png(panels: Sequence[Callable[[Any], None]]) -> bytes:
    """One figure, a panel per drawing function side by side (PANEL_PX wide each), as PNG bytes."""
    import matplotlib  # deferred: +0.5 s with pyplot; only the report needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: after the Agg backend is chosen

    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.8), squeeze=False)
    for draw, ax in zip(panels, axes[0]):
        draw(ax)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=PANEL_PX / 4.6)
    plt.close(fig)
    return buf.getvalue()
