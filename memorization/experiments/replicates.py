"""Replicates: one experiment repeated over seeds, every table averaged, and paired differences.

A single run's figures hold one draw of everything random: which leads are members, where copies and
canaries land, the data order, the noise. `replicate.seeds: [0, 1, 2]` runs the whole experiment once
per seed (OUT/seed-S, each its own complete report, sub-runs reused when done) with base.seed and
base.trainer.seed set to S, then writes OUT/report.{json,md} and OUT/replicates.png:

- every table of the experiment, each cell the mean over the seeds ± the half-width of the Student-t
  interval, t_{(1+c)/2, n-1} · sd / sqrt(n) (a cell equal in every seed is shown as it is);
- paired differences: in every table that holds the reference row (`replicate.reference`, by default
  the first table's first row), each other row minus the reference row of the same seed, averaged with
  its own t interval. The two rows share the seed's draw, so its luck cancels: the paired interval is
  what says whether a mitigation changed a figure.

Rows are matched across seeds by their index columns (Table.index; the first column by default) and,
where the index repeats, by order within it. A cell shown as text that stands for a number (an AUC
with its CI: reporting.Shown) is averaged by that number. `memorize aggregate DIR...` does the same for
reports of one experiment run as separate jobs (one per seed), after checking that they differ in
their seeds and nothing else.
"""
from __future__ import annotations

import importlib
import json
import math
import re
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from memorization.experiments.reporting import Outputs, Table, figure, save, write_outputs
from memorization.experiments.runner import Experiment, say
from memorization.experiments.spec import Replicate, build_experiment
from memorization.outputs import check_writable
from memorize_core import fail

SEED_DIR = "seed-{}"
PLOT = "replicates.png"
PLOTTED = 4  # columns of the first table drawn in replicates.png
_COST = re.compile(r"seconds|time|rss|peak|params|trainable|steps?$")  # what a run cost, not what it learnt
# settings that cannot change a figure, or that replicates differ in by design
_NOT_COMPARED = (("name",), ("replicate",), ("samples",), ("per_run_wandb",), ("base", "seed"),
                 ("base", "name"), ("base", "wandb"), ("base", "trainer", "seed"),
                 ("base", "trainer", "progress"), ("base", "eval", "batch_size"))


def seeded(cfg: Any, seed: int) -> Any:
    """The experiment config of one replicate: base.seed = base.trainer.seed = seed, no replicate."""
    base = replace(cfg.base, seed=seed, trainer=replace(cfg.base.trainer, seed=seed))
    return replace(cfg, name=f"{cfg.name}-seed{seed}", base=base, replicate=Replicate())


def run_replicates(module: Any, cfg: Any, out: Path, *, grid: str | None, overwrite: bool) -> dict[str, Any]:
    """Run the experiment once per seed into OUT/seed-S (each resumable), then write the averaged report."""
    reference = cfg.replicate.reference or getattr(module, "REFERENCE", "")
    exps = [(seeded(cfg, s), Experiment(out / SEED_DIR.format(s), grid_spec=grid, overwrite=overwrite).open())
            for s in cfg.replicate.seeds]
    reports = []
    for i, (scfg, exp) in enumerate(exps):
        say(f"replicate {i + 1} of {len(exps)}: seed {scfg.base.seed} -> {exp.out}")
        outputs = module.run(scfg, exp)
        if exp.is_main:
            reports.append(write_outputs(exp.out, outputs, scfg, exp.seconds))
    if not exps[0][1].is_main:
        return {}
    sources = [exp.out for _, exp in exps]
    outputs = aggregate(reports, sources, out, reference=reference, confidence=cfg.replicate.confidence,
                        given=bool(cfg.replicate.reference))
    return write_outputs(out, outputs, cfg, sum(r["seconds"] for r in reports))


