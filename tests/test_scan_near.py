"""`memorize scan --near-verbatim D`: every row's near_score equals its definition; the search takes the
--nv-rows best-ranked rows and bounds them as evals.near_verbatim does on the same windows (d = 0: the
row's log p_z); the report's fractions count the searched rows by their bound and the others by their
exact p_z (never below the exact fractions); bad flags and a resume with another D are one line; the
windows a data-parallel launch searches and bounds equal the serial ones."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from helpers import refused, scan_llama, write_indexed
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from evals.near_verbatim import near_verbatim
from evals.sampling import extractable, parse_schemes, scheme_logprobs
from evals.scan import score_windows
from memorization.cli import main
from memorize_core import ConfigError

SCHEMES = "t=1.0;top_k=5"
D, ROWS, NS = 2, 6, (1, 10, 100)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A tiny Llama (vocab 320) and 16 documents of 16 tokens: 8 its own greedy continuations of a random
    4-token prefix with one token changed (near-copies of what it emits), 8 random."""
    root = tmp_path_factory.mktemp("scan-near")
    model = scan_llama(root, 1.0)
    g = np.random.default_rng(0)
    prefixes = torch.from_numpy(g.integers(0, 320, size=(8, 4)))
    with torch.no_grad():
        own = model.generate(prefixes, attention_mask=torch.ones_like(prefixes), do_sample=False,
                             max_new_tokens=12, min_new_tokens=12, pad_token_id=0, top_k=None, top_p=None)
    own = own.tolist()
    for i, doc in enumerate(own):
        doc[8 + i % 6] = (doc[8 + i % 6] + 1) % 320
    docs = [d for pair in zip(own, g.integers(0, 320, size=(8, 16)).tolist()) for d in pair]
    write_indexed(root / "corpus", docs, np.uint16)
    return root


def _argv(folder: Path, out: Path, *extra: str) -> list[str]:
    return ["scan", "--model", str(folder / "model"), "--data", str(folder / "corpus.bin"), "--prefix", "4",
            "--suffix", "8", "--offsets", "stride:4", "--batch-size", "8", "--part-rows", "10",
            "--no-progress", "--sampling", SCHEMES, "--np-n", ",".join(map(str, NS)), *extra,
            "--out", str(out)]


@pytest.fixture(scope="module")
def scanned(folder, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("scans") / "a"
    assert main(_argv(folder, out, "--near-verbatim", str(D), "--nv-rows", str(ROWS), "--nv-beams", "3")) == 0
    return out


def test_near_score_is_its_definition():
    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, initializer_range=0.5)
    model = LlamaForCausalLM(cfg).eval()
    windows = torch.randint(0, 64, (5, 9))
    schemes = parse_schemes("t=1.0;top_k=3;t=0.5")
    got = score_windows(model, windows, 4, schemes=schemes, near=2)["near_score"]
    with torch.no_grad():
        logits = model(windows[:, :-1]).logits[:, 3:]
    per = scheme_logprobs(logits, windows[:, 4:], schemes)
    want = []
    for i in range(5):  # the 5 - 2 likeliest suffix tokens' log-probs, the best scheme
        want.append(max(sum(sorted(per[s][i].tolist(), reverse=True)[:3]) for s in schemes))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for bad in (5, 0.5, 2.0, True):
        with pytest.raises(ConfigError, match="near"):
            score_windows(model, windows, 4, schemes=schemes, near=bad)
    with pytest.raises(ConfigError, match="near"):
        score_windows(model, windows, 4, near=2)  # no scheme to sample with


def test_the_best_ranked_rows_are_searched_and_bounded(folder, scanned):
    rows = pq.read_table(scanned / "parts").to_pydict()
    assert len(rows["row"]) > ROWS
    order = sorted((r for r, s in zip(rows["row"], rows["near_score"]) if np.isfinite(s)),
                   key=lambda r: (-rows["near_score"][r], r))
    lines = [json.loads(x) for x in (scanned / "near_verbatim.jsonl").read_text().splitlines()]
    assert [x["row"] for x in lines] == order[:ROWS]
    windows = [rows["prefix_ids"][r] + rows["suffix_ids"][r] for r in order[:ROWS]]
    model = AutoModelForCausalLM.from_pretrained(folder / "model").eval()
    direct = near_verbatim(model, windows, prefix_len=4, suffix_len=8, schemes=parse_schemes(SCHEMES),
                           max_edits=D, beams=3, batch_size=8)["offsets"]["0"]["rows"]
    for line, want in zip(lines, direct):
        r = line["row"]
        assert line["doc_id"] == rows["doc_id"][r] and line["offset"] == rows["offset"][r]
        for name in ("t=1.0", "top_k=5"):
            got, ref = line["bound"][name], want["bound"][name]
            assert [v is None for v in got] == [v is None for v in ref]
            np.testing.assert_allclose([v for v in got if v is not None], [v for v in ref if v is not None],
                                       rtol=1e-5, atol=1e-6)
            if got[0] is not None:  # d = 0 is the exact copy: the row's own log p_z
                np.testing.assert_allclose(got[0], rows[f"logpz/{name}"][r], rtol=1e-5, atol=1e-6)
            assert "[-" in line["likeliest"][name]["diff"] or line["likeliest"][name]["edits"] == 0


