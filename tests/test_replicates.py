"""Replicates over seeds: every table averaged with Student-t intervals, paired differences against one
row, rows matched by their index; an experiment run per seed in one command or as separate jobs."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
from test_experiments_runs import CONFIGS, MICRO

from memorization.cli import main
from memorization.experiments import run_experiment
from memorization.experiments.averaging import interval, text_cell
from memorization.experiments.goldfish_extreme import Config as ExtremeConfig
from memorization.experiments.questions import format_auc
from memorization.experiments.replicates import aggregate, aggregate_folders, check_replicates, seeded
from memorization.experiments.reporting import Outputs, Shown, Table, write_outputs
from memorization.experiments.spec import build_experiment
from memorize_core import ConfigError

T_975_2 = 4.302652729911275  # t_{0.975} at 2 degrees of freedom (3 seeds), from a table
COLS = [["run", "run", "{}"], ["loss", "loss", "{}"], ["em", "EM", "{:.0%}"], ["auc", "AUC [CI]", "{}"],
        ["note", "note", "{}"]]
PCOLS = [["run", "run", "{}"], ["pass", "pass", "{}"], ["val", "val loss", "{:.3f}"]]


def _report(seed: int, rows: list[dict], passes: list[dict], **config) -> dict:
    cfg = {"kind": "goldfish-extreme", "name": "x",
           "base": {"seed": seed, "trainer": {"seed": seed, "lr": 1e-3}}}
    cfg["base"]["trainer"].update(config)
    return {"title": "T", "kind": "goldfish-extreme", "seconds": 10.0, "config": cfg,
            "tables": {"Summary": rows, "Per pass": passes},
            "table_specs": {"Summary": {"columns": COLS, "index": ["run"]},
                            "Per pass": {"columns": PCOLS, "index": ["run", "pass"]}}}


def _row(run: str, em: float, auc: float, note: str = "same") -> dict:
    return {"run": run, "loss": "standard" if run == "standard" else "goldfish", "em": em,
            "auc": f"{auc:.2f} [0.1, 0.9]", "auc_value": auc, "note": note}


def _three() -> list[dict]:
    ems = {"standard": [0.6, 0.7, 0.8], "goldfish": [0.0, 0.1, 0.0]}
    aucs = {"standard": [0.9, 0.95, 1.0], "goldfish": [0.8, 0.85, 0.86]}
    reports = []
    for i in range(3):
        rows = [_row(r, ems[r][i], aucs[r][i], note=f"seed {i}" if r == "goldfish" else "same")
                for r in ("standard", "goldfish")]
        if i == 2:
            rows.reverse()  # another order: rows are matched by their index, not their place
        passes = [{"run": r, "pass": p, "val": 3.0 + p + (0.1 * i if r == "goldfish" else 0.0)}
                  for r in ("standard", "goldfish") for p in (0, 1)]
        if i == 0:
            rows.append(_row("dedup", 0.2, 0.7))  # a row one seed has
        reports.append(_report(i, rows, passes))
    return reports


def test_text_cells_over_seeds_show_each_seeds_numbers_or_say_they_vary():
    assert text_cell(["a (3)", "a (3)"]) == "a (3)"
    assert text_cell(["seen_once (39)", "seen_once (42)", "seen_once (40)"]) == "seen_once (39/42/40)"
    assert text_cell(["x 1.5 of 2", "x 2.25 of 3"]) == "x 1.5/2.25 of 2/3"
    assert text_cell(["seen once", "duplicated"]) == "varies"
    assert text_cell(["a (3)", "a (3) b"]) == "varies"
    assert text_cell(["p 1e-05", "p 2.5e-05"]) == "p 1e-05/2.5e-05"  # a number with its exponent
    assert text_cell(["a (3)", None, "a (4)"]) == "a (3/?/4)"  # the seed without it is a '?'
    assert text_cell(["a (3)", None]) == "a (3)"  # where the others agree ('(k of n)' marks the row)


def test_a_row_told_apart_by_an_index_key_the_table_does_not_show_keeps_its_label_in_the_differences(
        tmp_path):
    """Rows named by (arm, part, scheme) where `part` is no column: the difference table carries the shown
    text column ('documents') that tells the parts apart, and leaves text columns out where the index is
    shown whole."""
    cols = [["arm", "arm", "{}"], ["docs", "documents", "{}"], ["scheme", "decoding", "{}"],
            ["em", "EM", "{:.0%}"]]
    reports = []
    for i in range(3):
        rows = [{"arm": arm, "part": part, "docs": f"{part} ({n + i})", "scheme": "greedy",
                 "em": em + 0.1 * i}
                for arm, em0 in (("none", 0.5), ("goldfish", 0.0))
                for part, n, em in (("seen_once", 39, em0), ("duplicated", 6, em0 + 0.3))]
        rep = _report(i, [_row("none", 0.5, 0.9), _row("goldfish", 0.1, 0.8)], [])
        rep["tables"]["Beyond"] = rows
        rep["table_specs"]["Beyond"] = {"columns": cols, "index": ["arm", "part", "scheme"]}
        reports.append(rep)
    o = aggregate(reports, [tmp_path / f"seed-{i}" for i in range(3)], tmp_path / "avg", reference="none")
    tables = {t.title: t for t in o.tables}
    mean = next(t for k, t in tables.items() if k.startswith("Beyond: mean"))
    assert [r["docs"] for r in mean.rows] == ["seen_once (39/40/41)", "duplicated (6/7/8)"] * 2
    delta = next(t for k, t in tables.items() if k.startswith("Beyond: each row"))
    assert [c[0] for c in delta.columns] == ["arm", "docs", "scheme", "em"]
    assert [(r["arm"], r["docs"], r["em"]) for r in delta.rows] == [
        ("goldfish", "seen_once (39/40/41)", "-50% in every seed"),
        ("goldfish", "duplicated (6/7/8)", "-50% in every seed")]
    summary = next(t for k, t in tables.items() if k.startswith("Summary: each row"))
    assert "loss" not in [c[0] for c in summary.columns]  # a text column, and the index is shown whole


def test_the_interval_is_the_student_t_interval():
    st = interval([1.0, 2.0, 3.0], 0.95)
    assert st["mean"] == 2.0 and st["sd"] == pytest.approx(1.0)
    assert st["half"] == pytest.approx(T_975_2 / math.sqrt(3))
    one = interval([5.0], 0.95)
    assert one["mean"] == 5.0 and one["half"] is None


def test_tables_are_averaged_row_by_row_and_differenced_by_seed(tmp_path):
    o = aggregate(_three(), [tmp_path / f"seed-{i}" for i in range(3)], tmp_path / "avg")
    tables = {t.title.split(":")[0] + (" delta" if "paired" in t.title else ""): t for t in o.tables}
    rows = {r["run"]: r for r in tables["Summary"].rows}
    # rows matched by index though seed 2 lists them the other way round
    assert rows["standard"]["stats"]["em"]["values"] == [0.6, 0.7, 0.8]  # in seed order
    assert rows["standard"]["em"] == "70% ± 25%"  # 0.1 · t / sqrt(3) = 0.248
    assert rows["standard"]["loss"] == "standard" and rows["standard"]["note"] == "same"
    assert rows["goldfish"]["note"] == "seed 0/1/2"  # texts differing only in a number: each seed's
    # the AUC cell is text with a number behind it: averaged by that number
    assert rows["goldfish"]["stats"]["auc"]["mean"] == pytest.approx((0.8 + 0.85 + 0.86) / 3)
    assert rows["dedup (1 of 3)"]["em"] == "20%"
    # paired: goldfish minus standard seed by seed, [-0.6, -0.6, -0.8]
    delta = {r["run"]: r for r in tables["Summary delta"].rows}
    em = delta["goldfish"]["stats"]["em"]
    assert em["values"] == pytest.approx([-0.6, -0.6, -0.8])
    assert em["half"] == pytest.approx(T_975_2 * interval([-0.6, -0.6, -0.8], 0.95)["sd"] / math.sqrt(3))
    assert em["excludes_zero"] and delta["goldfish"]["em"].endswith("*")
    assert delta["goldfish"]["em"].startswith("-67% ± ")
    assert delta["goldfish"]["auc"].startswith("-0.113 ± ")  # -0.1, -0.1, -0.14
    assert delta["dedup (1 of 3)"]["em"] == "-40% (1 of 3)" and "standard" not in delta
    assert delta["dedup (1 of 3)"]["stats"]["em"]["values"] == [pytest.approx(-0.4), None, None]
    # the per-pass table: each run's pass p against standard's pass p of the same seed
    per_pass = tables["Per pass delta"].rows
    assert [(r["run"], r["pass"]) for r in per_pass] == [("goldfish", "0"), ("goldfish", "1")]
    assert all(r["stats"]["val"]["values"] == pytest.approx([0.0, 0.1, 0.2]) for r in per_pass)
    assert not per_pass[0]["stats"]["val"]["excludes_zero"]  # 0.1 ± 0.248 covers 0
    assert (tmp_path / "avg" / "replicates.png").is_file()


def test_an_experiments_own_reference_falls_back_to_the_first_row_where_it_has_none(tmp_path):
    dirs = [tmp_path / f"s{i}" for i in range(3)]
    o = aggregate(_three(), dirs, tmp_path / "a", preferred="none")  # mitigations' REFERENCE
    assert any("'standard', paired" in t.title for t in o.tables)
    o = aggregate(_three(), dirs, tmp_path / "b", preferred="goldfish")
    assert any("'goldfish', paired" in t.title for t in o.tables)


def test_a_column_no_row_differs_in_is_left_out_of_the_differences(tmp_path):
    reports = _three()
    for rep in reports:
        for row in rep["tables"]["Summary"]:
            row["em"] = 0.5
    o = aggregate(reports, [tmp_path / f"s{i}" for i in range(3)], tmp_path / "avg")
    delta = next(t for t in o.tables if t.title.startswith("Summary") and "paired" in t.title)
    assert [c[0] for c in delta.columns] == ["run", "auc"]


@pytest.mark.parametrize("change, needle", [
    (lambda r: r.update(kind="mitigations"), "kind='mitigations'"),
    (lambda r: r["config"]["base"]["trainer"].update(lr=5e-4), "config.base.trainer.lr=0.0005"),
    (lambda r: r["config"]["base"].update(seed=0), "ran that seed too"),
    (lambda r: r.update(replicate={"seeds": [0, 1]}), "already an average"),
])
def test_reports_that_are_not_replicates_are_refused(tmp_path, change, needle):
    reports = _three()
    check_replicates(reports, [tmp_path / f"s{i}" for i in range(3)])
    change(reports[1])
    with pytest.raises(ConfigError, match=needle):
        check_replicates(reports, [tmp_path / f"s{i}" for i in range(3)])


def test_a_reference_no_table_holds_is_refused_before_anything_is_written_or_noted_after_training(tmp_path):
    dirs = [tmp_path / f"s{i}" for i in range(3)]
    with pytest.raises(ConfigError, match="^replicate.reference='nope': .* of dedup, goldfish, standard$"):
        aggregate(_three(), dirs, tmp_path / "avg", reference="nope")
    assert not (tmp_path / "avg").exists()
    o = aggregate(_three(), dirs, tmp_path / "avg", reference="nope", strict=False)  # the run path
    assert any("'nope' names no row" in n for n in o.notes)
    assert any("'standard', paired" in t.title for t in o.tables)


def test_numbered_rows_missing_numbers_and_constant_differences(tmp_path):
    reports = _three()
    for i, rep in enumerate(reports):
        rep["tables"]["Summary"] = [{"run": 1, "em": 0.5, "auc": f"x{i}", "auc_value": 0.5 + 0.1 * i},
                                    {"run": 2, "em": 0.75, "auc": f"y{i}",
                                     "auc_value": None if i == 1 else 0.9}]
    o = aggregate(reports, [tmp_path / f"s{i}" for i in range(3)], tmp_path / "avg", reference="1")
    mean = {r["run"]: r for r in o.tables[0].rows}
    assert mean["2"]["stats"]["auc"]["values"] == [0.9, None, 0.9]  # a NaN stored as null is missing
    assert mean["2"]["auc"] == "0.9 ± 0 (2 of 3)"  # two seeds agree; the third has no value
    delta = next(t for t in o.tables if t.title.startswith("Summary") and "paired" in t.title).rows
    assert delta[0]["em"] == "+25% in every seed"  # the same difference each time: no interval
    assert delta[0]["auc"].startswith("+0.3 ± ")


def test_a_text_cell_keeps_its_number_in_report_json(tmp_path):
    cell = format_auc({"auc": 0.8123, "auc_ci": [0.7, 0.9]})
    assert isinstance(cell, Shown) and cell == "0.81 [0.70, 0.90]" and cell.value == 0.8123
    cfg = build_experiment(ExtremeConfig, {"kind": "goldfish-extreme",
                                           "base": {"wandb": {"mode": "disabled"}}})
    cols = (("run", "run", "{}"), ("auc", "AUC", "{}"))
    o = Outputs("T", "goldfish-extreme", runs=[], tables=[Table("S", [{"run": "a", "auc": cell}], cols)])
    write_outputs(tmp_path, o, cfg, 1.0)
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["tables"]["S"] == [{"run": "a", "auc": "0.81 [0.70, 0.90]", "auc_value": 0.8123}]
    assert rep["table_specs"]["S"] == {"columns": [list(c) for c in cols], "index": ["run"]}


def test_a_replicate_sets_both_seeds_and_runs_no_replicates_itself():
    cfg = build_experiment(ExtremeConfig, {"kind": "goldfish-extreme", "replicate": {"seeds": [3, 4]}})
    s = seeded(cfg, 4)
    assert (s.base.seed, s.base.trainer.seed, s.replicate.seeds) == (4, 4, [])
    assert s.name == "goldfish-extreme-seed4"


def _mtimes(out: Path) -> dict[str, float]:
    return {str(p.relative_to(out)): p.stat().st_mtime_ns for p in sorted(out.glob("seed-*/runs/*/run.json"))}


def _val_losses(report: dict) -> list:
    summary = next(rows for title, rows in report["tables"].items() if title.startswith("Summary: mean"))
    return [r["stats"]["val_loss"]["values"] for r in summary]


def test_an_experiment_over_seeds_in_one_command_and_as_separate_jobs(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEMORIZE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "extreme"
    micro = MICRO + ["variants=[standard, hash]"]
    over = micro + ["replicate.seeds=[0, 5]"]
    started = time.perf_counter()
    report = run_experiment(CONFIGS / "goldfish-extreme.yaml", out=out, overrides=over)
    wall = time.perf_counter() - started
    seeds = [json.loads((out / f"seed-{s}" / "report.json").read_text()) for s in (0, 5)]
    for s, rep in zip((0, 5), seeds):
        assert (rep["config"]["base"]["seed"], rep["config"]["base"]["trainer"]["seed"]) == (s, s)
        assert rep["config"]["base"]["wandb"]["group"] == "goldfish-extreme"  # the seeds' runs together
        key = json.loads((out / f"seed-{s}" / "runs" / "standard" / "inputs.json").read_text())
        assert key["run"]["seed"] == s and key["run"]["trainer"]["seed"] == s
    assert seeds[0]["seconds"] + seeds[1]["seconds"] <= wall  # each seed timed on its own
    assert seeds[0]["tables"]["Summary"][0]["val_loss"] != seeds[1]["tables"]["Summary"][0]["val_loss"]
    assert _val_losses(report)[0] == [r["tables"]["Summary"][0]["val_loss"] for r in seeds]
    md = (out / "report.md").read_text()
    assert "[seed 5](seed-5/report.md)" in md and (out / "replicates.png").is_file()
    before = _mtimes(out)
    assert len(before) == 4

    again = run_experiment(CONFIGS / "goldfish-extreme.yaml", out=out, overrides=over)
    assert _mtimes(out) == before and _val_losses(again) == _val_losses(report)  # every sub-run reused
    (out / "seed-0" / "keep.txt").write_text("mine")
    run_experiment(CONFIGS / "goldfish-extreme.yaml", out=out, overrides=over, overwrite=True)
    after = _mtimes(out)
    assert all(after[k] != before[k] for k in before) and (out / "seed-0" / "keep.txt").is_file()

    # seed 5 run again as a job of its own, then averaged with seed 0: the same figures
    job = tmp_path / "job5"
    run_experiment(CONFIGS / "goldfish-extreme.yaml", out=job, overrides=micro + ["base.seed=5",
                                                                               "base.trainer.seed=5"])
    assert main(["aggregate", str(out / "seed-0"), str(job), "--out", str(tmp_path / "avg")]) == 0
    assert _val_losses(json.loads((tmp_path / "avg" / "report.json").read_text())) == _val_losses(report)
    capsys.readouterr()
    assert main(["aggregate", str(out / "seed-0"), str(job), "--out", str(tmp_path / "avg")]) == 2
    assert "holds a report already" in capsys.readouterr().err
    assert main(["aggregate", str(out / "seed-0"), str(out / "seed-0"), "--out", str(tmp_path / "b")]) == 2
    assert "ran that seed too" in capsys.readouterr().err and not (tmp_path / "b").exists()
    with pytest.raises(ConfigError, match="^--out="):
        aggregate_folders([out / "seed-0", out / "seed-5"], out / "seed-5")
    # one OUT never holds both a single run and replicates
    with pytest.raises(ConfigError, match="holds replicates over seeds"):
        run_experiment(CONFIGS / "goldfish-extreme.yaml", out=out, overrides=micro)
    with pytest.raises(ConfigError, match="holds a single-seed experiment"):
        run_experiment(CONFIGS / "goldfish-extreme.yaml", out=job, overrides=over)


@pytest.mark.distributed
def test_replicates_on_two_ranks_equal_the_serial_replicates(tmp_path, monkeypatch):
    """Every rank runs every seed in lockstep (data parallel, gloo); rank 0 alone writes."""
    import os
    import subprocess
    import sys

    monkeypatch.setenv("MEMORIZE_CACHE", str(tmp_path / "cache"))
    over = MICRO + ["variants=[standard]", "replicate.seeds=[0, 3]"]
    serial = run_experiment(CONFIGS / "goldfish-extreme.yaml", out=tmp_path / "serial", overrides=over)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    config = str(CONFIGS / "goldfish-extreme.yaml")
    argv = [sys.executable, "-m", "memorization", "run", config, "--nproc-per-node", "2", "--grid", "1,1,1,2",
            "--out", str(tmp_path / "ranks"), *over]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = json.loads((tmp_path / "ranks" / "report.json").read_text())
    assert _val_losses(ranks)[0] == pytest.approx(_val_losses(serial)[0], abs=1e-5)
    assert done.stdout.count("replicate 2 of 2: seed 3") == 1  # said once, by rank 0


def test_the_first_index_name_is_the_label_and_the_others_pair_within(tmp_path):
    """A sizes x losses table indexed (loss, size): goldfish is differenced against standard of its size."""
    reports = _three()
    for i, rep in enumerate(reports):
        rep["tables"]["Summary"] = [
            {"run": size, "loss": loss, "em": base + (0.3 if loss == "standard" else 0) + 0.01 * i}
            for size, base in (("a", 0.1), ("b", 0.5)) for loss in ("standard", "goldfish")]
        rep["table_specs"]["Summary"]["index"] = ["loss", "run"]
    o = aggregate(reports, [tmp_path / f"s{i}" for i in range(3)], tmp_path / "avg")
    delta = next(t for t in o.tables if t.title.startswith("Summary") and "paired" in t.title)
    assert "'standard', paired" in delta.title
    assert [(r["run"], r["loss"], r["em"]) for r in delta.rows] == [("a", "goldfish", "-30% in every seed"),
                                                                    ("b", "goldfish", "-30% in every seed")]


def test_an_index_key_need_not_be_shown(tmp_path):
    """Unlearning's attack table: stages read 'retrained' and 'unlearned', a hidden key pairs them."""
    stages = (("retrain", "retrained", "", 0.1), ("retrain", "+ leads attack", "leads", 0.2),
              ("npo", "unlearned", "", 0.15), ("npo", "+ leads attack", "leads", 0.5))
    reports = _three()
    for i, rep in enumerate(reports):
        rep["tables"]["Summary"] = [{"run": run, "stage": stage, "attack": attack, "em": em + 0.01 * i}
                                    for run, stage, attack, em in stages]
        rep["table_specs"]["Summary"] = {"columns": [["run", "method", "{}"], ["stage", "model", "{}"],
                                                     ["em", "EM", "{:.0%}"]], "index": ["run", "attack"]}
    o = aggregate(reports, [tmp_path / f"s{i}" for i in range(3)], tmp_path / "avg", reference="retrain")
    delta = next(t for t in o.tables if t.title.startswith("Summary") and "paired" in t.title).rows
    assert [r["em"] for r in delta] == ["+5% in every seed", "+30% in every seed"]  # as left, after leads