def check_replicates(reports: Sequence[dict[str, Any]], sources: Sequence[Path]) -> None:
    """Refuse reports that are not replicates of one experiment: another kind, another setting, the same
    seed twice (ConfigError naming the report and the field)."""
    if len(reports) < 2:
        raise fail("reports", [str(s) for s in sources], "give two or more replicates (one per seed)")
    first = _comparable(reports[0].get("config") or {})
    seen: dict[tuple[Any, Any], Path] = {}
    for report, src in zip(reports, sources):
        if report.get("kind") != reports[0].get("kind"):
            raise fail(f"{src}: kind", report.get("kind"),
                       f"replicates are one experiment; {sources[0]} is {reports[0].get('kind')}")
        where = _first_difference(first, _comparable(report.get("config") or {}))
        if where is not None:
            path, a, b = where
            raise fail(f"{src}: config.{path}", b, f"replicates differ only in their seeds; {sources[0]} has "
                       f"{a!r}: rerun one of them with the other's setting")
        base = (report.get("config") or {}).get("base") or {}
        seed = (base.get("seed"), (base.get("trainer") or {}).get("seed"))
        if seed in seen:
            raise fail(f"{src}: config.base.seed", seed[0], f"{seen[seed]} ran the same seeds (base.seed, "
                       "base.trainer.seed); replicates need different ones")
        seen[seed] = src


def aggregate(reports: Sequence[dict[str, Any]], sources: Sequence[Path], out: Path, *, reference: str = "",
              confidence: float = 0.95, reference_field: str = "replicate.reference",
              given: bool = True) -> Outputs:
    """The replicates' tables averaged and differenced, as the Outputs of the averaged report (OUT is made
    once every check passed: a bad reference refuses with nothing written). A reference not `given` by
    the user (the experiment's REFERENCE, e.g. mitigations' 'none') falls back to the first row where
    the tables lack it."""
    check_replicates(reports, sources)
    specs = _specs(reports)
    if not specs:
        raise fail("reports", [str(s) for s in sources], "hold no tables; rerun the experiments")
    first = next(iter(specs))
    labels = {_label(r, s["index"])
              for rep in reports for t, s in specs.items() for r in rep["tables"].get(t, [])}
    if not given and reference not in labels:
        reference = ""
    ref = reference or _label(reports[0]["tables"][first][0], specs[first]["index"])
    if ref not in labels:
        main = sorted({str(_label(r, specs[first]["index"])) for r in reports[0]["tables"][first]})
        raise fail(reference_field, reference, f"name a row of the tables, e.g. one of {', '.join(main)}")
    n = len(reports)
    tables, deltas, stats = [], [], {}
    for title, spec in specs.items():
        matched = _match(reports, title, spec["index"])
        rows = [_mean_row(cells, spec, confidence, n) for cells in matched.values()]
        cols = tuple((k, t, "{}") for k, t, _ in spec["columns"])
        tables.append(Table(f"{title}: mean ± {confidence:.0%} CI over {n} seeds", rows, cols,
                            tuple(spec["index"])))
        stats[title] = rows
        diff = _delta_rows(matched, spec, ref, confidence)
        moved = [c for c in cols if c[0] in spec["index"]
                 or any(any(v != 0 for v in r["stats"].get(c[0], {}).get("values", [])) for r in diff)]
        if diff and len(moved) > len(spec["index"]):
            deltas.append(Table(f"{title}: each row − '{ref}', paired by seed (mean ± {confidence:.0%} CI; "
                                "* the interval excludes 0)", diff, tuple(moved), tuple(spec["index"])))
    seeds = [((rep.get("config") or {}).get("base") or {}).get("seed") for rep in reports]
    links = ", ".join(f"[seed {s}]({_rel(src / 'report.md', out)})" for s, src in zip(seeds, sources))
    t2 = _t(confidence, n)
    notes = [f"{n} replicates of '{reports[0].get('title')}', seeds {seeds}; each seed's whole report: "
             f"{links}.",
             f"A cell: the mean over the seeds ± the half-width of the {confidence:.0%} Student-t interval "
             f"(t = {t2:.2f} at {n} seeds, times sd / sqrt({n})); a cell equal in every seed is shown as it "
             "is; 'varies': text that differs between seeds (the seeds' reports have it); (k of n): a row or "
             "value only k seeds have.",
             f"Paired differences: each seed's row minus the '{ref}' row of the same seed. Both share that "
             "seed's draw (members, injected items, data order), so its luck cancels and the interval is "
             "narrower than comparing the two means. A column whose every difference is 0 is left out.",
             "A seed sets base.seed (the member/non-member split, where copies and canaries land, the canary "
             "secrets, a random-init model, LoRA factors) and base.trainer.seed (data order, DP-SGD's "
             "batches and noise). The goldfish hash keeps its own fixed table: it is part of the method."]
    out.mkdir(parents=True, exist_ok=True)  # every refusal above has had its chance
    plots = [p for p in [_plot(stats[first], specs[first], out / PLOT, seeds)] if p]
    runs = [{"name": f"seed {s}", "seed": s, "report": _rel(src / "report.json", out),
             "seconds": rep.get("seconds")} for s, src, rep in zip(seeds, sources, reports)]
    return Outputs(title=f"{reports[0].get('title')} (over {n} seeds)", kind=reports[0].get("kind", ""),
                   runs=runs, tables=tables + deltas, notes=notes, plots=plots,
                   extra={"replicate": {"seeds": seeds, "reference": ref, "confidence": confidence,
                                        "sources": [_rel(s, out) for s in sources]}})


