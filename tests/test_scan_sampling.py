"""`memorize scan --sampling`: every row's log p_z per scheme (equal to evals.scan.score_windows' on the
same windows), greedy's 0 exactly on the exact matches, the report's (n, p) summaries over all rows and
per offset, JSON lines' null for -inf, and a resume with other schemes (or a bad flag) refused in one
line."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from helpers import refused, scan_llama, write_indexed
from transformers import AutoModelForCausalLM

from evals.sampling import DEFAULT_SCHEMES, np_summary, parse_schemes
from evals.scan import score_windows
from memorization.cli import main

SCHEMES = "t=1.0;t=0.7,top_k=40;top_p=0.9"
NAMES = [s.name for s in parse_schemes(SCHEMES)]
BATCH = 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A tiny Llama (vocab 320) and an indexed corpus of 24 documents of 20 tokens: 12 its own greedy
    continuations of a random 6-token prefix (exact matches at offset 0), 12 random."""
    root = tmp_path_factory.mktemp("scan-sampling")
    model = scan_llama(root)
    g = np.random.default_rng(0)
    prefixes = torch.from_numpy(g.integers(0, 320, size=(12, 6)))
    with torch.no_grad():
        own = model.generate(prefixes, attention_mask=torch.ones_like(prefixes), do_sample=False,
                             max_new_tokens=14, min_new_tokens=14, pad_token_id=0, top_k=None, top_p=None)
    docs = [d for pair in zip(own.tolist(), g.integers(0, 320, size=(12, 20)).tolist()) for d in pair]
    write_indexed(root / "corpus", docs, np.uint16)
    return root


def _argv(folder: Path, out: Path, *extra: str) -> list[str]:
    return ["scan", "--model", str(folder / "model"), "--data", str(folder / "corpus.bin"), "--prefix", "6",
            "--suffix", "6", "--offsets", "stride:7", "--batch-size", str(BATCH), "--part-rows", "16",
            "--no-progress", *extra, "--out", str(out)]


