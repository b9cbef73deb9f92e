"""Replicates: one experiment repeated over seeds, every table averaged, and paired differences.

A single run's figures hold one draw of everything random: which leads are members, where copies and
canaries land, the data order, the noise. `replicate.seeds: [0, 1, 2]` runs the whole experiment once
per seed (OUT/seed-S, each its own complete report, sub-runs reused when done) with base.seed and
base.trainer.seed set to S, then writes OUT/report.{json,md} and OUT/replicates.png: every table
averaged over the seeds, and every table that holds the reference row differenced against it seed by
seed (memorization.experiments.averaging). The reference is `replicate.reference`, else the
experiment's own REFERENCE where its tables have that row (mitigations: none; unlearning: retrain),
else the first table's first row. Two rows of one seed share that seed's draw, so its luck cancels in
their difference: the paired interval is what says whether a mitigation changed a figure.

`memorize aggregate DIR...` does the same for reports of one experiment run as separate jobs (one per
seed), after checking that they differ in their seeds and nothing else.
"""
from __future__ import annotations

import importlib
import json
import re
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from memorization.experiments import averaging as avg
from memorization.experiments.reporting import Outputs, Table, write_outputs
from memorization.experiments.runner import Experiment, say
from memorization.experiments.spec import Replicate, build_experiment
from memorization.outputs import check_writable
from memorize_core import fail

SEED_DIR = "seed-{}"
PLOT = "replicates.png"
# settings that cannot change a figure, or that replicates differ in by design
_NOT_COMPARED = (("name",), ("replicate",), ("samples",), ("per_run_wandb",), ("base", "seed"),
                 ("base", "name"), ("base", "wandb"), ("base", "trainer", "seed"),
                 ("base", "trainer", "progress"), ("base", "eval", "batch_size"))


def seeded(cfg: Any, seed: int) -> Any:
    """The experiment config of one replicate: base.seed = base.trainer.seed = seed, no replicate; its
    W&B run grouped with the other seeds' under the experiment's name."""
    wandb = replace(cfg.base.wandb, group=cfg.base.wandb.group or cfg.name)
    base = replace(cfg.base, seed=seed, trainer=replace(cfg.base.trainer, seed=seed), wandb=wandb)
    return replace(cfg, name=f"{cfg.name}-seed{seed}", base=base, replicate=Replicate())


def check_out(out: Path, replicates: bool) -> None:
    """Refuse an OUT that holds the other kind of result (single-seed runs/ vs seed-S/ folders): their
    reports would mix."""
    if not out.is_dir():
        return
    if replicates and (out / "runs").is_dir():
        raise fail("--out", str(out), "holds a single-seed experiment (OUT/runs); write the replicates to "
                   "another --out")
    if not replicates and any(p.is_dir() for p in out.glob(SEED_DIR.format("*"))):
        raise fail("--out", str(out), "holds replicates over seeds (OUT/seed-*); write this single run to "
                   "another --out, or add replicate.seeds")


def run_replicates(module: Any, cfg: Any, out: Path, *, grid: str | None, overwrite: bool) -> dict[str, Any]:
    """Run the experiment once per seed into OUT/seed-S (each resumable), then write the averaged report.

    Every rank runs every seed in lockstep; the main rank writes the seeds' reports after the last one,
    so no rank waits in a collective while another writes."""
    check_writable("--out", out)
    check_out(out, replicates=True)
    done = []
    for i, seed in enumerate(cfg.replicate.seeds):
        scfg = seeded(cfg, seed)
        exp = Experiment(out / SEED_DIR.format(seed), grid_spec=grid, overwrite=overwrite).open()
        say(f"replicate {i + 1} of {len(cfg.replicate.seeds)}: seed {seed} -> {exp.out}")
        outputs = module.run(scfg, exp)
        done.append((scfg, exp, outputs, exp.seconds))
    if not done[0][1].is_main:
        return {}
    reports = [write_outputs(exp.out, outputs, scfg, seconds) for scfg, exp, outputs, seconds in done]
    sources = [exp.out for _, exp, _, _ in done]
    check_replicates(reports, sources)
    outputs = aggregate(reports, sources, out, reference=cfg.replicate.reference,
                        preferred=getattr(module, "REFERENCE", ""), strict=False)
    return write_outputs(out, outputs, cfg, sum(r["seconds"] for r in reports))


