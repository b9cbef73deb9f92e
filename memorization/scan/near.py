"""`memorize scan --near-verbatim D`: after the last part, the near-verbatim search (evals/near_verbatim.py)
of the windows the scan's forward ranks likeliest to be near-verbatim.

The search costs S decode steps of 1 + D * beams paths per window and scheme, where the scan spends one
forward: searching every window of a large corpus would cost more than the scan itself. Each row's
`near_score` (evals/scan.py: the summed log-probs of its suffix's S - D likeliest tokens, teacher-forced,
under the likeliest scheme) ranks the windows, and the `--nv-rows` best (those with a finite score) are
searched. Every window keeps its exact copy's probability p_z (the row's `logpz/<scheme>`) as a bound
(a sample equal to the suffix lies within D changes of it): a searched one the larger of it and the
search's, one not searched p_z alone. The search's bound is a lower bound of P(a sample lies within D
changes of the suffix) too, so the report's fractions over all rows are lower bounds, never below the
exact (n, p) fractions of the same report, and `--nv-rows` only decides how tight they are (a window the
ranking misses can only make them smaller). The searched windows go to OUT/near_verbatim.jsonl, one
row each: where it came from, its rank score, the search's bound per scheme at d = 0..D (d = 0: the
exact copy's p_z as the cached decode sums it) and the likeliest path found per scheme, spelled out
with what it changes.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from axonn.grid import ProcessGrid
from evals.sampling import extractable
from memorization.eval.sections import near_report, parse_ns, parse_p
from memorization.outputs import write_files
from memorization.scan.parts import NEAR_ROWS, NEAR_SCORE, logpz_values, read_parts
from memorize_core import ConfigError, fail

SEARCH_BATCH = 32  # windows per search batch: at D = 4 and 8 beams, ~1,000 paths through the KV cache
NV_ROWS = 1000  # --nv-rows default


def check_nv_rows(o: Any) -> None:
    """--nv-rows K (of `memorize scan` and its dry run): an integer >= 1, and only with --near-verbatim."""
    k = o.nv_rows
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise fail("--nv-rows", k, "pass the number of windows to search, >= 1, e.g. 1000")
    if not o.near_verbatim and k != NV_ROWS:
        raise fail("--nv-rows", k, "only applies with --near-verbatim D")


@dataclass
class _Text:
    """The scan's id -> text function as the decode() near_report spells rows with."""

    decode: Callable[[list[int]], str]


def select(out: Path, fmt: str, k: int, schemes: Sequence[str], ns: Sequence[int], p: float
           ) -> tuple[list[dict[str, Any]], dict[int, int], dict[int, dict[str, dict[str, int]]]]:
    """(the k rows with the largest finite near_score, best first (ties: the earlier row), each with where
    it came from and its tokens; rows per window offset; per offset, scheme and n, how many of the rows
    NOT chosen are (n, p)-extractable by their exact p_z). Two passes over the parts, one part and k rows
    in memory at a time: the scores, then the offsets, the log p_z columns and the chosen rows' tokens."""
    best_s, best_r = np.zeros(0), np.zeros(0, dtype=np.int64)
    for part in read_parts(out, fmt, ["row", NEAR_SCORE]):
        s = np.array(logpz_values(part[NEAR_SCORE]), dtype=np.float64)
        keep = np.isfinite(s)
        best_s = np.concatenate([best_s, s[keep]])
        best_r = np.concatenate([best_r, np.asarray(part["row"], dtype=np.int64)[keep]])
        order = np.lexsort((best_r, -best_s))[:k]
        best_s, best_r = best_s[order], best_r[order]
    rank = {int(r): i for i, r in enumerate(best_r)}
    chosen: list[dict[str, Any] | None] = [None] * len(rank)
    rows: dict[int, int] = {}
    floor: dict[int, dict[str, dict[str, int]]] = {}
    names = ["row", "doc_id", "doc_offset", "offset", NEAR_SCORE, "prefix_ids", "suffix_ids",
             *(f"logpz/{name}" for name in schemes)]
    for part in read_parts(out, fmt, names):
        rest = np.array([r not in rank for r in part["row"]], dtype=bool)
        offsets = np.asarray(part["offset"], dtype=np.int64)
        for o in np.unique(offsets).tolist():
            at = offsets == o
            rows[o] = rows.get(o, 0) + int(at.sum())
            mine = floor.setdefault(o, {name: dict.fromkeys((f"n={n}" for n in ns), 0) for name in schemes})
            for name in schemes:
                lz = np.array(logpz_values(part[f"logpz/{name}"]), dtype=np.float64)[rest & at]
                for n in ns:
                    mine[name][f"n={n}"] += int(extractable(lz, n, p).sum())
        for i in np.flatnonzero(~rest):
            chosen[rank[part["row"][i]]] = {c: part[c][i] for c in names}
    return [c for c in chosen if c is not None], rows, floor


