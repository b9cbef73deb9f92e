"""`memorize compare`: per-document paired tests of result folders, on hand-made folders (exact counts) and
on two real tiny runs (the files `memorize train` writes)."""
from __future__ import annotations

import json

import pytest

from memorization.cli import main
from memorization.compare import compare_folders


def _folder(path, em, rouge, mia=None, logpz=None, targets=None):
    path.mkdir(parents=True)
    with open(path / "extraction.jsonl", "w") as fh:
        for i, (e, r) in enumerate(zip(em, rouge)):
            target = (targets or {}).get(i, [3, 4])
            fh.write(json.dumps({"doc": f"d{i}", "prefix_ids": [1, 2], "target_ids": target,
                                 "generated_ids": [3, 4] if e else [5, 6], "exact_match": bool(e),
                                 "token_accuracy": 1.0 if e else 0.0, "lcp": 2 if e else 0,
                                 "rougeL": r}) + "\n")
    if mia is not None:
        members, nonmembers = mia
        with open(path / "mia.jsonl", "w") as fh:
            for member, scores in ((True, members), (False, nonmembers)):
                for i, s in enumerate(scores):
                    row = {"id": f"{'m' if member else 'n'}{i}", "member": member, "loss": s}
                    fh.write(json.dumps(row) + "\n")
    if logpz is not None:
        with open(path / "sampled.jsonl", "w") as fh:
            for i, v in enumerate(logpz):
                fh.write(json.dumps({"offset": 0, "doc": f"d{i}", "logpz": {"t=1.0": v}}) + "\n")
    return path


def test_compare_counts_discordant_documents_and_tests_every_part(tmp_path, capsys):
    ref = _folder(tmp_path / "standard", [1] * 10 + [0] * 2, [1.0] * 10 + [0.2] * 2,
                  mia=([2.0, 3.0, 4.0, 5.0], [0.0, 1.0, 1.5, 2.5]), logpz=[0.0] * 8 + [-50.0] * 4)
    run = _folder(tmp_path / "goldfish", [0] * 9 + [1] * 3, [0.5] * 9 + [1.0] * 3,
                  mia=([1.0, 2.0, 0.5, 1.2], [0.0, 1.0, 1.5, 2.5]), logpz=[-50.0] * 8 + [None] * 4)
    report = compare_folders(str(ref), [str(run)], bootstrap=200, out=str(tmp_path / "cmp"))
    t = report["tests"]["goldfish"]
    # documents 0-8: only the reference; 10, 11: only goldfish; 9: both
    assert (t["em"]["a_only"], t["em"]["b_only"]) == (2, 9) and t["em"]["rate_b"] == pytest.approx(10 / 12)
    assert t["rougeL"]["diff"] == pytest.approx((0.5 * 9 + 3.0) / 12 - (10 + 0.4) / 12)
    # (1000, 0.5)-extractable: log p_z 0 is, -50 and p_z = 0 are not: 8 documents lost, none gained
    np_test = t["np@0:t=1.0"]
    assert (np_test["a_only"], np_test["b_only"]) == (0, 8)
    assert np_test["p_value"] == pytest.approx(2 / 2 ** 8)
    # the reference ranks 15 of the 16 member/non-member pairs right (2.0 < 2.5); goldfish 7 and a tie
    # (1.0 vs 1.0: half): 1.5 + 3 + 1 + 2 of 16
    assert t["mia:loss"]["auc_b"] == pytest.approx(15 / 16)
    assert t["mia:loss"]["auc_a"] == pytest.approx(7.5 / 16)
    assert report["counts"] == {"goldfish": {"documents": 12, "windows": {"0": 12}, "members": 4,
                                             "nonmembers": 4}}
    printed = capsys.readouterr().out
    assert "Paired tests: each run − 'standard'" in printed and "(2 vs 9)" in printed
    md = (tmp_path / "cmp" / "report.md").read_text()
    assert "(1000, 0.5)-extractable t=1.0" in md and "MIA AUC loss" in md
    written = json.loads((tmp_path / "cmp" / "report.json").read_text())
    assert written["tests"]["goldfish"]["em"]["b_only"] == 9
    # the comparison is never silently replaced
    assert main(["compare", str(ref), str(run), "--out", str(tmp_path / "cmp")]) == 2
    assert "already holds report.json, report.md" in capsys.readouterr().err
    assert main(["compare", str(ref), str(run), "--out", str(tmp_path / "cmp"), "--overwrite",
                 "--bootstrap", "50"]) == 0
    assert json.loads((tmp_path / "cmp" / "report.json").read_text())["bootstrap"] == 50