@pytest.fixture(scope="module")
def scanned(folder, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("scans") / "a"
    assert main(_argv(folder, out, "--sampling", SCHEMES, "--np-n", "1,10,100", "--np-p", "0.5")) == 0
    return out


def test_rows_hold_the_log_pz_of_score_windows(folder, scanned):
    rows = pq.read_table(scanned / "parts").to_pydict()
    assert {"logpz_greedy", *(f"logpz/{n}" for n in NAMES)} <= set(rows)
    assert sorted(set(rows["offset"])) == [0, 7]
    windows = torch.tensor([p + s for p, s in zip(rows["prefix_ids"], rows["suffix_ids"])])
    model = AutoModelForCausalLM.from_pretrained(folder / "model").eval()
    want: dict[str, list] = {}
    for batch in windows.split(BATCH):  # the scan's own batches: the same sums in the same order
        for k, v in score_windows(model, batch, 6, schemes=parse_schemes(SCHEMES)).items():
            want.setdefault(k, []).extend(v.tolist())
    for name in NAMES:
        np.testing.assert_array_equal(rows[f"logpz/{name}"], want[f"logpz/{name}"], err_msg=name)
    exact = np.array(rows["exact_match"])
    assert exact.sum() >= 12 and not exact.all()  # the model's own continuations, and the random rest
    greedy = np.array(rows["logpz_greedy"])
    assert (greedy[exact] == 0.0).all() and np.isneginf(greedy[~exact]).all()
    assert np.isfinite(rows["logpz/t=1.0"]).all()  # untruncated sampling can emit any suffix
    for name in NAMES:  # a scheme emits an exact-match suffix at least as often as random text's
        assert (np.array(rows[f"logpz/{name}"]) <= 0).all()


def test_report_holds_np_per_scheme_overall_and_per_offset(scanned):
    report = json.loads((scanned / "report.json").read_text())
    rows = pq.read_table(scanned / "parts").to_pydict()
    smp = report["sampling"]
    assert smp["schemes"] == NAMES and smp["ns"] == [1, 10, 100] and smp["p"] == 0.5
    cols = {n: np.array(rows[f"logpz/{n}"]) for n in NAMES}
    exact = np.array(rows["exact_match"])
    assert smp["np"] == np_summary(cols, (1, 10, 100), 0.5, greedy=exact)
    greedy = smp["np"]["schemes"]["greedy"]
    assert all(greedy[f"n={n}"]["fraction"] == report["summary"]["exact_match_rate"] for n in (1, 10, 100))
    offsets = np.array(rows["offset"])
    assert sorted(smp["by_offset"]) == ["0", "7"]
    for o in (0, 7):
        sel = offsets == o
        assert smp["by_offset"][str(o)] == np_summary({n: v[sel] for n, v in cols.items()}, (1, 10, 100), 0.5,
                                                      greedy=exact[sel])
    at = report["summary"]["np_extractable"]
    assert at["n"] == 100 and set(at) == {"n", "p", "greedy", *NAMES}
    md = (scanned / "report.md").read_text()
    assert "## Probabilistic extraction" in md and "| 7 | `top_p=0.9` |" in md
    assert (scanned / "scan-np.png").is_file()


def test_jsonl_rows_write_minus_infinity_as_null(folder, scanned, tmp_path):
    assert main(_argv(folder, tmp_path / "j", "--sampling", SCHEMES, "--np-n", "1,10,100",
                      "--format", "jsonl")) == 0
    parts = sorted((tmp_path / "j" / "parts").iterdir())
    lines = [json.loads(x) for p in parts for x in p.read_text().splitlines()]
    rows = pq.read_table(scanned / "parts").to_pydict()
    for col in ["logpz_greedy", *(f"logpz/{n}" for n in NAMES)]:
        got = [r[col] for r in lines]
        assert [v is None for v in got] == np.isneginf(rows[col]).tolist(), col
        np.testing.assert_array_equal([-np.inf if v is None else v for v in got], rows[col])
    assert json.loads((tmp_path / "j" / "report.json").read_text())["sampling"] == \
        json.loads((scanned / "report.json").read_text())["sampling"]


def test_greedy_only(folder, tmp_path):
    assert main(_argv(folder, tmp_path / "g", "--sampling", "", "--offsets", "start")) == 0
    rows = pq.read_table(tmp_path / "g" / "parts").to_pydict()
    assert [c for c in rows if c.startswith("logpz")] == ["logpz_greedy"]
    report = json.loads((tmp_path / "g" / "report.json").read_text())
    assert list(report["sampling"]["np"]["schemes"]) == ["greedy"] and report["sampling"]["by_offset"] == {}
    assert report["sampling"]["ns"] == [1, 10, 100, 1000] and report["sampling"]["p"] == 0.5


def test_a_resume_with_other_schemes_isrefused(folder, scanned, capsys):
    before = {p.relative_to(scanned): p.read_bytes() for p in scanned.rglob("*") if p.is_file()}
    state = json.loads((scanned / "scan-state.json").read_text())
    assert state["fingerprint"]["sampling"] == ";".join(NAMES)
    refused(capsys, _argv(folder, scanned, "--sampling", "t=0.7"), "--sampling", "differs", "t=0.7")
    refused(capsys, _argv(folder, scanned, "--sampling", ""), "--sampling", "differs")  # greedy only
    assert {p.relative_to(scanned): p.read_bytes() for p in scanned.rglob("*") if p.is_file()} == before
    # the same schemes spelled otherwise (or the default's) are the same scan: finished, not different
    refused(capsys, _argv(folder, scanned, "--sampling", "temperature=1;t=0.7,top_k=40;top_p=0.9"),
             "--out", "finished")
    refused(capsys, _argv(folder, scanned), "--out", "finished")


@pytest.mark.parametrize("flag,value,needle", [
    ("--sampling", "t=0", "--sampling"), ("--sampling", "top_q=1", "--sampling"),
    ("--sampling", "t=1.0;t=1", "--sampling"), ("--np-n", "0,10", "--np-n"), ("--np-n", "ten", "--np-n"),
    ("--np-p", "1.5", "--np-p"), ("--np-p", "nan", "--np-p"),
])
def test_bad_flags_are_one_line_and_write_nothing(folder, tmp_path, capsys, flag, value, needle):
    refused(capsys, _argv(folder, tmp_path / "o", flag, value), needle)
    assert not (tmp_path / "o").exists()


def test_dry_run_launch_line_carries_the_schemes(capsys):
    argv = ["scan", "--model", "llama-70b", "--dry-run", "--world", "8", "--limit", "1000", "--grid",
            "1,8,1,1", "--np-n", "1,10"]
    for sampling, want in (("", "--sampling ''"), (DEFAULT_SCHEMES, f"--sampling '{DEFAULT_SCHEMES}'")):
        capsys.readouterr()
        assert main([*argv, "--sampling", sampling]) == 0
        launch = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("launch: "))
        assert want in launch and "--np-n 1,10" in launch
    refused(capsys, [*argv, "--sampling", "t=-1"], "--sampling")


def _rank(rank, world, runs):
    return [main(argv) for argv in runs]  # one spawn, both grids


@pytest.mark.distributed
def test_sharded_scan_writes_the_serial_log_pz(folder, scanned, tmp_path):
    """4 gloo ranks at 1,2,1,2 (vocab over Y: top-k / top-p from merged candidates) and 2,1,2,1 (batch
    over Z in lockstep, 7 rows a batch: fillers run): the serial rows' log p_z and report."""
    from axonn.spawn import run_distributed

    grids = ("1,2,1,2", "2,1,2,1")
    runs = [[*_argv(folder, tmp_path / g, "--sampling", SCHEMES, "--np-n", "1,10,100", "--grid", g)]
            for g in grids]
    for argv in runs:
        argv[argv.index("--batch-size") + 1] = "7"
    assert run_distributed(_rank, 4, runs, init=False, timeout=600) == [[0, 0]] * 4
    serial = pq.read_table(scanned / "parts").to_pydict()
    for g in grids:
        rows = pq.read_table(tmp_path / g / "parts").to_pydict()
        assert rows["exact_match"] == serial["exact_match"] and rows["logpz_greedy"] == serial["logpz_greedy"]
        for name in NAMES:
            got, want = np.array(rows[f"logpz/{name}"]), np.array(serial[f"logpz/{name}"])
            assert (np.isneginf(got) == np.isneginf(want)).all(), (g, name)
            np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)], rtol=1e-5, atol=1e-6,
                                       err_msg=f"{g} {name}")
        assert json.loads((tmp_path / g / "report.json").read_text())["sampling"] == \
            json.loads((scanned / "report.json").read_text())["sampling"]