def check_replicates(reports: Sequence[dict[str, Any]], sources: Sequence[Path]) -> None:
    """Refuse reports that are not replicates of one experiment (ConfigError naming report and field)."""
    if len(reports) < 2:
        raise fail("reports", [str(s) for s in sources], "give two or more replicates (one per seed)")
    first = _comparable(reports[0].get("config") or {})
    seen: dict[Any, Path] = {}
    for report, src in zip(reports, sources):
        if "replicate" in report:
            raise fail("reports", str(src), "is already an average over seeds; give the seeds' own folders")
        if report.get("kind") != reports[0].get("kind"):
            raise fail(f"{src}: kind", report.get("kind"),
                       f"replicates are one experiment; {sources[0]} is {reports[0].get('kind')}")
        where = _first_difference(first, _comparable(report.get("config") or {}))
        if where is not None:
            path, a, b = where
            raise fail(f"{src}: config.{path}", b, f"replicates differ only in their seeds; {sources[0]} has "
                       f"{a!r}: rerun one of them with the other's setting")
        seed = ((report.get("config") or {}).get("base") or {}).get("seed")
        if seed in seen:
            raise fail(f"{src}: config.base.seed", seed, f"{seen[seed]} ran that seed too; replicates need "
                       "different ones")
        seen[seed] = src


def aggregate(reports: Sequence[dict[str, Any]], sources: Sequence[Path], out: Path, *, reference: str = "",
              confidence: float = 0.95, preferred: str = "", strict: bool = True,
              reference_field: str = "replicate.reference") -> Outputs:
    """The checked replicates' tables averaged and differenced: the Outputs of the averaged report.

    A `reference` no table holds is refused where `strict` (nothing written: OUT is made after every
    check), else noted and replaced by the default, so finished training is never thrown away."""
    specs = avg.table_specs(reports)
    specs = {t: s for t, s in specs.items() if any(rep["tables"].get(t) for rep in reports)}
    if not specs:
        raise fail("reports", [str(s) for s in sources], "hold no tables; rerun the experiments")
    first = next(iter(specs))
    labels = {avg.label(r, s["index"]) for rep in reports for t, s in specs.items()
              for r in rep["tables"].get(t, [])}
    default = preferred if preferred in labels else _pairing_label(reports, first, specs[first], confidence)
    notes = []
    if reference and reference not in labels:
        if strict:
            names = sorted({avg.label(r, specs[first]["index"]) for rep in reports
                            for r in rep["tables"].get(first, [])})
            raise fail(reference_field, reference, f"name a row of the tables, e.g. one of "
                       f"{', '.join(names)}")
        notes.append(f"WARNING: {reference_field} '{reference}' names no row of the tables; the differences "
                     f"are against '{default}'.")
    ref = reference if reference in labels else default
    n = len(reports)
    tables, deltas, averaged, moved_first = [], [], {}, []
    for title, spec in specs.items():
        matched = avg.match(reports, title, spec["index"])
        rows = [avg.mean_row(cells, spec, confidence) for cells in matched.values()]
        cols = tuple((k, t, "{}") for k, t, _ in spec["columns"])
        tables.append(Table(f"{title}: mean ± {confidence:.0%} CI over {n} seeds", rows, cols,
                            tuple(spec["index"])))
        averaged[title] = rows
        diff = avg.delta_rows(matched, spec, ref, confidence)
        moved = [(k, t, "{}") for k, t, _ in avg.moved_columns(diff, spec)]
        if title == first:
            moved_first = [c[0] for c in moved]
        if diff and any(c[0] not in spec["index"] for c in moved):
            deltas.append(Table(f"{title}: each row − '{ref}', paired by seed (mean ± {confidence:.0%} CI; "
                                "* the interval excludes 0)", diff, tuple(moved), tuple(spec["index"])))
    seeds = [((rep.get("config") or {}).get("base") or {}).get("seed") for rep in reports]
    out.mkdir(parents=True, exist_ok=True)  # every refusal above has had its chance
    plots = [p for p in [avg.plot(averaged[first], specs[first], out / PLOT, seeds, moved_first)] if p]
    return Outputs(title=f"{reports[0].get('title')} (over {n} seeds)", kind=reports[0].get("kind", ""),
                   runs=[{"name": f"seed {s}", "seed": s, "report": _rel(src / "report.json", out),
                          "seconds": rep.get("seconds")} for s, src, rep in zip(seeds, sources, reports)],
                   tables=tables + deltas,
                   notes=_notes(reports, sources, out, seeds, ref, confidence) + notes,
                   plots=plots, extra={"replicate": {
                       "seeds": seeds, "reference": ref, "confidence": confidence,
                       "sources": [_rel(s, out) for s in sources]}})


