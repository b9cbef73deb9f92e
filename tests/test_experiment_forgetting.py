"""forgetting end to end on a micro config: a tiny briefly-trained model stands in for SmolLM2."""
from __future__ import annotations

import json

import pytest
import torch
from helpers import trained_base
from transformers import AutoModelForCausalLM, AutoTokenizer

from data_pipelines.canaries import SecretSpace
from memorization.cli import main
from memorization.eval.exposure import canary_scores
from memorization.experiments.forgetting import kept
from memorization.mitigations.goldfish import goldfish_mask

TEMPLATE = "the secret access code of the old museum wing is {secret}"

EXPERIMENT = """
kind: forgetting
name: fg
passes: 1
continue_passes: {passes}
fresh: {{corpus: lee-news, limit: 12}}
counts: [1, 3]
canaries: {{per_count: 2, template: "{template}", space: {{kind: digits, length: 2}}, candidates: 0}}
duplicates: {{per_count: 1}}
bootstrap: 20
other_held_out: lee-news-test
other_held_out_limit: 4
samples: 1
arms: {arms}
base:
  data: {{corpus: wiki-leads, limit: 28, held_out: "", held_out_fraction: 0.5, block_len: 40, min_tokens: 40}}
  model: {{name: {model}}}
  goldfish: {{k: 2, h: 4}}
  trainer: {{lr: 3.0e-3, warmup_steps: 1, batch_size: 4, progress: false}}
  eval: {{prefix: 16, suffix: 16, batch_size: 8, near_verbatim: 1, nv_beams: 2}}
  wandb: {{mode: disabled}}
"""
ARMS = ("[{name: none, mitigation: none}, "
        "{name: goldfish, mitigation: goldfish, overrides: [goldfish.enabled=true]}]")


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    return trained_base(tmp_path_factory.mktemp("base"), max_steps=2)


def _write(tmp_path, model, arms=ARMS, passes=2):
    p = tmp_path / "f.yaml"
    p.write_text(EXPERIMENT.format(model=model, arms=arms, passes=passes, template=TEMPLATE))
    return p


