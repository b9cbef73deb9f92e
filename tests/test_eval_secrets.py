"""eval.secrets: the secrets a chat set's records carry (private-records), scored as the answer to each
record's own prompt, for the trained records and the held-out ones."""
from __future__ import annotations

import json

import pytest

from data_pipelines import SecretSpace, render
from data_pipelines.chat import answer_encoder
from memorization.cli import main
from memorization.config import load_run_config
from memorization.eval.exposure import canary_scores
from memorization.models import REPO_ROOT, build_model
from memorization.train.evaluation import secret_results
from memorization.train.prepare import prepare_data
from memorize_core import ConfigError

TINY = REPO_ROOT / "configs" / "train" / "tiny-wiki.yaml"
RECORDS = ["data.corpus=private-records", "data.limit=12", "data.block_len=96", "data.held_out=",
           "data.held_out_fraction=0.5", "data.min_tokens=4", "data.vocab_size=300", "eval.prefix=8",
           "eval.suffix=16", "eval.secrets=40", "wandb.mode=disabled", "trainer.progress=false",
           "model.overrides={hidden_size: 32, num_hidden_layers: 1, intermediate_size: 64, "
           "num_attention_heads: 2, num_key_value_heads: 2}"]


def test_records_are_scored_as_trained_and_held_out(cache_dir):
    cfg = load_run_config(TINY, RECORDS)
    data = prepare_data(cfg)
    recs = data.secrets
    members = [r for r in recs if r["member"]]
    assert len(members) == len(data.train_doc_ids) == 6 and len(recs) == 12
    assert {r["id"] for r in members} == set(data.train_doc_ids)
    tok = data.tokenizer
    row = {i: j for j, i in enumerate(data.train_doc_ids)}
    for r in members[:4]:  # the scored ids are the training row's: the prompt, then the record
        ids = answer_encoder(tok, r["prompt"])([render(r["template"], r["secret"])])[0]
        assert data.train.input_ids[row[r["id"]], :len(ids)].tolist() == ids
    model = build_model(cfg.model.name, vocab_size=len(tok), overrides=cfg.model.overrides).eval()
    out = secret_results(model, cfg, data)
    assert out["members"]["records"] == 6 and out["non_members"]["records"] == 6
    assert out["space_size"] == SecretSpace(**recs[0]["space"]).size == 10 ** 6
    for r, got in list(zip(recs, out["rows"]))[::5]:  # each row is canary_scores of that record alone
        want = canary_scores(model, tok, r["template"], SecretSpace(**r["space"]), [r["secret"]],
                             candidates=40, seed=cfg.seed, encode=answer_encoder(tok, r["prompt"]))
        assert got["exposure"] == pytest.approx(want["canaries"][0]["exposure"])
        assert (got["id"], got["member"]) == (r["id"], r["member"])
    mean = sum(x["exposure"] for x in out["rows"] if x["member"]) / 6
    assert out["members"]["exposure_mean"] == pytest.approx(mean)


@pytest.mark.parametrize("corpus, match", [("wiki-leads", "is plain text"),
                                           ("wiki-chat", "has no records that carry a secret")])
def test_refused_where_no_record_carries_a_secret(cache_dir, corpus, match):
    cfg = load_run_config(TINY, RECORDS + [f"data.corpus={corpus}"])
    with pytest.raises(ConfigError, match=r"^eval\.secrets=40: .*" + match):
        prepare_data(cfg)


def test_off_by_default_and_out_of_the_run_key():
    from dataclasses import replace

    from memorization.experiments.runner import run_key

    cfg = load_run_config(TINY, [])
    assert cfg.eval.secrets == 0 and "secrets" not in run_key(cfg)["eval"]
    assert run_key(replace(cfg, eval=replace(cfg.eval, secrets=10)))["eval"]["secrets"] == 10
    with pytest.raises(ConfigError, match=r"^eval\.secrets=-1: "):
        load_run_config(TINY, ["eval.secrets=-1"])


def test_a_trained_run_reports_its_records_secrets(tmp_path, cache_dir):
    out = tmp_path / "run"
    assert main(["train", str(TINY), "--out", str(out), *RECORDS, "trainer.epochs=2"]) == 0
    s = json.loads((out / "run.json").read_text())["summary"]["secrets"]
    assert s["candidates"] == 40 and len(s["rows"]) == 12
    assert "## Secrets of the records (eval.secrets)" in (out / "report.md").read_text()


def test_records_are_grouped_by_the_secret_tokens_goldfish_drops_in_their_rows(cache_dir):
    """Each trained record's secret_tokens_dropped is the number of its secret's tokens the trainer's
    goldfish drops in that record's row (hash, k=16: both groups hold records); the sides' masked and
    unmasked groups average their rows; the grouping is the same with goldfish off."""
    from memorization.mitigations.goldfish import goldfish_labels
    from memorize_core import IGNORE_INDEX

    over = RECORDS + ["goldfish.enabled=true", "goldfish.strategy=hash", "goldfish.k=16", "goldfish.h=3"]
    cfg = load_run_config(TINY, over)
    data = prepare_data(cfg)
    tok, rows = data.tokenizer, data.train
    model = build_model(cfg.model.name, vocab_size=len(tok), overrides=cfg.model.overrides).eval()
    out = secret_results(model, cfg, data)
    row = {i: j for j, i in enumerate(data.train_doc_ids)}
    for r, got in zip(data.secrets, out["rows"]):
        if not r["member"]:
            continue
        encode = answer_encoder(tok, r["prompt"])
        ids = encode([render(r["template"], r["secret"])])[0]
        other = encode([render(r["template"], "0" * len(r["secret"]))])[0]
        start = next(i for i, (a, b) in enumerate(zip(ids, other)) if a != b)  # the secret's first token
        j = row[r["id"]]
        labels = goldfish_labels(rows.input_ids[j:j + 1], rows.labels[j:j + 1], strategy="hash", k=16, h=3,
                                 doc_ids=rows.doc_ids[j:j + 1], positions=rows.positions[j:j + 1])[0]
        assert (rows.labels[j, start:len(ids)] != IGNORE_INDEX).all()
        assert got["secret_tokens_dropped"] == int((labels[start:len(ids)] == IGNORE_INDEX).sum())
    trained = [x for x in out["rows"] if x["member"]]
    for name, masked in (("masked", True), ("unmasked", False)):
        group = [x for x in trained if bool(x["secret_tokens_dropped"]) == masked]
        assert group and out["members"][name]["records"] == len(group)
        assert out["members"][name]["exposure_mean"] == pytest.approx(
            sum(x["exposure"] for x in group) / len(group))
    assert out["mask"] == {"strategy": "hash", "k": 16, "h": 3, "applied": True}
    plain = load_run_config(TINY, over[:-4] + ["goldfish.strategy=hash", "goldfish.k=16", "goldfish.h=3"])
    again = secret_results(model, plain, data)
    assert [x["secret_tokens_dropped"] for x in again["rows"]] == \
        [x["secret_tokens_dropped"] for x in out["rows"]] and again["mask"]["applied"] is False