def _pairing_label(reports: Sequence[dict[str, Any]], title: str, spec: dict[str, Any],
                   confidence: float) -> str:
    """The first row label of the first table that other rows of that table pair with (a "base model"
    row of another context pairs with none), else the first label."""
    matched = avg.match(reports, title, spec["index"])
    firsts = [avg.label(avg.present(cells), spec["index"]) for cells in matched.values()]
    for candidate in dict.fromkeys(firsts):
        if avg.delta_rows(matched, spec, candidate, confidence):
            return candidate
    return firsts[0]


def _notes(reports: Sequence[dict[str, Any]], sources: Sequence[Path], out: Path, seeds: list, ref: str,
           confidence: float) -> list[str]:
    n = len(reports)
    links = ", ".join(f"[seed {s}]({_rel(src / 'report.md', out)})" for s, src in zip(seeds, sources))
    return [f"{n} replicates of '{reports[0].get('title')}', seeds {seeds}; each seed's whole report: "
            f"{links}.",
            f"A cell: the mean over the seeds ± the half-width of the {confidence:.0%} Student-t interval "
            f"(t = {avg.t_quantile(confidence, n):.2f} at {n} seeds, times sd / sqrt({n})); a cell equal in "
            "every seed is shown as it is; text that differs between seeds only in its numbers shows each "
            "seed's number in turn (a/b/c); 'varies': other text that differs (the seeds' reports have it); "
            "(k of n): a row or value only k seeds have. report.json keeps each seed's value "
            "(`stats`).",
            f"Paired differences: each seed's row minus the '{ref}' row of the same seed. Both share that "
            "seed's draw (members, injected items, data order), so its luck cancels and the interval is "
            "narrower than comparing the two means. 'in every seed': the same difference each time (no "
            "interval). A column whose every difference is 0 is left out.",
            "A seed sets base.seed (the member/non-member split, where copies and canaries land, the canary "
            "secrets, a random-init model, LoRA factors) and base.trainer.seed (data order, DP-SGD's "
            "batches and noise). The goldfish hash keeps its own fixed table: it is part of the method."] + (
            ["Tests within one seed (per-document paired tests, with p-values) are not averaged: each seed's "
             "report has its own."]
            if any(s.get("per_seed") for rep in reports for s in (rep.get("table_specs") or {}).values())
            else [])


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
    sources = [Path(d) for d in dirs]
    check_replicates(reports, sources)
    kind = reports[0].get("kind")
    if kind not in KINDS:
        raise fail(f"{dirs[0]}: kind", kind, f"not an experiment report; kinds: {', '.join(KINDS)}")
    module = importlib.import_module(KINDS[kind])
    cfg = config_of(module, reports[0], reference, confidence)
    outputs = aggregate(reports, sources, out, confidence=confidence, reference=reference,
                        preferred=getattr(module, "REFERENCE", ""), reference_field="--reference")
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


def config_of(module: Any, report: dict[str, Any], reference: str, confidence: float) -> Any:
    """The experiment config the averaged report records: the first replicate's, named without its seed
    (its replicate section says how it was averaged; the seeds are in the report's `replicate`)."""
    data = json.loads(json.dumps(report.get("config") or {}))
    data["name"] = re.sub(r"-seed\d+$", "", data.get("name") or report.get("kind", "replicates"))
    data["replicate"] = {"reference": reference, "confidence": confidence}
    return build_experiment(module.Config, data)


def _rel(path: Path, out: Path) -> str:
    try:
        return Path(path).resolve().relative_to(Path(out).resolve()).as_posix()
    except ValueError:
        return str(path)


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


__all__ = ["aggregate", "aggregate_folders", "check_out", "check_replicates", "config_of", "read_reports",
           "run_replicates", "seeded"]