@pytest.fixture(scope="module")
def finished(pretrained, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fg")
    out = tmp / "out"
    assert main(["run", str(_write(tmp, pretrained)), "--out", str(out)]) == 0
    return tmp, out


def _exposures(model_dir, manifest):
    """Every canary's exposure, scored from scratch on a saved model (the definition the report uses)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    canaries = [it for it in manifest["items"] if it["kind"] == "canary"]
    space = SecretSpace(**canaries[0]["space"])
    scores = canary_scores(model, tok, TEMPLATE, space, [c["secret"] for c in canaries])
    return [c["exposure"] for c in scores["canaries"]]


def test_each_pass_is_asked_of_the_model_as_it_is_then(finished):
    """Pass 0 is the fine-tuned model before continued training moves it (its exported weights give
    the same exposures), the last pass the continued model that was exported; steps grow by one pass of
    fresh rows each time, and the fresh-domain loss falls while the model trains on that domain."""
    _, out = finished
    report = json.loads((out / "report.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    assert [a["name"] for a in report["arms"]] == ["none", "goldfish"]
    rows = report["fresh"]["rows"]
    assert rows == 12
    for arm in report["arms"]:
        passes = arm["passes"]
        assert [p["pass"] for p in passes] == [0, 1, 2]
        assert [p["step"] for p in passes] == [0, 3, 6]  # 12 rows, batch 4
        assert arm["continued_steps"] == 6 and arm["fine_tune_steps"] > 0
        # canary_scores per canary, in the manifest's order: what arm_record averaged
        first = _exposures(out / "runs" / arm["name"] / "model", manifest)
        last = _exposures(out / "runs" / f"{arm['name']}-continued" / "model", manifest)
        assert passes[0]["canaries"]["exposure_mean"] == pytest.approx(sum(first) / len(first), rel=1e-6)
        assert passes[-1]["canaries"]["exposure_mean"] == pytest.approx(sum(last) / len(last), rel=1e-6)
        assert first != pytest.approx(last)  # the continuation moved the model
        other = [p["utility"]["other_val_loss"] for p in passes]
        assert other[-1] < other[0]
        for p in passes:
            assert set(p["by_copy_count"]) == {"1", "3"} and p["canaries"]["count"] == 4
            m = p["mia"]["loss"]
            assert m["auc_ci"][0] <= m["auc"] <= m["auc_ci"][1]
    base = report["baseline"]
    assert base["name"] == "base model" and "ref_ratio" not in base["mia"]
    table = report["tables"]["After each pass of continued training"]
    assert [r["arm"] for r in table] == ["base model"] + ["none"] * 3 + ["goldfish"] * 3
    for row in table[1:]:  # pass 0 keeps all of its own gain, where there is a gain to keep
        gain = table[1 if row["arm"] == "none" else 4]["exposure"] - table[0]["exposure"]
        if row["pass"] == 0:
            assert row["kept"] == (pytest.approx(1.0) if gain >= 1 else None)
    md = (out / "report.md").read_text()
    assert "## By copy count" in md and "exposure kept" in md
    # beyond greedy and near-verbatim after every pass, on the leads seen once and the duplicated ones
    beyond = report["tables"]["Beyond greedy"]
    assert {r["arm"] for r in beyond} == {"base model"} | {f"{a}, pass {k}" for a in ("none", "goldfish")
                                                           for k in range(3)}
    assert {r["docs"].split(" (")[0] for r in beyond} == {"seen_once", "duplicated"}
    assert len(report["arms"][0]["passes"][2]["near_verbatim"]["duplicated"]["offsets"]["0"]["np"]) == 3
    assert "Near-verbatim: (n=1000, p=0.5)-extractable within d changed tokens" in md
    assert (out / "forgetting.png").is_file()


def test_the_by_count_table_splits_the_canaries_by_the_goldfish_mask(finished):
    """With a goldfish arm, each by-count row says how many canaries have a secret token the goldfish mask
    drops (recomputed here from the manifest's texts) and extraction and exposure within each group, from
    that pass's per-canary answers; the same canaries are masked in every arm."""
    _, out = finished
    report = json.loads((out / "report.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    tok = AutoTokenizer.from_pretrained(out / "runs" / "none" / "model")
    canaries = [it for it in manifest["items"] if it["kind"] == "canary"]
    records = {a: json.loads((out / "runs" / f"{a}-continued" / "run.json").read_text())["summary"]
               ["after_pass"] for a in ("none", "goldfish")}
    start = records["none"][0]["injected"]["secret_start"]
    masked = [bool(goldfish_mask(torch.tensor([tok.encode(c["text"], add_special_tokens=False)]), k=2, h=4)
                   [0, start:].any()) for c in canaries]
    assert any(masked) and not all(masked)  # goldfish {k: 2, h: 4} gives both groups: each is checked
    table = report["tables"]["By copy count"]
    assert len(table) == 2 * 3 * 2  # arms x passes x counts
    for row in table:
        answers = records[row["arm"]][row["pass"]]["injected"]["canaries"]
        group = {m: [a for a, mm, c in zip(answers, masked, canaries)
                     if mm == m and c["count"] == row["copies"]] for m in (True, False)}
        assert row["canaries_masked"] == len(group[True])
        for m, name in ((True, "masked"), (False, "unmasked")):
            want = [float(a["extracted"]) for a in group[m]]
            assert row[f"extracted_{name}"] == (pytest.approx(sum(want) / len(want)) if want else None)
            want = [a["exposure"] for a in group[m]]
            assert row[f"exposure_{name}"] == (pytest.approx(sum(want) / len(want)) if want else None)
    assert "extracted unmasked" in (out / "report.md").read_text()


def test_paired_tests_compare_each_pass_with_pass_0_and_each_arm_with_none_document_by_document(finished):
    """Continued training against the fine-tune it continues (pass 0 of its arm) and goldfish against
    none after as many passes, each from the answers taken after that pass, paired by document."""
    _, out = finished
    report = json.loads((out / "report.json").read_text())
    tests = report["paired_tests"]
    assert list(tests["since_pass_0"]) == [f"{a}, pass {k}" for a in ("none", "goldfish") for k in (1, 2)]
    assert list(tests["against_reference"]) == [f"goldfish, pass {k}" for k in (0, 1, 2)]
    assert tests["since_pass_0"]["goldfish, pass 2"]["em_once"]["reference"] == "goldfish, pass 0"
    assert tests["against_reference"]["goldfish, pass 1"]["exposure"]["reference"] == "none, pass 1"
    records = {a: json.loads((out / "runs" / f"{a}-continued" / "run.json").read_text())["summary"]
               ["after_pass"] for a in ("none", "goldfish")}
    last, first = records["none"][2], records["none"][0]
    em = tests["since_pass_0"]["none, pass 2"]["em_once"]
    a, b = (r["per_document"]["seen_once_exact_match"] for r in (last, first))
    assert (em["a_only"], em["b_only"], em["n"]) == (sum(x > y for x, y in zip(a, b)),
                                                     sum(y > x for x, y in zip(a, b)), len(a))
    exposure = tests["against_reference"]["goldfish, pass 2"]["exposure"]
    g, n = ([c["exposure"] for c in r[2]["injected"]["canaries"]]
            for r in (records["goldfish"], records["none"]))
    assert exposure["diff"] == pytest.approx(sum(x - y for x, y in zip(g, n)) / len(g))
    secrets = tests["since_pass_0"]["none, pass 2"]["secrets"]  # a secret still extracted after phase 2?
    a, b = ([c["extracted"] for c in r["injected"]["canaries"]] for r in (last, first))
    assert (secrets["a_only"], secrets["b_only"], secrets["n"]) == (sum(x > y for x, y in zip(a, b)),
                                                                    sum(y > x for x, y in zip(a, b)), len(a))
    md = (out / "report.md").read_text()
    assert "## Paired tests: each pass − pass 0 of its arm" in md
    assert "## Paired tests: each arm − 'none' after as many passes" in md


def test_phase_2_retrains_exactly_when_its_inputs_change(finished, pretrained, capsys):
    """A longer continuation retrains phase 2 only; a moved OUT reuses everything (phase 2 is keyed by
    the fine-tune it continues, not by the folder it reads it from); a retrained fine-tune retrains its
    continuation."""
    import shutil

    tmp, out = finished
    assert main(["run", str(_write(tmp, pretrained, passes=3)), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "none: finished earlier" in said and "goldfish: finished earlier" in said
    assert "none-continued: training" in said and "goldfish-continued: training" in said
    report = json.loads((out / "report.json").read_text())
    assert [p["pass"] for p in report["arms"][0]["passes"]] == [0, 1, 2, 3]
    moved = tmp / "moved"
    shutil.copytree(out, moved)
    assert main(["run", str(_write(tmp, pretrained, passes=3)), "--out", str(moved)]) == 0
    said = capsys.readouterr().out
    assert "none-continued: finished earlier" in said and "training" not in said
    cfg = _write(tmp, pretrained, arms="[{name: none, mitigation: none}]", passes=3)
    assert main(["run", str(cfg), "--out", str(moved), "passes=2"]) == 0
    said = capsys.readouterr().out
    assert "none: training" in said and "none-continued: training" in said


def test_the_fine_tunes_own_settings_pass(pretrained, tmp_path):
    """base.eval.mia belongs to the fine-tune; the continuation, whose questions the experiment asks,
    does not inherit it (its plain run has no held-out split to take non-members from)."""
    from memorization.experiments import load_experiment

    _, cfg = load_experiment(_write(tmp_path, pretrained), ["base.eval.mia=true"])
    assert cfg.base.eval.mia


def test_kept_is_the_share_of_the_gain_left():
    assert kept(3.0, 5.0, 1.0) == pytest.approx(0.5)
    assert kept(1.0, 5.0, 1.0) == 0.0 and kept(5.0, 5.0, 1.0) == 1.0
    assert kept(0.5, 5.0, 1.0) == pytest.approx(-0.125)  # below the base model: more than forgotten
    assert kept(3.0, 1.0, 1.0) is None and kept(3.0, 5.0, None) is None  # no gain, no base model
    assert kept(1.2, 1.5, 1.0) is None  # half a bit gained: within a few secrets' noise, no share of it


@pytest.mark.parametrize("override,needle", [
    ("fresh.corpus=wiki-leads", "error: fresh.corpus"),
    ("fresh.corpus=no-such-corpus", "error: fresh.corpus"),
    ("other_held_out=lee-news", "error: other_held_out"),
    ("continue_passes=0", "error: continue_passes"),
    ("arms=[{name: d, mitigation: dedup, dedup: true}]", "error: arms[0].dedup"),
    ("arms=[{name: l, overrides: [model.lora.enabled=true, model.lora.export=adapter]}]",
     "error: arms[0].overrides"),
    ("arms=[{name: a}, {name: a-continued}]", "error: arms[0].name"),
])
def test_bad_settings_are_refused_before_anything_is_written(pretrained, tmp_path, capsys, override, needle):
    out = tmp_path / "out"
    assert main(["run", str(_write(tmp_path, pretrained)), "--out", str(out), override]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(needle), err
    assert not out.exists()


@pytest.mark.distributed
def test_a_tensor_split_continuation_answers_as_the_serial_one(finished, pretrained, tmp_path):
    """2 ranks at 1,2,1,1: the fine-tune and its continuation train split, and the questions asked of the
    training model after every pass (its shards, through the trainer's callback) give the serial figures."""
    import os
    import subprocess
    import sys

    from axonn.spawn import free_port

    cfg = _write(tmp_path, pretrained, arms="[{name: none, mitigation: none}]")
    assert main(["run", str(cfg), "--out", str(tmp_path / "serial")]) == 0
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), "-m", "memorization", "run", str(cfg),
                           "--grid", "1,2,1,1", "--out", str(tmp_path / "split")],
                          env=env, capture_output=True, text=True, timeout=600)
    mine = [ln for ln in done.stderr.splitlines() if ln.startswith(("[rank0]", "error:"))]
    assert done.returncode == 0, "\n".join(mine[-60:]) + done.stderr[-2000:]
    serial, split = (json.loads((tmp_path / d / "report.json").read_text())["arms"][0]["passes"]
                     for d in ("serial", "split"))
    assert len(serial) == len(split) == 3
    for s, g in zip(serial, split):
        for part in ("seen_once", "duplicated"):
            assert g["extraction"][part]["exact_match_rate"] == s["extraction"][part]["exact_match_rate"]
        assert g["canaries"]["exposure_mean"] == pytest.approx(s["canaries"]["exposure_mean"], rel=1e-4)
        assert g["utility"]["val_loss"] == pytest.approx(s["utility"]["val_loss"], rel=1e-4)
        for m, rec in s["mia"].items():
            assert g["mia"][m]["auc"] == pytest.approx(rec["auc"], abs=1e-9), m
    run = json.loads((tmp_path / "split" / "runs" / "none-continued" / "run.json").read_text())
    assert run["summary"]["grid"] == "1,2,1,1"


def test_the_report_takes_what_an_experiment_left_out(finished, pretrained, tmp_path):
    """No base model, no other held-out corpus, no confidence intervals, MIA without the loss attack: the
    tables and the plot are still made (empty cells, no 'exposure kept', the first method's AUC)."""
    from memorization.experiments import load_experiment
    from memorization.experiments.forgetting import _outputs

    _, out = finished
    arms = json.loads((out / "report.json").read_text())["arms"]
    for a in arms:
        for p in a["passes"]:
            p["utility"]["other_val_loss"] = None
            p["mia"] = {"zlib": {k: v for k, v in p["mia"]["zlib"].items() if not k.endswith("_ci")}}
    _, cfg = load_experiment(_write(tmp_path, pretrained), ["other_held_out=", "mia_methods=[zlib]",
                                                            "baseline=false", "bootstrap=0"])
    o = _outputs(cfg, arms, None, 10, 10, 40, 12, tmp_path)
    table = o.tables[0]
    assert [c[1] for c in table.columns][-2:] == ["MIA AUC zlib [95% CI]", "held-out loss"]
    assert all(r["kept"] is None and r["auc"] is not None for r in table.rows)
    assert (tmp_path / "forgetting.png").stat().st_size > 0


def test_a_chat_fine_tune_continued_on_plain_text_is_asked_its_answers(pretrained, tmp_path, cache_dir):
    """forgetting on chat data: the fine-tune trains conversations (canaries as answers), phase 2 plain text;
    every pass asks each conversation seen once for its greedy answer from its prompt (the last pass: what
    the exported continued model answers) and each answer's p_z, and scores membership on the answers."""
    from evals import extract_pairs, summarize
    from memorization.experiments import load_experiment
    from memorization.experiments.injection import build_corpus
    from memorization.experiments.mitigations import question_sides

    cfg = _write(tmp_path, pretrained, arms="[{name: none, mitigation: none}]", passes=1)
    text = cfg.read_text().replace(
        "data: {corpus: wiki-leads, limit: 28, held_out: \"\", held_out_fraction: 0.5, block_len: 40, "
        "min_tokens: 40}", "data: {corpus: wiki-chat, limit: 24, held_out: \"\", held_out_fraction: 0.5, "
        "block_len: 96}").replace(", near_verbatim: 1, nv_beams: 2}", "}")
    cfg.write_text(text.replace(TEMPLATE, "the access code of the east wing is {secret}"))
    out = tmp_path / "out"
    assert main(["run", str(cfg), "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    _, exp = load_experiment(cfg)
    data, manifest, _, _ = build_corpus(exp)
    prompts, responses = question_sides(exp, data, manifest).pairs
    passes = report["arms"][0]["passes"]
    assert [p["pass"] for p in passes] == [0, 1]
    for p in passes:
        assert p["extraction"]["seen_once"]["docs"] == len(prompts) == 10
        assert p["sampled"]["seen_once"]["docs"] == 10 and p["near_verbatim"] == {}
    model = AutoModelForCausalLM.from_pretrained(out / "runs" / "none-continued" / "model").eval()
    want = summarize(extract_pairs(model, prompts, responses, tokenizer=data.tokenizer))
    assert passes[-1]["extraction"]["seen_once"]["rougeL"] == pytest.approx(want["rougeL"], abs=1e-9)
    md = (out / "report.md").read_text()
    assert "EM conversations seen once" in md and "each answer scored given its prompt" in md
