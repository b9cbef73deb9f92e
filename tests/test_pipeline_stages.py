"""The run pipeline's stages: composed by hand they equal run_training; the per-pass hook; closing."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
from helpers import levenshtein
from sklearn.metrics import roc_auc_score

from memorization.config import load_run_config
from memorization.eval.plots import PANEL_PX, np_threshold, pz_curves
from memorization.experiments.beyond_greedy import near_table
from memorization.experiments.passes import train_with_passes
from memorization.models import REPO_ROOT
from memorization.report import read_metrics
from memorization.train.pipeline import finish, run_training, start_run, train
from memorization.train.prepare import prepare_data
from memorization.train.report import markdown

MICRO = [
    "data.limit=6", "data.vocab_size=300", "data.block_len=32", "data.min_tokens=16", "data.held_out_limit=4",
    "model.overrides={hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, "
    "num_attention_heads: 2, num_key_value_heads: 2}",
    "eval.prefix=8", "eval.suffix=8", "trainer.batch_size=2", "trainer.epochs=3", "trainer.warmup_steps=1",
    "trainer.progress=false", "wandb.mode=disabled", "eval.mia=true", "eval.bootstrap=20",
]
TIMING = {"train_seconds"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEMORIZE_CACHE", str(tmp_path_factory.mktemp("cache")))
        cfg = load_run_config(REPO_ROOT / "configs" / "train" / "tiny-wiki.yaml", MICRO)
        yield cfg, prepare_data(cfg)


def _same(a: dict, b: dict) -> None:
    assert {k: v for k, v in a.items() if k not in TIMING} == {k: v for k, v in b.items() if k not in TIMING}


def test_stages_by_hand_equal_run_training(setup, tmp_path):
    cfg, data = setup
    whole = run_training(cfg, tmp_path / "whole", data=data)
    with start_run(cfg, tmp_path / "staged", data) as run:
        history = train(run)
        staged = finish(run)
    _same(whole, staged)
    assert whole["exact_match_rate"] is not None and len(history) == whole["steps"] == 9
    for name in ("extraction.jsonl", "metrics.jsonl"):
        a, b = ((tmp_path / d / name).read_text().splitlines() for d in ("whole", "staged"))
        if name == "metrics.jsonl":  # tokens/s differ run to run
            a, b = ([{k: v for k, v in json.loads(x).items() if k != "tokens_per_s"} for x in s]
                    for s in (a, b))
        assert a == b
    assert json.loads((tmp_path / "staged" / "run.json").read_text())["summary"]["steps"] == 9


def test_finish_writes_results_it_is_given_instead_of_extracting(setup, tmp_path):
    cfg, data = setup
    with start_run(cfg, tmp_path / "run", data) as run:
        train(run)
        summary = finish(run, scored=[], extra={"note": "given"})
    assert (tmp_path / "run" / "extraction.jsonl").read_text() == ""  # the given (empty) results
    assert summary["docs"] == 0 and summary["note"] == "given"


def test_per_pass_hook_scores_every_pass_once_and_logs_it(setup, tmp_path):
    cfg, data = setup
    out = tmp_path / "passes"
    summary = train_with_passes(cfg, out, data)
    passes = [json.loads(x) for x in (out / "passes.jsonl").read_text().splitlines()]
    assert [p["pass"] for p in passes] == [1, 2, 3] and [p["step"] for p in passes] == [3, 6, 9]
    assert passes == summary["passes"]
    assert passes[-1]["exact_match_rate"] == summary["exact_match_rate"]  # the last pass is the final one
    assert json.loads((out / "run.json").read_text())["summary"]["passes"] == passes
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [x for x in lines if "pass" in x]
    assert [(x["step"], x["pass"], x["pass_exact_match"]) for x in logged] == \
        [(p["step"], p["pass"], p["exact_match_rate"]) for p in passes]
    assert len(read_metrics(out / "metrics.jsonl")) == 9  # step metrics only
    # the last pass's sampled summary is the run's, and its rows are the run's sampled.jsonl (what paired
    # tests and memorize compare read), one per document and offset, as a run without the hook writes them
    assert summary["sampled"] == passes[-1]["sampled"]
    rows = [json.loads(x) for x in (out / "sampled.jsonl").read_text().splitlines()]
    offsets = summary["sampled"]["offsets"]
    assert len(rows) == sum(v["docs"] for v in offsets.values())
    md = (out / "report.md").read_text()
    assert "### Beyond greedy" in md and "sampled.jsonl" in md and "mia.jsonl" in md


def test_max_steps_inside_a_pass_still_scores_the_final_model_once(setup, tmp_path):
    cfg, data = setup
    cfg = replace(cfg, trainer=replace(cfg.trainer, max_steps=4))
    summary = train_with_passes(cfg, tmp_path / "cut", data)
    assert [(p["pass"], p["step"]) for p in summary["passes"]] == [(1, 3), (3, 4)]
    assert summary["passes"][-1]["exact_match_rate"] == summary["exact_match_rate"]


class _Boom:
    def on_step_end(self, trainer, metrics):
        raise RuntimeError("boom")


def test_a_failing_run_closes_its_sinks(setup, tmp_path):
    cfg, data = setup
    with pytest.raises(RuntimeError, match="boom"):
        with start_run(cfg, tmp_path / "fail", data, callbacks=[_Boom()]) as run:
            train(run)
    sinks = run.trainer.sinks
    assert sorted(type(s).__name__ for s in sinks) == ["JsonlSink", "WandbSink"]
    assert all(sink.closed for sink in sinks)
    assert not (tmp_path / "fail" / "run.json").exists()  # no summary of a run that did not finish


def _grid_runs(rank, world, cfg, out):
    from axonn.grid import ProcessGrid
    from memorization.train.prepare import prepare_data as prep

    data = prep(cfg)  # every rank prepares the same rows (the tokenizer cache is shared)
    grid = ProcessGrid(1, 1, 2, 1)
    run_training(cfg, f"{out}/whole", data=data, grid=grid)
    train_with_passes(cfg, f"{out}/passes", data, grid_spec="1,1,2,1")


@pytest.mark.distributed
def test_a_sharded_run_scores_the_same_extraction_as_the_serial_run(setup, tmp_path):
    """finish and the per-pass hook score the sharded model in place (evals on the grid) on a 1,1,2,1 grid."""
    from axonn.spawn import run_distributed

    cfg, data = setup
    serial = run_training(cfg, tmp_path / "serial", data=data)
    serial_passes = train_with_passes(cfg, tmp_path / "serial-passes", data)
    run_distributed(_grid_runs, 2, cfg, str(tmp_path / "grid"), timeout=240)
    grid = json.loads((tmp_path / "grid" / "whole" / "run.json").read_text())["summary"]
    assert grid["grid"] == "1,1,2,1"
    for key in ("exact_match_rate", "rougeL", "token_accuracy", "docs"):
        assert grid[key] == pytest.approx(serial[key], abs=1e-9), key
    assert grid["val_loss"] == pytest.approx(serial["val_loss"], rel=1e-4)
    assert grid["mia"] == serial["mia"] and serial["mia"]["non_members"] >= 2  # AUCs and CIs identical
    passes = [json.loads(x) for x in (tmp_path / "grid" / "passes" / "passes.jsonl").read_text().splitlines()]
    assert [p["pass"] for p in passes] == [1, 2, 3]
    assert [p["exact_match_rate"] for p in passes] == [p["exact_match_rate"] for p in serial_passes["passes"]]


def _png_width(path) -> int:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big")


def test_report_tells_the_runs_figures_and_plots_what_ran(setup, tmp_path):
    cfg, data = setup
    summary = run_training(cfg, tmp_path / "run", data=data)
    md = (tmp_path / "run" / "report.md").read_text()
    assert md.startswith(f"# memorize train: `{cfg.name}`")
    assert f"| {summary['final_train_loss']:.4f} | {summary['val_loss']:.4f} |" in md
    s = summary
    assert f"| {s['docs']} | {s['exact_match_rate']:.3f} | {s['token_accuracy']:.3f} |" in md
    for method, got in summary["mia"]["methods"].items():
        lo, hi = got["auc_ci"]
        assert f"| {method} | {got['auc']:.3f} [{lo:.3f}, {hi:.3f}] |" in md, method
    assert "Each document's scores are in mia.jsonl." in md and "log p_z per document in sampled.jsonl" in md
    # sampled.jsonl: every member's log p_z per scheme; the report's curves cross the (n, p) lines at the
    # summary's fractions
    smp = summary["sampled"]
    curves = pz_curves([json.loads(x) for x in (tmp_path / "run" / "sampled.jsonl").read_text().splitlines()])
    assert sorted(curves) == sorted((int(o), n) for o in smp["offsets"] for n in ["greedy", *smp["schemes"]])
    for (o, name), c in curves.items():
        assert len(c) == smp["offsets"][str(o)]["docs"] == len(data.member_docs)
        for n in cfg.eval.np_ns:
            want = smp["offsets"][str(o)]["np"]["schemes"][name][f"n={n}"]["fraction"]
            assert (c >= np_threshold(n, cfg.eval.np_p)).mean() == want, (o, name, n)
    rows = [json.loads(x) for x in (tmp_path / "run" / "mia.jsonl").read_text().splitlines()]
    n = cfg.eval.mia_docs or None
    want = [(str(i), True) for i in data.member_doc_ids[:n]]
    want += [(str(i), False) for i in data.held_out_doc_ids[:n]]
    assert [(r["id"], r["member"]) for r in rows] == want
    for method, got in summary["mia"]["methods"].items():  # the file's scores give the summary's AUCs
        auc = roc_auc_score([r["member"] for r in rows], [r[method] for r in rows])
        assert auc == pytest.approx(got["auc"], abs=1e-12), method
    assert "](report.png)" in md
    assert _png_width(tmp_path / "run" / "report.png") == 4 * PANEL_PX  # loss, extraction, p_z, MIA
    # a run that scores nothing: the loss panel alone, no evaluation sections
    bare = replace(cfg, eval=replace(cfg.eval, extraction=False, mia=False))
    run_training(bare, tmp_path / "bare", data=data)
    md = (tmp_path / "bare" / "report.md").read_text()
    assert "## Extraction" not in md and "## Membership" not in md and "| final training loss |" in md
    assert _png_width(tmp_path / "bare" / "report.png") == PANEL_PX
    for name in ("mia.jsonl", "extraction.jsonl", "sampled.jsonl"):
        assert not (tmp_path / "bare" / name).exists(), name


def test_near_verbatim_of_a_run_starts_at_its_log_pz(setup, tmp_path):
    """eval.near_verbatim=2: near_verbatim.jsonl holds each member's bounds, whose d = 0 is sampled.jsonl's
    log p_z; the summary, report.md and report.png carry it."""
    cfg, data = setup
    nv = replace(cfg, eval=replace(cfg.eval, mia=False, sampling="t=1.0", near_verbatim=2, nv_beams=2))
    summary = run_training(nv, tmp_path / "run", data=data)
    lines = [[json.loads(x) for x in (tmp_path / "run" / f).read_text().splitlines()]
             for f in ("near_verbatim.jsonl", "sampled.jsonl")]
    near, sampled = lines
    assert [r["doc"] for r in near] == [r["doc"] for r in sampled] == [str(i) for i in data.member_doc_ids]
    for r, want in zip(near, sampled):
        b = r["bound"]["t=1.0"]
        assert b[0] == pytest.approx(want["logpz"]["t=1.0"], abs=1e-4) and b[0] <= b[1] <= b[2]
        assert isinstance(r["likeliest"]["t=1.0"]["text"], str) and isinstance(r["suffix"], str)
    at = summary["near_verbatim"]["offsets"]["0"]
    assert summary["near_verbatim"]["max_edits"] == 2 and at["docs"] == len(near)
    assert all(x["edits"] > 0 for x in summary["near_verbatim"]["examples"])
    assert list(at["np"]["t=1.0"]["schemes"]) == ["d=0", "d=1", "d=2"]
    md = (tmp_path / "run" / "report.md").read_text()
    assert "### Near-verbatim" in md and "near_verbatim.jsonl" in md
    assert _png_width(tmp_path / "run" / "report.png") == 4 * PANEL_PX  # loss, extraction, p_z, near
    # an experiment's table of its runs: the fractions at the largest n, per d
    table = near_table([{**summary, "name": "a"}])
    (row,) = table.rows
    n = nv.eval.np_ns[-1]
    fractions = {d: at["np"]["t=1.0"]["schemes"][d][f"n={n}"]["fraction"] for d in ("d=0", "d=1", "d=2")}
    assert row == {"run": "a", "offset": 0, "docs": len(near), "scheme": "t=1.0",
                   "median": at["median_log10"]["t=1.0"]["d=2"], **fractions}
    assert "within d changed tokens" in table.title


def test_near_verbatim_of_a_run_by_edit_distance(setup, tmp_path):
    """eval.nv_distance=levenshtein: the run's rows' likeliest paths carry their edit distance to the
    suffix, and the run's report and an experiment's table say edits."""
    cfg, data = setup
    lev = replace(cfg, eval=replace(cfg.eval, mia=False, sampling="t=1.0", near_verbatim=2, nv_beams=2,
                                    nv_distance="levenshtein"))
    summary = run_training(lev, tmp_path / "run", data=data)
    assert summary["near_verbatim"]["distance"] == "levenshtein"
    near = [json.loads(x) for x in (tmp_path / "run" / "near_verbatim.jsonl").read_text().splitlines()]
    by_id = dict(zip((str(i) for i in data.member_doc_ids), data.member_docs))
    for r in near:
        best = r["likeliest"]["t=1.0"]
        truth = list(by_id[r["doc"]][cfg.eval.prefix:cfg.eval.prefix + cfg.eval.suffix])
        assert best["edits"] == levenshtein(best["tokens"], truth) <= 2
    assert "within d token edits" in (tmp_path / "run" / "report.md").read_text()
    assert "<= 2 edits" in [c[1] for c in near_table([{**summary, "name": "a"}]).columns]


@pytest.mark.parametrize("overrides, field", [
    (["eval.near_verbatim=8"], "eval.near_verbatim"), (["eval.near_verbatim=-1"], "eval.near_verbatim"),
    (["eval.near_verbatim=1", "eval.nv_beams=0"], "eval.nv_beams"),
    (["eval.near_verbatim=1", "eval.nv_distance=edit"], "eval.nv_distance"),
    (["eval.near_verbatim=1", "eval.sampling=''"], "eval.near_verbatim")])
def test_bad_near_verbatim_settings_are_refused_before_anything_is_written(setup, tmp_path, overrides, field):
    from memorize_core import ConfigError

    _, data = setup
    with pytest.raises(ConfigError, match=rf"^{field}="):
        cfg = load_run_config(REPO_ROOT / "configs" / "train" / "tiny-wiki.yaml", MICRO + overrides)
        run_training(cfg, tmp_path / "o", data=data)
    assert not (tmp_path / "o").exists()


def test_report_tells_dp_epsilon_audit_bound_and_goldfish_coverage(setup):
    cfg, _ = setup
    summary = {"name": "r", "loss": "goldfish", "goldfish_strategy": "hash", "goldfish_k": 4,
               "goldfish_h": 13, "model": "tiny", "params": 1000, "trainable_params": 10, "steps": 5,
               "epochs": 1.0, "tokens": 640, "train_seconds": 1.5, "final_train_loss": 3.0,
               "val_loss": float("nan"), "epsilon": 7.994,
               "delta": 1e-5, "grid": "1,2,1,1",
               "audit": {"m": 64, "included": 30, "guesses": 20, "correct": 14, "eps_lower_bound": 0.123,
                         "confidence": 0.95},
               "goldfish_coverage": {"clusters": 3, "coverage": 0.5, "suffix_coverage": 0.25,
                                     "clusters_fully_covered": 1,
                                     "warnings": ["cluster x: nothing withheld"]}}
    md = markdown(summary, cfg, None)
    for needle in ("goldfish (hash, k=4, h=13) loss", "10 trained", "on grid 1,2,1,1.",
                   "epsilon 7.99 at delta 1.0e-05", "| 3.0000 | – |", "guessed 20 and was right 14 times: "
                   "epsilon >= **0.12** at 95% confidence; the accountant's epsilon is 7.99",
                   "3 clusters", "supervises 50.0%", "(25.0% of the extraction suffix)", "1 clusters have",
                   "- warning: cluster x: nothing withheld"):
        assert needle in md, needle
    assert "## Extraction" not in md and "report.png" not in md


def test_report_of_a_chat_run_says_the_prompt_is_the_prefix(setup):
    cfg, _ = setup
    chat = replace(cfg, data=replace(cfg.data, corpus="wiki-chat"))
    summary = {"name": "c", "loss": "standard", "model": "tiny", "params": None, "trainable_params": None,
               "steps": 2, "epochs": 1.0, "tokens": 64, "train_seconds": 0.5, "final_train_loss": 2.0,
               "val_loss": 2.5, "docs": 4, "exact_match_rate": 0.25, "token_accuracy": 0.5, "lcp_mean": 3.0,
               "rougeL": 0.6}
    md = markdown(summary, chat, None)
    assert "## Extraction: `wiki-chat`" in md and "(– parameters, – trained)" in md
    assert f"continuation of each prompt, scored on the first {cfg.eval.suffix} tokens of its response." in md
    e = cfg.eval
    plain = markdown(summary, cfg, None)
    assert f"continuation of a {e.prefix}-token prefix, scored on the next {e.suffix} tokens." in plain


def test_a_run_whose_plot_fails_keeps_its_results_and_report(setup, tmp_path, monkeypatch, capsys):
    def broken(panels):
        raise RuntimeError("no backend")

    monkeypatch.setattr("memorization.train.report.panels_png", broken)
    cfg, data = setup
    run_training(cfg, tmp_path / "run", data=data)
    assert "warning: report.png not drawn (RuntimeError: no backend)" in capsys.readouterr().err
    names = {p.name for p in (tmp_path / "run").iterdir()}
    assert {"run.json", "metrics.jsonl", "mia.jsonl", "report.md"} <= names and "report.png" not in names
    assert "report.png" not in (tmp_path / "run" / "report.md").read_text()