def test_only_documents_every_folder_scored_are_paired(tmp_path):
    ref = _folder(tmp_path / "a", [1, 1, 1, 0], [1.0, 1.0, 1.0, 0.0])
    run = _folder(tmp_path / "b", [0, 0, 1], [0.0, 0.0, 1.0])  # no d3
    report = compare_folders(str(ref), [str(run)], bootstrap=20)
    assert report["counts"]["b"]["documents"] == 3 and report["tests"]["b"]["em"]["b_only"] == 2
    assert set(report["tests"]["b"]) == {"em", "rougeL", "token_accuracy"}  # no MIA or sampled files


def test_documents_pair_by_id_not_by_line_and_each_run_pairs_on_its_own(tmp_path):
    ref = _folder(tmp_path / "ref", [1, 1, 0, 0, 1, 0], [1.0, 0.9, 0.1, 0.2, 0.8, 0.3],
                  mia=([3.0, 2.0, 1.0], [0.0, 0.5, 1.5]))
    run = _folder(tmp_path / "run", [1, 0, 1, 0, 1, 1], [0.4, 0.5, 0.6, 0.7, 0.8, 0.9],
                  mia=([0.1, 2.0, 1.0], [0.0, 0.5, 1.5]))
    # shuffle every line of the run's files and drop d2 (from the middle) and member m1
    for name, drop in (("extraction.jsonl", '"d2"'), ("mia.jsonl", '"m1"')):
        lines = [x for x in (run / name).read_text().splitlines() if drop not in x]
        (run / name).write_text("\n".join(lines[::-1]) + "\n")
    full = _folder(tmp_path / "full", [1, 1, 0, 0, 1, 0], [1.0, 0.9, 0.1, 0.2, 0.8, 0.3])
    report = compare_folders(str(ref), [str(run), str(full)], bootstrap=20)
    t = report["tests"]["run"]
    # by id on d0, d1, d3, d4, d5: ref (1,1,0,1,0), run (1,0,0,1,1): one each way
    assert (t["em"]["a_only"], t["em"]["b_only"], t["em"]["n"]) == (1, 1, 5)
    mean_run, mean_ref = (0.4 + 0.5 + 0.7 + 0.8 + 0.9) / 5, (1.0 + 0.9 + 0.2 + 0.8 + 0.3) / 5  # d2 left out
    assert t["rougeL"]["diff"] == pytest.approx(mean_run - mean_ref)
    # members m0, m2 against the non-members 0.0, 0.5, 1.5: ref 3.0, 1.0 win 3 + 2 pairs; run 0.1, 1.0, 1 + 2
    assert t["mia:loss"]["auc_b"] == pytest.approx(5 / 6) and t["mia:loss"]["auc_a"] == pytest.approx(3 / 6)
    # another run is paired on its own documents: all six, not the five the first run shares
    assert report["tests"]["full"]["em"]["n"] == 6 and report["counts"]["full"]["documents"] == 6


def _repeat(folder):
    lines = (folder / "extraction.jsonl").read_text().splitlines()
    (folder / "extraction.jsonl").write_text("\n".join(lines + lines[:1]) + "\n")
    return folder


def _binary(folder):
    (folder / "extraction.jsonl").write_bytes(b"\xff\xfe\x00bad")
    return folder


