"""mitigations end to end on a micro config: a tiny briefly-trained model stands in for SmolLM2."""
from __future__ import annotations

import json

import pytest
from helpers import trained_base

from memorization.cli import main
from memorization.experiments.injection import masked_split, secret_mask
from memorization.experiments.mitigations import Config, splits_by_mask
from memorization.experiments.spec import build_experiment, load_experiment_dict

EXPERIMENT = """
kind: mitigations
name: mit
passes: 1
counts: [1, 3]
canaries: {{per_count: 2, template: "the secret access code of the old museum wing is {{secret}}",
            space: {{kind: digits, length: 2}}, candidates: 0}}
duplicates: {{per_count: 1}}
bootstrap: 20
other_held_out: lee-news
other_held_out_limit: 4
samples: 1
downstream: [analogies_family]
downstream_limit: 3
arms: {arms}
base:
  data: {{corpus: wiki-leads, limit: 28, held_out: "", held_out_fraction: 0.5, block_len: 40, min_tokens: 40}}
  model: {{name: {model}}}
  trainer: {{lr: 3.0e-3, warmup_steps: 1, batch_size: 4, progress: false}}
  eval: {{prefix: 16, suffix: 16, batch_size: 8, near_verbatim: 1, nv_beams: 2}}
  wandb: {{mode: disabled}}
"""

ARMS = ("[{name: none, mitigation: none}, {name: goldfish, mitigation: goldfish, "
        "overrides: [goldfish.enabled=true]}, {name: dedup, mitigation: dedup, dedup: true}, "
        "{name: dp, mitigation: dp-sgd, overrides: [trainer.dp.enabled=true, trainer.dp.target_epsilon=4, "
        "trainer.dp.delta=1.0e-5]}, "
        "{name: lora, mitigation: goldfish+lora, overrides: [goldfish.enabled=true, model.lora.enabled=true, "
        "model.lora.r=2]}]")


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    return trained_base(tmp_path_factory.mktemp("base"), max_steps=2)


def _write(tmp_path, model, arms=ARMS):
    p = tmp_path / "m.yaml"
    p.write_text(EXPERIMENT.format(model=model, arms=arms))
    return p


