"""`memorize scan` end to end: rows and report, a scan killed (SIGKILL, or a crash at the worst moment)
and resumed equals an uninterrupted one row for row, bad inputs are one line, exit 2, nothing written,
and the dry run sizes a 70B scan on 8 H100s."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from helpers import refused, tiny_scan_folder, write_indexed

from memorization.cli import main
from memorization.scan import scanner as scan_module

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_scan_folder(tmp_path_factory.mktemp("scan"))


def _scan(folder: Path, out: Path, *extra: str) -> list[str]:
    return ["scan", "--model", str(folder / "model"), "--data", str(folder / "corpus.bin"), "--prefix", "6",
            "--suffix", "6", "--offsets", "stride:7", "--part-rows", "16", "--batch-size", "8",
            "--no-progress", *extra, "--out", str(out)]


def _rows(out: Path) -> dict[str, list]:
    return pq.read_table(out / "parts").to_pydict()


def test_rows_and_report(folder, tmp_path, capsys):
    assert main(_scan(folder, tmp_path / "a", "--generate", "--manifest", str(folder / "manifest.json"))) == 0
    rows = _rows(tmp_path / "a")
    n = len(rows["row"])
    assert rows["row"] == list(range(n)) and n > 40
    report = json.loads((tmp_path / "a" / "report.json").read_text())
    s = report["summary"]
    assert s["windows"] == n and s["short_skipped"] == 3 and report["short"] == 3
    assert 0 <= s["exact_match_ci95"][0] <= s["exact_match_rate"] <= s["exact_match_ci95"][1]
    assert report["by_count"][0]["count"] == 1 and len(report["top"]) == 20
    assert all(set(r) >= {"memorization_score", "rougeL", "continuation_ids", "doc_id"} for r in [rows])
    state = json.loads((tmp_path / "a" / "scan-state.json").read_text())
    assert state["complete"] and state["rows"] == n
    for f in ("report.md", "scan-scores.png", "scan-position.png", "scan-duplicates.png"):
        assert (tmp_path / "a" / f).is_file(), f
    # the same scan as JSON lines: the same rows
    assert main(_scan(folder, tmp_path / "j", "--generate", "--manifest", str(folder / "manifest.json"),
                      "--format", "jsonl", "--wandb", "offline")) == 0
    assert (tmp_path / "j" / "wandb").is_dir()  # the report's summary, plots and top rows, offline
    parts = sorted((tmp_path / "j" / "parts").iterdir())
    lines = [json.loads(x) for p in parts for x in p.read_text().splitlines()]
    assert [r["lead"] for r in lines] == rows["lead"]
    np.testing.assert_allclose([r["suffix_loss"] for r in lines], rows["suffix_loss"])


def test_a_crash_between_part_and_state_resumes_exactly(folder, tmp_path, monkeypatch):
    """Killed after a part is renamed in but before the state counts it: the resume drops that part and
    writes it again; the finished rows equal an uninterrupted scan's."""
    assert main(_scan(folder, tmp_path / "ref")) == 0
    real, calls = scan_module.write_state, []

    def dying(out, state):
        calls.append(state["parts"])
        if len(calls) == 4:  # the part is on disk, the state would count it: die here
            raise KeyboardInterrupt
        real(out, state)

    monkeypatch.setattr(scan_module, "write_state", dying)
    assert main(_scan(folder, tmp_path / "b")) == 130
    monkeypatch.setattr(scan_module, "write_state", real)
    state = json.loads((tmp_path / "b" / "scan-state.json").read_text())
    assert state["parts"] == 2 and (tmp_path / "b" / "parts" / "part-00002.parquet").exists()
    assert main(_scan(folder, tmp_path / "b")) == 0
    assert _rows(tmp_path / "b") == _rows(tmp_path / "ref")


def test_sigkill_and_resume_equals_uninterrupted(folder, tmp_path):
    argv = _scan(folder, tmp_path / "k", "--seq-len", "50", "--offsets", "stride:1")
    assert main([*argv[:-1], str(tmp_path / "ref")]) == 0
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "memorization", *argv], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    third = tmp_path / "k" / "parts" / "part-00002.parquet"
    deadline = time.monotonic() + 120
    while not third.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    state = json.loads((tmp_path / "k" / "scan-state.json").read_text())
    assert not state["complete"], "the scan finished before it could be killed: make it longer"
    assert main(argv) == 0
    assert _rows(tmp_path / "k") == _rows(tmp_path / "ref")


def test_bad_inputs_are_one_line_and_write_nothing(folder, tmp_path, capsys):
    out = tmp_path / "out"
    bad = _scan(folder, out)
    data = bad.index("--data") + 1
    (tmp_path / "c.parquet").write_bytes(b"x")
    np.arange(40, dtype=np.uint8).tofile(tmp_path / "small.bin")
    write_indexed(tmp_path / "short", [[1, 2, 3]] * 4, np.uint16)
    write_indexed(tmp_path / "cut", [[1, 2, 3, 4]] * 4, np.uint16)
    with open(tmp_path / "cut.bin", "r+b") as f:
        f.truncate(10)
    cases = [("no-such-corpus", [], ["--data='no-such-corpus'", "unknown source"]),
             (str(tmp_path / "c.parquet"), [], ["unknown format .parquet"]),
             (str(tmp_path / "cut.idx"), [], ["does not match cut.bin"]),
             (str(tmp_path / "small.bin"), ["--dtype", "uint8"], ["--dtype='uint8'", "cannot hold", "320"]),
             (str(tmp_path / "short.bin"), [], ["no window", "4 of its sequences", "skipped"]),
             (None, ["--prefix", "60"], ["--prefix=60", "context of 64"]),
             (None, ["--seq-len", "8"], ["--seq-len=8", "shorter than --prefix + --suffix"]),
             (None, ["--offsets", "every:3"], ["--offsets='every:3'"])]
    for spec, extra, needles in cases:
        argv = list(bad)
        if spec is not None:
            argv[data] = spec
        refused(capsys, argv + extra, *needles)
        assert not out.exists(), (spec, extra)


def test_out_rules_and_resume_with_another_command(folder, tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "run.json").write_text("{}")
    refused(capsys, _scan(folder, out), "--out=", "already holds results (run.json)")
    assert sorted(p.name for p in out.iterdir()) == ["run.json"]
    done = tmp_path / "done"
    assert main(_scan(folder, done)) == 0
    before = {p: p.stat().st_mtime_ns for p in done.rglob("*")}
    refused(capsys, _scan(folder, done) + ["--suffix", "5"], "--suffix=5", "made with 6", "--overwrite")
    refused(capsys, _scan(folder, done), "already holds a finished scan")
    assert {p: p.stat().st_mtime_ns for p in done.rglob("*")} == before
    assert main(_scan(folder, done) + ["--overwrite", "--suffix", "5"]) == 0  # replaces only its own files
    assert (out / "run.json").exists()


def test_dry_run_sizes_a_70b_scan_on_8_h100(capsys):
    assert main(["scan", "--model", "llama-70b", "--dry-run", "--world", "8", "--hardware", "h100",
                 "--limit", "1000000", "--batch-size", "1024", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert np.prod(r["grid"]) == 8 and r["windows"] == 1_000_000
    assert 0 < r["rank0_total_gib"] <= r["usable_gib"] and r["predicted_s"] > 0
    refused(capsys, ["scan", "--model", "llama-70b", "--dry-run", "--world", "8"], "--limit=None")
