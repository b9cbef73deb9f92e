"""Experiment reports: what reaches the W&B run."""
from __future__ import annotations

import json
from dataclasses import replace

from memorization.experiments.canary_exposure import Config
from memorization.experiments.reporting import Outputs, Table, table_key, write_outputs


def test_a_column_mixing_numbers_and_text_reaches_wandb_as_text(tmp_path):
    """W&B refuses a table whose column mixes numbers and text (a base-model row's '-' among pass
    numbers crashed a finished 33-minute experiment at its last line): WandbSink.log_table, which every
    W&B table goes through, logs such a column as text; the report keeps the values as they are."""
    cfg = Config(name="mixed")
    cfg = replace(cfg, base=replace(cfg.base, wandb=replace(cfg.base.wandb, mode="offline")))
    rows = [{"arm": "base model", "pass": "-", "auc": 0.5, "flag": True},
            {"arm": "none", "pass": 0, "auc": 0.75, "flag": 1}, {"arm": "none", "pass": 1, "auc": None}]
    cols = (("arm", "arm", "{}"), ("pass", "pass", "{}"), ("auc", "AUC", "{:.2f}"), ("flag", "flag", "{}"))
    out = Outputs(title="t", kind="canary-exposure", runs=[], tables=[Table("After each pass", rows, cols)])
    report = write_outputs(tmp_path, out, cfg, 1.0)
    assert report["wandb"] and next(tmp_path.glob("wandb/offline-run-*/*.wandb")).stat().st_size > 0
    assert json.loads((tmp_path / "report.json").read_text())["tables"]["After each pass"][1]["pass"] == 0


def test_a_long_table_title_reaches_wandb(tmp_path):
    """W&B names a table's artifact after its key and refuses names over 128 characters: a replicate's
    difference-table title crashed a finished 87-minute experiment at its last line."""
    cfg = Config(name="long")
    cfg = replace(cfg, base=replace(cfg.base, wandb=replace(cfg.base.wandb, mode="offline")))
    long = ("Extraction beyond greedy: (n, p)-extractable fraction: each row − 'pretrained-standard', "
            "paired by seed (mean ± 95% CI; * the interval excludes 0)")
    titles = [long, long + " again"]
    keys = [table_key(t) for t in titles]
    assert all(len(k) <= 60 for k in keys) and keys[0] != keys[1]
    assert table_key("By copy count") == "by_copy_count"
    cols = (("arm", "arm", "{}"),)
    out = Outputs(title="t", kind="canary-exposure", runs=[],
                  tables=[Table(t, [{"arm": "a"}], cols) for t in titles])
    assert write_outputs(tmp_path, out, cfg, 1.0)["wandb"]