def test_report_counts_searched_rows_by_bound_and_the_rest_by_p_z(scanned):
    report = json.loads((scanned / "report.json").read_text())
    rows = pq.read_table(scanned / "parts").to_pydict()
    lines = {x["row"]: x for x in map(json.loads, (scanned / "near_verbatim.jsonl").read_text().splitlines())}
    nv = report["near_verbatim"]
    assert (nv["searched"], nv["windows"], nv["max_edits"], nv["asked"]) == (ROWS, len(rows["row"]), D, ROWS)
    rest = np.array([r not in lines for r in rows["row"]])
    exact = report["sampling"]["np"]["schemes"]
    for name in ("t=1.0", "top_k=5"):
        for d in range(D + 1):
            bound = np.array([-np.inf if lines[r]["bound"][name][d] is None else lines[r]["bound"][name][d]
                              for r in lines])
            for n in NS:
                want = int(extractable(bound, n, 0.5).sum()) + \
                    int(extractable(np.array(rows[f"logpz/{name}"])[rest], n, 0.5).sum())
                cell = nv["np"][name][f"d={d}"][f"n={n}"]
                assert cell["count"] == want and cell["fraction"] == want / len(rows["row"])
                assert cell["count"] >= exact[name][f"n={n}"]["count"]  # never below the exact copy's
                if not d:  # d = 0 is the exact copy, searched or not
                    assert cell["count"] == exact[name][f"n={n}"]["count"]
                if d:
                    assert cell["count"] >= nv["np"][name][f"d={d - 1}"][f"n={n}"]["count"]
    assert report["summary"]["near_extractable"]["d"] == D
    offsets = np.array(rows["offset"])
    assert sorted(nv["by_offset"]) == ["0", "4"]  # --offsets stride:4: the counts per window offset too
    for w, per in nv["by_offset"].items():
        sel = offsets == int(w)
        for name in ("t=1.0", "top_k=5"):
            lz = np.array(rows[f"logpz/{name}"])
            for d in range(D + 1):
                bound = np.array([-np.inf if x["bound"][name][d] is None else x["bound"][name][d]
                                  for r, x in lines.items() if rows["offset"][r] == int(w)])
                want = int(extractable(bound, 100, 0.5).sum()) + \
                    int(extractable(lz[rest & sel], 100, 0.5).sum())
                assert per[name][f"d={d}"]["n=100"]["count"] == want
                assert sum(nv["by_offset"][x][name][f"d={d}"]["n=100"]["count"] for x in nv["by_offset"]) == \
                    nv["np"][name][f"d={d}"]["n=100"]["count"]
    assert nv["np"]["t=1.0"][f"d={D}"]["n=100"]["count"] > exact["t=1.0"]["n=100"]["count"] > 0  # near-copies
    md = (scanned / "report.md").read_text()
    assert "## Near-verbatim extraction: within d changed tokens (lower bound)" in md
    assert f"{ROWS} of {len(rows['row'])} windows" in md
    assert "Per window offset, within 2 changed tokens" in md
    assert (scanned / "scan-near.png").is_file()


def test_rows_not_searched_count_by_their_exact_copy(folder, scanned, tmp_path):
    """With one row searched, the others' exact p_z keeps the exact (n, p) counts: d = 0 equals them."""
    argv = _argv(folder, tmp_path / "one", "--near-verbatim", str(D), "--nv-rows", "1", "--nv-beams", "3")
    assert main(argv) == 0
    report = json.loads((tmp_path / "one" / "report.json").read_text())
    nv, exact = report["near_verbatim"], report["sampling"]["np"]["schemes"]
    assert nv["searched"] == 1
    for name in ("t=1.0", "top_k=5"):
        for n in NS:
            assert nv["np"][name]["d=0"][f"n={n}"]["count"] == exact[name][f"n={n}"]["count"]
            assert nv["np"][name]["d=0"][f"n={n}"]["searched_count"] <= 1
    assert exact["t=1.0"]["n=100"]["count"] > 1  # so the rows not searched carried some of it