def interval(values: Sequence[float], confidence: float) -> dict[str, Any]:
    """Mean, sample sd and the half-width of the Student-t interval of `values` (half None below 2)."""
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else None
    half = _t(confidence, n) * sd / math.sqrt(n) if sd is not None else None
    return {"n": n, "mean": mean, "sd": sd, "half": half, "values": list(values)}


def _t(confidence: float, n: int) -> float:
    from scipy.stats import t  # deferred: scipy.stats +0.3 s, only for replicates

    return float(t.ppf((1 + confidence) / 2, n - 1)) if n > 1 else math.nan


def _specs(reports: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every table's columns and index, in the first report's order (tables only later seeds have last)."""
    specs: dict[str, dict[str, Any]] = {}
    for rep in reports:
        given = rep.get("table_specs") or {}
        for title, rows in rep.get("tables", {}).items():
            if title in specs:
                continue
            if title in given:
                specs[title] = {"columns": [tuple(c) for c in given[title]["columns"]],
                                "index": list(given[title]["index"])}
            elif rows:  # a report written before table_specs: every key a column, the first the index
                keys = list(rows[0])
                specs[title] = {"columns": [(k, k, "{}") for k in keys], "index": keys[:1]}
    return specs


def _label(row: dict[str, Any], index: Sequence[str]) -> Any:
    return row.get(index[0])


def _match(reports: Sequence[dict[str, Any]], title: str, index: Sequence[str]) -> dict[str, list]:
    """{row key: [that row in seed i, or None]}: rows found by their index, the k-th of a repeated index
    matched with the k-th; in order of first appearance."""
    matched: dict[str, list] = {}
    for i, rep in enumerate(reports):
        seen: dict[str, int] = {}
        for row in rep.get("tables", {}).get(title, []):
            ident = json.dumps([row.get(c) for c in index], default=str)
            key = f"{ident}#{seen.get(ident, 0)}"
            seen[ident] = seen.get(ident, 0) + 1
            matched.setdefault(key, [None] * len(reports))[i] = row
    return matched


def _value(row: dict[str, Any], key: str) -> Any:
    """The cell's number where it has one (its `<key>_value` twin for text such as an AUC with its CI)."""
    v = row.get(key)
    twin = f"{key}_value"
    return row[twin] if isinstance(v, str) and twin in row else v


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _mean_row(cells: list, spec: dict[str, Any], confidence: float, n: int) -> dict[str, Any]:
    """One averaged row: each cell the mean ± half-width, or its value where every seed agrees."""
    present = [r for r in cells if r is not None]
    row: dict[str, Any] = {"stats": {}}
    for key, _, fmt in spec["columns"]:
        raw = [r.get(key) for r in present]
        if all(json.dumps(v, default=str) == json.dumps(raw[0], default=str) for v in raw):
            row[key] = _fmt(raw[0], fmt)
            continue
        nums = [_value(r, key) for r in present]
        nums = [v for v in nums if _number(v)]
        if not nums or any(not _number(_value(r, key)) and r.get(key) is not None for r in present):
            row[key], row["stats"][key] = "varies", {"values": raw}
            continue
        st = interval(nums, confidence)
        row["stats"][key] = st
        row[key] = _pm(st, fmt, len(nums) < n, n)
    if len(present) < n:
        first = spec["columns"][0][0]
        row[first] = f"{row[first]} ({len(present)} of {n})"
    return row


def _delta_rows(matched: dict[str, list], spec: dict[str, Any], ref: Any, confidence: float) -> list[dict]:
    """Each row minus the reference row with the same other index values, seed by seed."""
    index = spec["index"]
    by_rest: dict[str, str] = {}
    for key, cells in matched.items():
        row = next(r for r in cells if r is not None)
        if _label(row, index) == ref:
            by_rest[_rest(key)] = key
    out = []
    for key, cells in matched.items():
        row0 = next(r for r in cells if r is not None)
        ref_key = by_rest.get(_rest(key))
        if ref_key is None or ref_key == key:
            continue
        refs = matched[ref_key]
        row: dict[str, Any] = {c: _fmt(row0.get(c), f) for c, _, f in spec["columns"] if c in index}
        row["stats"] = {}
        for c, _, fmt in spec["columns"]:
            if c in index:
                continue
            pairs = [(_value(a, c), _value(b, c))
                     for a, b in zip(cells, refs) if a is not None and b is not None]
            diffs = [a - b for a, b in pairs if _number(a) and _number(b)]
            if not diffs:
                row[c] = "-"
                continue
            st = interval(diffs, confidence)
            st["excludes_zero"] = bool(st["half"] is not None and abs(st["mean"]) > st["half"])
            row["stats"][c] = st
            row[c] = _pm(st, fmt, False, len(diffs), signed=True) + ("*" if st["excludes_zero"] else "")
        out.append(row)
    return out


def _rest(key: str) -> str:
    """A row key without its label: the other index values and the repeat number."""
    ident, nth = key.rsplit("#", 1)
    return json.dumps(json.loads(ident)[1:]) + "#" + nth


def _fmt(v: Any, spec: str) -> str:
    if v is None:
        return "-"
    try:
        return spec.format(v)
    except (ValueError, TypeError):
        return str(v)


def _num_spec(spec: str, signed: bool = False) -> str:
    """The column's number format for a mean (a plain '{}' or '{:,}' column holds counts: 3 digits)."""
    if spec in ("{}", "{:,}") or not spec.startswith("{:"):
        spec = "{:.3g}"
    return "{:+" + spec[2:] if signed and spec[2:3] not in "+- " else spec


def _pm(st: dict[str, Any], fmt: str, partial: bool, n: int, signed: bool = False) -> str:
    text = _num_spec(fmt, signed).format(st["mean"])
    if st["half"] is not None:
        text += " ± " + _num_spec(fmt).format(st["half"])
    return text + (f" ({st['n']} of {n})" if partial else "")


def _rel(path: Path, out: Path) -> str:
    try:
        return Path(path).resolve().relative_to(Path(out).resolve()).as_posix()
    except ValueError:
        return str(path)


def _plot(rows: list[dict[str, Any]], spec: dict[str, Any], path: Path, seeds: Sequence[Any]) -> Path | None:
    """The first table's varying measures: each seed's value as a dot, the mean with its interval."""
    keys = [(k, t) for k, t, _ in spec["columns"]
            if not _COST.search(k) and any("mean" in r["stats"].get(k, {}) for r in rows)][:PLOTTED]
    if not keys:
        return None
    labels = [str(r[spec["columns"][0][0]]) for r in rows]
    fig, axes = figure(len(keys), width=max(3.6, 0.5 * len(rows) + 1.5), height=3.8)
    for ax, (key, title) in zip(axes, keys):
        for j, r in enumerate(rows):
            st = r["stats"].get(key)
            if not st or "mean" not in st:
                continue
            vals = st["values"]
            xs = [j + 0.12 * (i - (len(vals) - 1) / 2) / max(len(vals), 1) for i in range(len(vals))]
            ax.scatter(xs, vals, s=14, color="tab:blue", alpha=0.6, label="a seed" if j == 0 else None)
            ax.errorbar([j], [st["mean"]], yerr=[st["half"] or 0], fmt="D", color="black", capsize=4,
                        markersize=4, label="mean ± CI" if j == 0 else None)
        ax.set_xticks(range(len(rows)), labels, rotation=45, ha="right", fontsize=7)
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Over seeds {list(seeds)}", fontsize=9)
    return save(fig, path)


def _comparable(config: dict[str, Any]) -> dict[str, Any]:
    """The experiment config without what replicates differ in or what cannot change a figure."""
    c = json.loads(json.dumps(config))
    for path in _NOT_COMPARED:
        node = c
        for part in path[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(path[-1], None)
    return c


def _first_difference(a: Any, b: Any, path: str = "") -> tuple[str, Any, Any] | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            d = _first_difference(a.get(k), b.get(k), f"{path}.{k}" if path else k)
            if d is not None:
                return d
        return None
    return None if a == b else (path, a, b)


def aggregate_folders(dirs: Sequence[str | Path], out: str | Path, *, reference: str = "",
                      confidence: float = 0.95, overwrite: bool = False) -> dict[str, Any]:
    """`memorize aggregate`: the reports in `dirs` (one experiment, one seed each) averaged into `out`."""
    from memorization.experiments import KINDS  # deferred: that package imports this module

    out = Path(out)
    if isinstance(confidence, bool) or not 0 < confidence < 1:
        raise fail("--confidence", confidence, "pass a level in (0, 1), e.g. 0.95")
    check_writable("--out", out)
    if any(out.resolve() == Path(d).resolve() for d in dirs):
        raise fail("--out", str(out), "is one of the replicates; write the average to a folder of its own")
    if (out / "report.json").exists() and not overwrite:
        raise fail("--out", str(out), "holds a report already; pass --overwrite to replace it, or choose "
                   "another folder")
    reports = read_reports(dirs)
    check_replicates(reports, [Path(d) for d in dirs])
    kind = reports[0].get("kind")
    if kind not in KINDS:
        raise fail(f"{dirs[0]}: kind", kind, f"not an experiment report; kinds: {', '.join(KINDS)}")
    seeds = [((r.get("config") or {}).get("base") or {}).get("seed") for r in reports]
    module = importlib.import_module(KINDS[kind])
    cfg = config_of(module, reports[0], seeds, reference, confidence)
    outputs = aggregate(reports, [Path(d) for d in dirs], out, confidence=confidence,
                        reference=reference or getattr(module, "REFERENCE", ""),
                        reference_field="--reference", given=bool(reference))
    return write_outputs(out, outputs, cfg, sum(r.get("seconds") or 0 for r in reports))


def read_reports(dirs: Sequence[str | Path]) -> list[dict[str, Any]]:
    """Each folder's report.json (ConfigError naming a folder without one, or one that is unreadable)."""
    out = []
    for d in dirs:
        p = Path(d) / "report.json"
        if not p.is_file():
            raise fail("reports", str(d), "has no report.json: give experiment output folders (OUT of "
                       "memorize run)")
        try:
            out.append(json.loads(p.read_text()))
        except json.JSONDecodeError as e:
            raise fail("reports", str(p), f"is not JSON ({e.msg}); rerun that experiment") from None
    return out


def config_of(module: Any, report: dict[str, Any], seeds: list[int], reference: str,
              confidence: float) -> Any:
    """The experiment config an aggregated report records: the first replicate's, named without its seed."""
    data = json.loads(json.dumps(report.get("config") or {}))
    data["name"] = re.sub(r"-seed\d+$", "", data.get("name") or report.get("kind", "replicates"))
    data["replicate"] = {"seeds": seeds, "reference": reference, "confidence": confidence}
    return build_experiment(module.Config, data)


__all__ = ["aggregate", "aggregate_folders", "check_replicates", "config_of", "interval", "read_reports",
           "run_replicates", "seeded"]