def test_mitigations_end_to_end(pretrained, tmp_path, cache_dir):
    out = tmp_path / "out"
    assert main(["run", str(_write(tmp_path, pretrained)), "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    arms = report["arms"]
    assert [a["name"] for a in arms] == ["none", "goldfish", "dedup", "dp", "lora"]
    for a in arms:
        assert set(a) >= {"name", "mitigation", "extraction", "canaries", "by_copy_count", "mia", "utility",
                          "privacy", "cost"}
        assert 0 <= a["extraction"]["seen_once"]["exact_match_rate"] <= 1
        assert a["extraction"]["duplicated"]["docs"] == 2 and a["canaries"]["count"] == 4
        assert set(a["by_copy_count"]) == {"1", "3"}
        for m in a["mia"].values():
            assert m["auc_ci"][0] <= m["auc"] <= m["auc_ci"][1]
        # downstream utility through lm-eval: 3 four-way family analogies per arm, with a standard error
        ds = a["utility"]["downstream"]["tasks"]["analogies_family"]
        assert ds["n"] == 3 and ds["acc"] in (0.0, 1 / 3, 2 / 3, 1.0) and ds["acc_stderr"] >= 0
        assert a["utility"]["val_loss"] > 0 and a["cost"]["peak_rss_gb"] > 0
        assert a["cost"]["trainable_params"] > 0
        # near-verbatim beside p_z: its d = 0 column is the exact copy's (n, p) summary
        for part, v in a["near_verbatim"].items():
            for scheme, summary in v["offsets"]["0"]["np"].items():
                exact = a["sampled"][part]["np"]["schemes"][scheme]
                assert list(summary["schemes"]) == ["d=0", "d=1"] and summary["schemes"]["d=0"] == exact
        assert set(a["near_verbatim"]) == {"seen_once", "duplicated"}
    base = report["base_downstream"]["tasks"]["analogies_family"]
    assert base["n"] == 3
    assert "analogies_family acc ± SE" in (out / "report.md").read_text()
    md = (out / "report.md").read_text()
    assert "Near-verbatim: (n=1000, p=0.5)-extractable within d changed tokens" in md
    assert arms[0]["cost"]["step_time_vs_none"] == pytest.approx(1.0)
    none, dp, lora = arms[0], arms[3], arms[4]
    assert none["privacy"]["epsilon"] is None
    assert dp["privacy"]["epsilon"] == pytest.approx(4.0, rel=0.05) and dp["privacy"]["delta"] == 1e-5
    assert 0 < lora["cost"]["trainable_params"] < none["cost"]["trainable_params"] / 10
    dedup = json.loads((out / "dedup.json").read_text())
    # every injected extra copy (canary x3 -> 2 extra each, duplicate x3 -> 2 extra) is removed
    assert dedup["counts"]["exact-document"]["documents"] == 2 * 2 + 1 * 2
    rows = {name: json.loads((out / "runs" / name / "run.json").read_text())["summary"]["steps"]
            for name in ("none", "dedup")}
    assert rows["dedup"] < rows["none"]
    assert (out / "mitigations-tradeoff.png").is_file() and (out / "mitigations-bars.png").is_file()
    # per-document paired tests of every row against 'none', from the per-document answers in evals.json
    paired = {"tests": report["paired_tests"]}
    assert list(paired["tests"]) == ["base model", "goldfish", "dedup", "dp", "lora"]
    assert {t["reference"] for row in paired["tests"].values() for t in row.values()} == {"none"}
    answers = {n: json.loads((out / "runs" / n / "evals.json").read_text())["values"]["per_document"]
               for n in ("none", "goldfish")}
    em = [answers[n]["seen_once_exact_match"] for n in ("goldfish", "none")]
    test = paired["tests"]["goldfish"]["em_once"]
    pairs = list(zip(*em))
    assert (test["a_only"], test["b_only"]) == (sum(a > b for a, b in pairs), sum(a < b for a, b in pairs))
    nll = paired["tests"]["goldfish"]["nll"]
    assert nll["diff"] == pytest.approx(sum(answers["goldfish"]["nonmember_nll"]) / nll["n"]
                                        - sum(answers["none"]["nonmember_nll"]) / nll["n"])
    assert "auc_ref_ratio" not in paired["tests"]["base model"]  # its reference is itself
    assert set(paired["tests"]["goldfish"]) >= {"em_once", "rouge_once", "em_dup", "exposure", "secrets",
                                                 "nll", "auc_loss"}
    # secrets extracted: McNemar over the canaries, paired by manifest order
    secrets = [[c["extracted"] for c in json.loads((out / "runs" / n / "evals.json").read_text())["values"]
                ["injected"]["canaries"]] for n in ("goldfish", "none")]
    test = paired["tests"]["goldfish"]["secrets"]
    assert (test["a_only"], test["b_only"]) == (sum(a > b for a, b in zip(*secrets)),
                                                sum(a < b for a, b in zip(*secrets)))
    assert len(secrets[0]) == 4 and test["rate_a"] == sum(secrets[0]) / 4
    title = next(t for t in report["tables"] if t.startswith("Paired tests"))
    assert report["table_specs"][title]["per_seed"] is True and title in md


@pytest.mark.parametrize("arms,needle", [
    ("[{name: a, overrides: [trainer.nope=1]}]", "arms[0].overrides"),
    ("[{name: a}, {name: a}]", "arms"),
    ("[{name: a, overrides: [data.dedup.enabled=true]}]", "arms[0].overrides"),  # one corpus for every arm
    ("[]", "arms"),
])
def test_bad_arms_are_refused_before_anything_is_written(pretrained, tmp_path, cache_dir, capsys, arms,
                                                         needle):
    out = tmp_path / "out"
    assert main(["run", str(_write(tmp_path, pretrained, arms)), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: {needle}"), err
    assert not out.exists()


@pytest.mark.distributed
def test_every_arm_at_a_tensor_split_scores_as_the_serial_run(pretrained, tmp_path, cache_dir):
    """The mitigation comparison with its weights split: 2 ranks at 1,2,1,1 (heads and vocabulary over Y)
    train and score every arm - none, goldfish, dedup, DP-SGD (no noise, a clip norm that bites, so the
    update is deterministic) and goldfish + LoRA - to the serial run's figures."""
    import os
    import subprocess
    import sys

    from axonn.spawn import free_port

    arms = ARMS.replace("trainer.dp.target_epsilon=4, trainer.dp.delta=1.0e-5",
                        "trainer.dp.noise_multiplier=0.0, trainer.dp.max_grad_norm=0.01")
    cfg = _write(tmp_path, pretrained, arms)
    cfg.write_text(cfg.read_text().replace("downstream: [analogies_family]\n", "downstream: []\n"))
    assert main(["run", str(cfg), "--out", str(tmp_path / "serial")]) == 0
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), "-m", "memorization", "run", str(cfg),
                           "--grid", "1,2,1,1", "--out", str(tmp_path / "split")],
                          env=env, capture_output=True, text=True, timeout=900)
    # rank 0's own lines first: torchrun's tail shows only the rank that lost its peer
    mine = [ln for ln in done.stderr.splitlines() if ln.startswith(("[rank0]", "error:"))]
    assert done.returncode == 0, "\n".join(mine[-60:]) + done.stderr[-2000:]
    reports = [json.loads((tmp_path / d / "report.json").read_text()) for d in ("serial", "split")]
    serial, split = ([r["baseline"], *r["arms"]] for r in reports)  # the base model's row too
    assert [a["name"] for a in split] == ["base model", "none", "goldfish", "dedup", "dp", "lora"]
    for s, g in zip(serial, split, strict=True):
        for part in ("seen_once", "duplicated"):
            rate = s["extraction"][part]["exact_match_rate"]
            assert g["extraction"][part]["exact_match_rate"] == rate, s["name"]
        exposure = s["canaries"]["exposure_mean"]
        assert g["canaries"]["exposure_mean"] == pytest.approx(exposure, rel=1e-4), s["name"]
        assert g["utility"]["val_loss"] == pytest.approx(s["utility"]["val_loss"], rel=1e-4), s["name"]
        for m, rec in s["mia"].items():
            assert g["mia"][m]["auc"] == pytest.approx(rec["auc"], abs=1e-9), (s["name"], m)
        assert g["cost"]["trainable_params"] == s["cost"]["trainable_params"], s["name"]
        for part, v in s["near_verbatim"].items():  # the search's tokens from vocab-split logits
            got = g["near_verbatim"][part]["offsets"]["0"]["np"]
            assert got == v["offsets"]["0"]["np"], (s["name"], part)
    run = json.loads((tmp_path / "split" / "runs" / "lora" / "run.json").read_text())
    assert run["summary"]["grid"] == "1,2,1,1"


def test_the_base_model_row_is_the_untrained_arm(pretrained, tmp_path, cache_dir, monkeypatch):
    """The 'base model' row is the experiment's own questions asked of the starting weights: an arm whose
    fine-tune cannot move them (lr 1e-12) answers exactly as it does; it leads the tables, gives the
    un-fine-tuned downstream score, and is cached (a second invocation loads no reference model for it)."""
    import memorization.experiments.mitigations as mit

    arms = "[{name: still, mitigation: none, overrides: [trainer.lr=1.0e-12]}]"
    cfg = _write(tmp_path, pretrained, arms)
    cfg.write_text(cfg.read_text().replace(", near_verbatim: 1, nv_beams: 2}", "}"))
    out = tmp_path / "out"
    assert main(["run", str(cfg), "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    base, still = report["baseline"], report["arms"][0]
    assert base["name"] == "base model" and [a["name"] for a in report["arms"]] == ["still"]
    assert base["cost"]["steps"] == 0 and base["privacy"]["epsilon"] is None
    for part in ("seen_once", "duplicated"):
        assert still["extraction"][part] == base["extraction"][part]
    assert still["canaries"]["exposure_mean"] == pytest.approx(base["canaries"]["exposure_mean"], abs=1e-9)
    assert still["utility"]["val_loss"] == pytest.approx(base["utility"]["val_loss"], rel=1e-6)
    assert still["mia"]["loss"]["auc"] == base["mia"]["loss"]["auc"]
    assert report["base_downstream"] == base["utility"]["downstream"]
    md = (out / "report.md").read_text()
    arms_table = md[md.index("| arm |"):]
    assert arms_table.index("| base model |") < arms_table.index("| still |")

    def cached_only(self, key, load, evaluate, real=mit.Experiment.baseline):
        return real(self, key, lambda: pytest.fail("the cached baseline loaded its model"), evaluate)

    monkeypatch.setattr(mit.Experiment, "baseline", cached_only)
    assert main(["run", str(cfg), "--out", str(out)]) == 0
    assert json.loads((out / "report.json").read_text())["baseline"] == base


def test_masked_split_groups_canaries_by_a_dropped_secret_token():
    """A canary is masked when goldfish drops at least one of its secret tokens; each group's extraction
    and exposure are its own means; canaries scored before the mask was recorded give no split."""
    cs = [{"secret_tokens_dropped": 0, "extracted": True, "exposure": 9.0, "kept_exposure": None},
          {"secret_tokens_dropped": 2, "extracted": False, "exposure": 3.0, "kept_exposure": 6.0},
          {"secret_tokens_dropped": 1, "extracted": True, "exposure": 5.0, "kept_exposure": 4.0},
          {"secret_tokens_dropped": 0, "extracted": False, "exposure": 7.0, "kept_exposure": None}]
    assert masked_split(cs) == {"canaries_masked": 2, "extracted_unmasked": 0.5, "extracted_masked": 0.5,
                                "exposure_unmasked": 8.0, "exposure_masked": 4.0, "kept_exposure_masked": 5.0}
    only = masked_split(cs[:1])
    assert (only["canaries_masked"], only["extracted_masked"], only["exposure_unmasked"]) == (0, None, 9.0)
    old = masked_split([{"extracted": True, "exposure": 9.0}])
    assert old == dict.fromkeys(old)  # every value None


@pytest.mark.parametrize("overrides,split", [
    ([], True),  # the shipped arms: goldfish (hash) among them
    (["base.goldfish.strategy=random"], False),  # drops drawn anew per copy: no canary is masked in all
    (["arms=[{name: none, mitigation: none}]"], False),  # no arm trains with goldfish
    (["base.goldfish.strategy=apertus"], True),  # one document per row: its windows stay inside it
    (["base.goldfish.strategy=apertus", "base.data.packing=packed"], False),  # windows reach the previous doc
    (["base.data.packing=packed"], True),  # hash honours document boundaries in packed rows
])
def test_the_by_count_table_splits_by_the_mask_only_where_it_means_something(overrides, split):
    cfg = build_experiment(Config, load_experiment_dict("configs/experiments/mitigations.yaml", overrides))
    assert splits_by_mask(cfg) is split


def test_canaries_are_grouped_by_the_mask_only_where_every_copy_drops_the_same_tokens():
    """secret_mask is base.goldfish's mask of a canary's tokens where it is the document's own, else None
    (no masked/unmasked fields, no kept-token exposure, nothing for the paired test to misalign)."""
    import torch

    from memorization.mitigations.goldfish import goldfish_mask

    def base(*overrides):
        return build_experiment(Config, load_experiment_dict("configs/experiments/mitigations.yaml",
                                                             list(overrides))).base

    ids = list(range(100, 140))
    mask = secret_mask(base())
    assert mask(ids) == goldfish_mask(torch.tensor([ids]), strategy="hash", k=4, h=13)[0].tolist()
    assert any(mask(ids)) and not all(mask(ids))
    assert secret_mask(base("base.goldfish.strategy=random")) is None
    assert secret_mask(base("base.goldfish.strategy=apertus", "base.data.packing=packed")) is None


CHAT_EXPERIMENT = """
kind: mitigations
name: mitc
passes: 1
counts: [1, 3]
canaries: {{per_count: 2, template: "the access code of the east wing is {{secret}}",
            space: {{kind: digits, length: 2}}, candidates: 0}}
duplicates: {{per_count: 1}}
bootstrap: 20
other_held_out: ""
downstream: []
samples: 1
dedup: {{enabled: true, repeated_spans: {spans}}}
arms: [{{name: none, mitigation: none}},
       {{name: goldfish, mitigation: goldfish, overrides: [goldfish.enabled=true]}},
       {{name: dedup, mitigation: dedup, dedup: true}}]
base:
  data: {{corpus: wiki-chat, limit: 24, held_out: "", held_out_fraction: 0.5, block_len: 96}}
  model: {{name: {model}}}
  trainer: {{lr: 3.0e-3, warmup_steps: 1, batch_size: 4, progress: false}}
  eval: {{prefix: 16, suffix: 16, batch_size: 8, near_verbatim: 1, nv_beams: 2}}
  wandb: {{mode: disabled}}
"""


def test_mitigations_on_chat_data_ask_each_conversation_its_answer(pretrained, tmp_path, cache_dir, capsys):
    """On chat data every arm is asked about the conversations seen once: the greedy answer from each
    prompt, and membership scored on the answer given its prompt (the tokens training supervises), beside
    held-out conversations; dedup removes whole copied conversations; span dedup is refused."""
    import torch

    from evals import sequence_logprobs
    from evals.probabilistic import sampled_pairs
    from evals.sampling import parse_schemes
    from memorization.experiments import load_experiment
    from memorization.experiments.injection import build_corpus
    from memorization.experiments.mitigations import beyond_summary, question_sides
    from memorization.models import build_model

    cfg = tmp_path / "chat.yaml"
    cfg.write_text(CHAT_EXPERIMENT.format(model=pretrained, spans="true"))
    out = tmp_path / "out"
    assert main(["run", str(cfg), "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: dedup.repeated_spans=True")
    assert not out.exists()
    cfg.write_text(CHAT_EXPERIMENT.format(model=pretrained, spans="false"))
    assert main(["run", str(cfg), "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    _, exp = load_experiment(cfg)
    data, manifest, _, _ = build_corpus(exp)
    sides = question_sides(exp, data, manifest)
    members, (m_starts, n_starts), (prompts, responses) = sides.members, sides.starts, sides.pairs
    assert len(members) == 12 - 2 and len(sides.nonmembers) == 12  # 24 split in half; 2 of 12 duplicated
    for ids, start, prompt, response in zip(members, m_starts, prompts, responses):
        assert start == len(prompt) and ids[:start + len(response)] == prompt + response
    assert all(1 <= s < len(ids) for s, ids in zip(n_starts, sides.nonmembers))
    for a in [report["baseline"], *report["arms"]]:
        assert a["extraction"]["seen_once"]["docs"] == len(members)
        assert a["extraction"]["duplicated"]["docs"] == 2 and a["canaries"]["count"] == 4
        assert a["sampled"]["seen_once"]["docs"] == len(members) and a["sampled"]["duplicated"]["docs"] == 2
        for part, v in a["near_verbatim"].items():  # its d = 0 column is each answer's p_z
            for scheme, summary in v["offsets"]["0"]["np"].items():
                assert summary["schemes"]["d=0"] == a["sampled"][part]["np"]["schemes"][scheme]
        assert set(a["near_verbatim"]) == {"seen_once", "duplicated"}
    # membership: minus the mean NLL of each answer given its prompt (the whole row would differ)
    model = build_model(str(pretrained)).eval()
    per = json.loads((out / "baseline" / "evals.json").read_text())["values"]["per_document"]
    for side, seqs, starts in (("members", members, m_starts), ("nonmembers", sides.nonmembers, n_starts)):
        want = [sequence_logprobs(model, torch.tensor([ids]))[0].double()[s - 1:].mean().item()
                for ids, s in zip(seqs, starts)]
        assert per[side]["loss"] == pytest.approx(want, abs=1e-5)
    # beyond greedy: each answer's p_z from its own prompt
    e = exp.base.eval
    want = beyond_summary(sampled_pairs(model, prompts, responses, schemes=parse_schemes(e.sampling),
                                        ns=e.np_ns, p=e.np_p))
    assert report["baseline"]["sampled"]["seen_once"] == json.loads(json.dumps(want))
    held = report["baseline"]["utility"]["val_loss"]
    weights = [len(ids) - s for ids, s in zip(sides.nonmembers, n_starts)]
    assert held == pytest.approx(sum(w * nll for w, nll in zip(weights, per["nonmember_nll"])) / sum(weights))
    dedup = json.loads((out / "dedup.json").read_text())
    assert dedup["counts"]["exact-document"]["documents"] == 2 * 2 + 1 * 2  # every extra copy, whole
    steps = {n: json.loads((out / "runs" / n / "run.json").read_text())["summary"]["steps"]
             for n in ("none", "dedup")}
    assert steps["dedup"] < steps["none"]
    md = (out / "report.md").read_text()
    assert "EM conversations seen once" in md and "the greedy answer (its first 16 tokens)" in md