def search(o: Any, model: torch.nn.Module, grid: ProcessGrid, out: Path, text: Callable[[list[int]], str],
           schemes: Sequence[Any], by_offset: bool = False) -> dict[str, Any] | None:
    """Search the --nv-rows best-ranked windows of the scan in OUT (every rank; rank 0 reads and writes):
    write OUT/near_verbatim.jsonl; the report's near-verbatim section on rank 0 (None elsewhere), with
    `by_offset` (--offsets stride:N) its counts per window offset too."""
    t = time.perf_counter()
    main = grid.rank == 0
    ns, p = parse_ns(o.np_n), parse_p(o.np_p)
    names = [s.name for s in schemes]
    box: list[Any] = [None]
    if main:
        try:
            box[0] = select(out, o.format, o.nv_rows, names, ns, p)
        except (ConfigError, OSError, ValueError) as e:  # every rank raises it, none waits for rank 0
            box[0] = e
    if grid.distributed:
        torch.distributed.broadcast_object_list(box, src=0)
    if isinstance(box[0], BaseException):
        raise box[0]
    chosen, per_offset, floor = box[0]
    got, rows = {"offsets": {}}, []
    if chosen:
        windows = [list(c["prefix_ids"]) + list(c["suffix_ids"]) for c in chosen]
        got, rows = near_report(model, windows, [c["row"] for c in chosen], _Text(text), prefix_len=o.prefix,
                                suffix_len=o.suffix, schemes=schemes, max_edits=o.near_verbatim,
                                beams=o.nv_beams, distance=o.nv_distance, ns=ns, p=p,
                                batch_size=min(o.batch_size, SEARCH_BATCH), grid=grid,
                                progress=o.progress and main)
    if not main:
        return None
    by_row = {c["row"]: c for c in chosen}
    where = ("doc_id", "doc_offset", "offset", NEAR_SCORE)
    lines = [{"row": r["doc"], **{k: by_row[r["doc"]][k] for k in where},
              **{k: v for k, v in r.items() if k not in ("doc", "offset")}} for r in rows]
    write_files(out, {NEAR_ROWS: "".join(json.dumps(r) + "\n" for r in lines)}, replace=())
    d_max = o.near_verbatim

    def table(offsets: Sequence[int]) -> dict[str, Any]:
        """Per scheme, d and n: the searched rows at these offsets by their bound, the rest by p_z."""
        mine = [x for x in lines if x["offset"] in offsets]
        total = sum(per_offset[w] for w in offsets)
        out_: dict[str, Any] = {}
        for name in names:
            out_[name] = {}
            for d in range(d_max + 1):
                # P(within d) >= its exact copy's p_z too: the row's own log p_z (one forward) holds the
                # bound at d = 0 to the exact verdict where the cached decode's sum differs in the last bits
                found_lb = logpz_values([x["bound"][name][d] for x in mine])
                exact_lb = logpz_values([by_row[x["row"]][f"logpz/{name}"] for x in mine])
                bound = np.maximum(np.array(found_lb, dtype=np.float64), np.array(exact_lb, dtype=np.float64))
                cells = {}
                for n in ns:
                    found = int(extractable(bound, n, p).sum())
                    count = found + sum(floor[w][name][f"n={n}"] for w in offsets)
                    cells[f"n={n}"] = {"count": count, "fraction": count / total if total else 0.0,
                                       "searched_count": found,
                                       "fraction_searched": found / len(mine) if mine else 0.0}
                out_[name][f"d={d}"] = cells
        return out_

    offsets = sorted(per_offset)
    at = got["offsets"].get("0") or {}
    for ex in got.get("examples", []):
        ex["row"] = ex.pop("doc")
        ex.pop("offset", None)
    return {"max_edits": d_max, "distance": o.nv_distance, "beams": o.nv_beams, "schemes": names,
            "ns": list(ns), "p": p, "windows": sum(per_offset.values()), "searched": len(chosen),
            "asked": o.nv_rows, "lowest_score_searched": chosen[-1][NEAR_SCORE] if chosen else None,
            "np": table(offsets),
            "by_offset": {str(w): table([w]) for w in offsets} if by_offset and len(offsets) > 1 else {},
            "median_log10_searched": at.get("median_log10", {}),
            "examples": got.get("examples", []), "seconds": time.perf_counter() - t}


__all__ = ["NV_ROWS", "SEARCH_BATCH", "check_nv_rows", "search", "select"]
