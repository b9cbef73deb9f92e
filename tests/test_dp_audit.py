"""The one-run privacy audit of a run (memorization/eval/dp_audit.py): half of m canaries trained on by a
seeded draw recorded in run.json; a model that memorizes them gives a bound well above 1; a DP-SGD
run with heavy noise gives a bound no larger than its accountant's epsilon."""
from __future__ import annotations

import json

import numpy as np
import torch
from helpers import TINY, tiny_model

from evals.audit import epsilon_lower_bound
from memorization.cli import main
from memorization.eval.dp_audit import AuditSet, audit_set, run_audit


def test_the_draw_is_seeded_and_about_half():
    a, b = audit_set(200, seed=3), audit_set(200, seed=3)
    assert a.texts == b.texts and (a.included == b.included).all()
    assert len(set(a.texts)) == 200 and 70 < a.included.sum() < 130
    assert audit_set(200, seed=4).texts != a.texts
    assert [d.id for d in a.documents()] == [f"audit-{i}" for i in np.flatnonzero(a.included)]


def test_a_model_that_memorizes_its_canaries_gives_a_bound_well_above_one():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (128, 12), generator=g)
    included = np.random.default_rng(0).random(128) < 0.5
    model = tiny_model(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train = ids[torch.from_numpy(included)]
    for _ in range(150):  # the included canaries only, full batch, until they are memorized
        opt.zero_grad()
        model(input_ids=train, labels=train).loss.backward()
        opt.step()
    canaries = AuditSet([f"c{i}" for i in range(128)], included, seed=0, ids=ids.tolist())
    result = run_audit(model.eval(), canaries, epsilon=None)
    assert result["eps_lower_bound"] > 2.0, result
    assert result["correct"] == result["guesses"]  # perfect separation on the guessed ones
    # the bound is the closed form for that many correct guesses at the sweep's corrected confidence
    want = epsilon_lower_bound(result["correct"], result["guesses"], beta=result["per_candidate_beta"])
    assert abs(result["eps_lower_bound"] - want) < 1e-9
    assert not result["above_nominal"]


def test_a_run_records_its_draw_and_a_noisy_dp_run_stays_below_its_epsilon(tmp_path):
    cfg = tmp_path / "t.yaml"
    cfg.write_text(TINY.replace("eval: {extraction: false}", "eval: {extraction: false, audit: true, "
                                "audit_canaries: 16}"))
    out = tmp_path / "out"
    assert main(["train", str(cfg), "--out", str(out), "trainer.dp.enabled=true",
                 "trainer.dp.noise_multiplier=20", "trainer.max_steps=3"]) == 0
    run = json.loads((out / "run.json").read_text())
    drawn = run["audit"]["canaries"]
    assert len(drawn) == 16 and run["audit"]["seed"] == 0
    trained = {d for d in run["documents"]["members"]}
    assert not any(d.startswith("audit-") for d in trained)  # members stay the corpus' documents
    a = run["summary"]["audit"]
    assert a["m"] == 16 and a["included"] == sum(c["included"] for c in drawn)
    assert a["nominal_epsilon"] == run["summary"]["epsilon"]
    assert a["eps_lower_bound"] <= run["summary"]["epsilon"] and not a["above_nominal"]


def test_exactly_the_included_canaries_become_training_rows():
    import yaml

    from memorization.train.prepare import prepare_data

    raw = yaml.safe_load(TINY)
    raw["eval"].update(audit=True, audit_canaries=12)
    cfg = load_run_config_from(raw)
    data = prepare_data(cfg)
    rows = [i for i in data.train_doc_ids if str(i).startswith("audit-")]
    assert rows == [f"audit-{i}" for i in np.flatnonzero(data.audit.included)]
    for i in np.flatnonzero(data.audit.included):  # the row holds the ids the audit scores
        k = data.train_doc_ids.index(f"audit-{i}")
        assert list(data.train_docs[k]) == data.audit.ids[i]


def load_run_config_from(raw):
    """A RunConfig from a parsed YAML mapping (as load_run_config reads a file)."""
    import tempfile
    from pathlib import Path

    import yaml

    from memorization.config import load_run_config

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "c.yaml"
        p.write_text(yaml.safe_dump(raw))
        return load_run_config(p, [])
