"""Chat fine-tuning through the run pipeline: only responses are supervised,
extraction is prompt -> response."""
from __future__ import annotations

import json

import pytest
import torch

from data_pipelines import IGNORE_INDEX
from memorization.cli import main
from memorization.config import load_run_config
from memorization.mitigations.goldfish import GoldfishConfig, GoldfishTransform
from memorization.train.prepare import prepare_data

CFG = """
name: chat
data: {{corpus: {corpus}, limit: 16, vocab_size: 320, block_len: 96, held_out: ""}}
model:
  name: tiny
  overrides: {{hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, num_attention_heads: 4,
              num_key_value_heads: 4}}
trainer: {{batch_size: 4, max_steps: 2, progress: false}}
eval: {{prefix: 16, suffix: 24, batch_size: 8}}
wandb: {{mode: disabled}}
"""


def _cfg(tmp_path, corpus="private-records"):
    p = tmp_path / "c.yaml"
    p.write_text(CFG.format(corpus=corpus))
    return p


def test_chat_rows_supervise_responses_only_with_and_without_goldfish(tmp_path, cache_dir):
    data = prepare_data(load_run_config(_cfg(tmp_path)))
    assert data.is_chat and len(data.prompts) == len(data.responses) == len(data.train)
    rows = data.train
    for i, (prompt, response) in enumerate(zip(data.prompts, data.responses)):
        assert rows.input_ids[i, :len(prompt)].tolist() == prompt
        assert (rows.labels[i, :len(prompt)] == IGNORE_INDEX).all()  # prompt tokens never supervised
        supervised = rows.labels[i][rows.labels[i] != IGNORE_INDEX].tolist()
        assert supervised[:len(response)] == response  # the response is (the start of) what is trained
    gold = GoldfishTransform(GoldfishConfig(enabled=True, strategy="static", k=2))
    masked = gold(rows[torch.arange(len(rows))])
    dropped = (masked == IGNORE_INDEX) & (rows.labels != IGNORE_INDEX)
    assert dropped.any()
    assert not ((masked != IGNORE_INDEX) & (rows.labels == IGNORE_INDEX)).any()  # adds drops only


def test_train_and_extract_on_chat_data(tmp_path, cache_dir):
    out = tmp_path / "out"
    assert main(["train", str(_cfg(tmp_path)), "--out", str(out)]) == 0
    data = prepare_data(load_run_config(_cfg(tmp_path)))
    lines = [json.loads(x) for x in (out / "extraction.jsonl").read_text().splitlines()]
    assert [r["prefix_ids"] for r in lines] == data.prompts
    assert [r["target_ids"] for r in lines] == data.responses
    assert all(len(r["generated_ids"]) == len(r["target_ids"]) for r in lines)
    summary = json.loads((out / "run.json").read_text())["summary"]
    assert summary["docs"] == len(data.prompts)
    # beyond greedy: each response's p_z from its own prompt, a row per conversation in sampled.jsonl
    rows = [json.loads(x) for x in (out / "sampled.jsonl").read_text().splitlines()]
    assert [r["doc"] for r in rows] == data.member_doc_ids and {r["offset"] for r in rows} == {0}
    smp = summary["sampled"]
    assert smp["prefix"] == "prompt" and smp["offsets"]["0"]["docs"] == len(data.prompts)
    assert smp["offsets"]["0"]["exact_match_rate"] == summary["exact_match_rate"]  # teacher-forced = decoded
    assert "Each response from its whole prompt" in (out / "report.md").read_text()


def test_chat_offsets_beyond_the_prompt_are_refused(tmp_path, cache_dir, capsys):
    out = tmp_path / "out"
    assert main(["train", str(_cfg(tmp_path)), "--out", str(out), "eval.offsets=[0,8]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: eval.offsets=[0, 8]: chat data"), err
    assert not out.exists()


def test_membership_on_chat_data_scores_answers_given_their_prompts(tmp_path, cache_dir):
    """eval.mia on a chat fine-tune: trained conversations vs a held-out split, each scored on its answer
    given its prompt (minus the mean NLL of the answer's tokens; the whole row would differ), the blind
    baseline on the same answers."""
    from transformers import AutoModelForCausalLM

    from evals import sequence_logprobs

    out = tmp_path / "out"
    over = ["eval.mia=true", "data.held_out_fraction=0.5", "eval.bootstrap=20"]
    assert main(["train", str(_cfg(tmp_path)), "--out", str(out), *over]) == 0
    data = prepare_data(load_run_config(_cfg(tmp_path), over))
    rows = [json.loads(x) for x in (out / "mia.jsonl").read_text().splitlines()]
    members = [r for r in rows if r["member"]]
    held = [r for r in rows if not r["member"]]
    assert [r["id"] for r in members] == data.member_doc_ids and len(held) == len(data.held_out_docs) > 1
    model = AutoModelForCausalLM.from_pretrained(out / "model").eval()
    for side, seqs, starts in ((members, data.member_docs, data.member_starts),
                               (held, data.held_out_docs, data.held_out_starts)):
        for r, ids, s in zip(side, seqs, starts):
            assert 1 <= s < len(ids)
            lp = sequence_logprobs(model, torch.tensor([ids]))[0].double()
            assert r["loss"] == pytest.approx(lp[s - 1:].mean().item(), abs=1e-5)
            assert r["loss"] != pytest.approx(lp.mean().item(), abs=1e-5)
    summary = json.loads((out / "run.json").read_text())["summary"]
    assert summary["mia"]["scored"].startswith("each conversation's answer given its prompt")
    assert "Scored: each conversation's answer given its prompt" in (out / "report.md").read_text()


def test_near_verbatim_on_chat_data_searches_each_response_from_its_prompt(tmp_path, cache_dir):
    out = tmp_path / "out"
    over = ["eval.near_verbatim=1", "eval.nv_beams=2"]
    assert main(["train", str(_cfg(tmp_path)), "--out", str(out), *over]) == 0
    data = prepare_data(load_run_config(_cfg(tmp_path), over))
    rows = [json.loads(x) for x in (out / "near_verbatim.jsonl").read_text().splitlines()]
    lines = (out / "sampled.jsonl").read_text().splitlines()
    sampled = {r["doc"]: r["logpz"] for r in map(json.loads, lines)}
    assert [r["doc"] for r in rows] == data.member_doc_ids
    for r, response in zip(rows, data.responses):
        assert r["suffix"] == data.tokenizer.decode(response)
        for scheme, bound in r["bound"].items():  # d = 0 is the verbatim p_z (KV-cache search vs one forward)
            want = sampled[r["doc"]][scheme]
            assert bound[0] == (None if want is None else pytest.approx(want, rel=1e-6))
    assert json.loads((out / "run.json").read_text())["summary"]["near_verbatim"]["prefix"] == "prompt"