def test_one_shared_document_and_several_offsets(tmp_path):
    ref = _folder(tmp_path / "a", [1], [1.0])
    run = _folder(tmp_path / "b", [0], [0.5])
    one = compare_folders(str(ref), [str(run)], bootstrap=10)["tests"]["b"]
    assert one["rougeL"]["n"] == 1 and one["rougeL"]["p_value"] == 1.0  # one flip each way: no evidence
    # offsets 0 and 16: greedy's exact match at 16 is tested ("EM @16"), at 0 it is extraction.jsonl's EM
    for folder, greedy16 in ((ref, 0.0), (run, None)):
        rows = [{"offset": 0, "doc": "d0", "logpz": {"greedy": 0.0, "t=1.0": -1.0}},
                {"offset": 16, "doc": "d0", "logpz": {"greedy": greedy16, "t=1.0": -90.0}}]
        (folder / "sampled.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = compare_folders(str(ref), [str(run)], bootstrap=10)
    assert report["counts"]["b"]["windows"] == {"0": 1, "16": 1}
    t = report["tests"]["b"]
    assert "np@0:greedy" not in t and (t["np@16:greedy"]["a_only"], t["np@16:greedy"]["b_only"]) == (0, 1)
    assert "EM @16" in " ".join(c[1] for c in report["columns"])


@pytest.mark.parametrize("case,needle", [
    ("targets", "scored document 'd1' with another prefix or suffix"),
    ("empty", "holds none of extraction.jsonl"),
    ("same", "names one folder twice"),
    ("out", "is one of the compared folders"),
    ("disjoint", "shares no scored document"),
    ("nullscore", "has no valid 'rougeL'"),
    ("repeated", "repeats 'd0' of line 1"),
    ("binary", "cannot be read"),
    ("seed", "--seed=-1"),
])
def test_bad_folders_are_refused_with_one_line_and_nothing_written(tmp_path, capsys, case, needle):
    ref = _folder(tmp_path / "a", [1, 0], [1.0, 0.0])
    other = {"targets": lambda: _folder(tmp_path / "b", [1, 0], [1.0, 0.0], targets={1: [9, 9]}),
             "empty": lambda: (tmp_path / "b").mkdir() or tmp_path / "b",
             "same": lambda: ref, "out": lambda: _folder(tmp_path / "b", [1, 0], [1.0, 0.0]),
             "disjoint": lambda: _folder(tmp_path / "b", [], []),
             "nullscore": lambda: _folder(tmp_path / "b", [1, 0], [1.0, None]),
             "repeated": lambda: _repeat(_folder(tmp_path / "b", [1, 0], [1.0, 0.0])),
             "binary": lambda: _binary(_folder(tmp_path / "b", [1, 0], [1.0, 0.0])),
             "seed": lambda: _folder(tmp_path / "b", [1, 0], [1.0, 0.0])}[case]()
    out = ref if case == "out" else tmp_path / "cmp"
    before = sorted(p.name for p in ref.iterdir())
    seed = ["--seed", "-1"] if case == "seed" else []
    assert main(["compare", str(ref), str(other), "--out", str(out), *seed]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and err.count("\n") == 1
    assert sorted(p.name for p in ref.iterdir()) == before and not (tmp_path / "cmp").exists()


RUN = """
name: {name}
seed: 0
data: {{corpus: wiki-leads, limit: 16, vocab_size: 300, block_len: 40, min_tokens: 40, held_out_fraction: 0.5,
        held_out: ""}}
model:
  name: tiny
  overrides: {{hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, num_attention_heads: 4}}
goldfish: {{enabled: {goldfish}, k: 2}}
trainer: {{batch_size: 4, epochs: 6, lr: 1.0e-2, warmup_steps: 1, progress: false}}
eval: {{prefix: 16, suffix: 16, batch_size: 8, mia: true, bootstrap: 20, sampling: "t=1.0"}}
wandb: {{mode: disabled}}
"""


def test_compare_reads_what_memorize_train_writes(tmp_path, cache_dir):
    for name, goldfish in (("standard", "false"), ("goldfish", "true")):
        (tmp_path / f"{name}.yaml").write_text(RUN.format(name=name, goldfish=goldfish))
        assert main(["train", str(tmp_path / f"{name}.yaml"), "--out", str(tmp_path / name)]) == 0
    report = compare_folders(str(tmp_path / "standard"), [str(tmp_path / "goldfish")], bootstrap=50)
    tests = report["tests"]["goldfish"]
    assert {"em", "rougeL", "np@0:t=1.0", "mia:loss"} <= set(tests)
    rows = [json.loads(x) for x in (tmp_path / "goldfish" / "extraction.jsonl").read_text().splitlines()]
    assert tests["em"]["n"] == len(rows) == report["counts"]["goldfish"]["documents"]
    assert tests["em"]["rate_a"] == pytest.approx(sum(r["exact_match"] for r in rows) / len(rows))
    summary = json.loads((tmp_path / "goldfish" / "run.json").read_text())["summary"]
    assert tests["mia:loss"]["auc_a"] == pytest.approx(summary["mia"]["methods"]["loss"]["auc"])
    assert "np@0:greedy" not in tests  # greedy's p_z is the exact match already tested