@pytest.mark.parametrize("extra,needle", [
    (("--nv-rows", "5"), "--nv-rows"), (("--nv-beams", "3"), "--nv-beams"),
    (("--nv-distance", "levenshtein"), "--nv-distance"), (("--near-verbatim", "8"), "--near-verbatim"),
    (("--near-verbatim", "2", "--nv-rows", "0"), "--nv-rows"),
    (("--near-verbatim", "2", "--sampling", ""), "--near-verbatim"),
])
def test_bad_flags_are_one_line_and_write_nothing(folder, tmp_path, capsys, extra, needle):
    refused(capsys, _argv(folder, tmp_path / "o", *extra), needle)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("extra", [("--near-verbatim", "2", "--nv-rows", "0"), ("--nv-rows", "5")])
def test_the_dry_run_refuses_what_the_scan_refuses(capsys, extra):
    refused(capsys, ["scan", "--model", "llama-70b", "--dry-run", "--world", "8", "--limit", "1000", *extra],
            "--nv-rows")


def test_a_resume_with_another_d_is_refused_and_the_dry_run_carries_it(folder, scanned, capsys):
    before = {p.relative_to(scanned): p.read_bytes() for p in scanned.rglob("*") if p.is_file()}
    refused(capsys, _argv(folder, scanned, "--near-verbatim", "1"), "--near-verbatim", "differs")
    refused(capsys, _argv(folder, scanned), "--near-verbatim='(not given)'", "differs")
    assert {p.relative_to(scanned): p.read_bytes() for p in scanned.rglob("*") if p.is_file()} == before
    capsys.readouterr()
    assert main(["scan", "--model", "llama-70b", "--dry-run", "--world", "8", "--limit", "1000", "--grid",
                 "1,8,1,1", "--near-verbatim", "4", "--nv-distance", "levenshtein"]) == 0
    out = capsys.readouterr().out
    assert "near-verbatim search of up to 1,000 windows (not in the prediction)" in out
    launch = next(x for x in out.splitlines() if x.startswith("launch: "))
    assert "--near-verbatim 4 --nv-beams 8 --nv-distance levenshtein --nv-rows 1000" in launch


def _rank(rank, world, argv):
    return main(argv)


@pytest.mark.distributed
def test_a_data_parallel_scan_searches_the_serial_rows(folder, scanned, tmp_path):
    """2 gloo ranks at 1,1,1,2: rank 0 ranks the rows, both search their share of the windows."""
    from axonn.spawn import run_distributed

    argv = _argv(folder, tmp_path / "dp", "--near-verbatim", str(D), "--nv-rows", str(ROWS),
                 "--nv-beams", "3", "--grid", "1,1,1,2")
    assert run_distributed(_rank, 2, argv, init=False, timeout=600) == [0, 0]
    serial = [json.loads(x) for x in (scanned / "near_verbatim.jsonl").read_text().splitlines()]
    got = [json.loads(x) for x in (tmp_path / "dp" / "near_verbatim.jsonl").read_text().splitlines()]
    assert [x["row"] for x in got] == [x["row"] for x in serial]
    for a, b in zip(got, serial):
        for name in a["bound"]:
            np.testing.assert_allclose([np.nan if v is None else v for v in a["bound"][name]],
                                       [np.nan if v is None else v for v in b["bound"][name]], rtol=1e-5)
    report = json.loads((tmp_path / "dp" / "report.json").read_text())["near_verbatim"]
    assert report["np"] == json.loads((scanned / "report.json").read_text())["near_verbatim"]["np"]


def test_jsonl_parts_search_the_same_rows(folder, scanned, tmp_path):
    argv = _argv(folder, tmp_path / "j", "--near-verbatim", str(D), "--nv-rows", str(ROWS), "--nv-beams", "3",
                 "--format", "jsonl")
    assert main(argv) == 0
    parts = sorted((tmp_path / "j" / "parts").iterdir())
    got = [json.loads(x)["near_score"] for p in parts for x in p.read_text().splitlines()]
    want = pq.read_table(scanned / "parts")["near_score"].to_pylist()
    assert got == [None if np.isneginf(v) else v for v in want]
    rows = [json.loads(x)["row"] for x in (tmp_path / "j" / "near_verbatim.jsonl").read_text().splitlines()]
    assert rows == [json.loads(x)["row"] for x in (scanned / "near_verbatim.jsonl").read_text().splitlines()]
    assert json.loads((tmp_path / "j" / "report.json").read_text())["near_verbatim"]["np"] == \
        json.loads((scanned / "report.json").read_text())["near_verbatim"]["np"]
