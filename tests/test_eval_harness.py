"""The lm-eval adapter (evals/harness.py ScorerLM) answers every request type as lm-eval's own Hugging
Face backend does on the same model, tokenizer and task; sharded it equals serial; bad task requests
are one line from `memorize eval`.

Tolerances: log-likelihoods within 1e-4 absolute + 1e-5 relative of the HF backend (it scores one
request per forward, we pad a batch: float32 sums in another order); accuracies and greedy flags equal.
"""
from __future__ import annotations

import hashlib
import json
import random

import numpy as np
import pytest
import torch
from lm_eval import simple_evaluate
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from transformers import LlamaConfig, LlamaForCausalLM

from data_pipelines.downstream import BUNDLED_TASKS, TASK_DIR, dataset_fingerprint
from data_pipelines.tokenizer import load_tokenizer
from evals.harness import ScorerLM, run_tasks, task_manager
from memorization.cli import main

VOCAB = 50258  # GPT-2's 50,257 ids, padded to an even size so Y=2 splits the vocabulary


def tiny(seed: int = 0) -> LlamaForCausalLM:
    """A seeded 2-layer Llama (4 heads, 2 KV heads) over GPT-2's ids, weights wide enough to be peaked."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      initializer_range=0.2, bos_token_id=50256, eos_token_id=50256)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer("gpt2", cache_dir=tmp_path_factory.mktemp("cache"))


LONG = " ".join(["the old museum wing"] * 30)  # ~120 tokens: cut from the left at max_length 64
PAIRS = [("Athens is to Greece as Baghdad is to", " Iraq"), ("Athens is to Greece as Baghdad is to", " Peru"),
         ("Review: a gorgeous film\nSentiment:", " positive"), ("", "Hello world"),
         ("The cat ", "sat on the mat"), (LONG, " and the new one"), ("a", " b c d e f g")]


def requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def test_loglikelihood_rolling_and_generation_equal_the_hf_backend(tok):
    model = tiny()
    hf = HFLM(pretrained=model, tokenizer=tok, batch_size=1, max_length=64)
    ours = ScorerLM(model, tok, batch_size=3, max_length=64)
    want = hf.loglikelihood(requests("loglikelihood", PAIRS), disable_tqdm=True)
    got = ours.loglikelihood(requests("loglikelihood", PAIRS), disable_tqdm=True)
    np.testing.assert_allclose([g for g, _ in got], [w for w, _ in want], rtol=1e-5, atol=1e-4)
    assert [g for _, g in got] == [w for _, w in want]
    # a continuation the model produces greedily is flagged greedy (the flag is not always False)
    first = ours.generate_until(requests("generate_until", [("The cat", {"until": [], "max_gen_toks": 3})]))
    assert ours.loglikelihood(requests("loglikelihood", [("The cat", first[0])]), disable_tqdm=True)[0][1]

    docs = [("The quick brown fox jumps over the lazy dog. " * 4,), ("Short text.",)]
    hf16, ours16 = HFLM(pretrained=model, tokenizer=tok, batch_size=1, max_length=16), \
        ScorerLM(model, tok, batch_size=4, max_length=16)  # several rolling windows per document
    np.testing.assert_allclose(ours16.loglikelihood_rolling(requests("loglikelihood_rolling", docs), True),
                               hf16.loglikelihood_rolling(requests("loglikelihood_rolling", docs), True),
                               rtol=1e-5, atol=1e-4)

    gens = [("The capital of France is", {"until": ["."], "max_gen_toks": 8}),
            ("Question: 2+2=?\nAnswer:", {"until": ["\n", "the"], "max_gen_toks": 6}),
            ("Once", {"until": ["."], "max_gen_toks": 5})]
    assert ours.generate_until(requests("generate_until", gens), True) == \
        hf.generate_until(requests("generate_until", gens), True)


def test_bundled_task_metrics_equal_the_hf_backend(tok):
    model = tiny(1)
    manager = task_manager(str(TASK_DIR), defaults=False)
    common = {"task_manager": manager, "log_samples": False, "bootstrap_iters": 1000}
    for task, shots, limit in (("analogies_family", None, 12), ("polarity", 2, 8)):
        want = simple_evaluate(model=HFLM(pretrained=model, tokenizer=tok, batch_size=1), tasks=[task],
                               num_fewshot=shots, limit=limit, **common)["results"][task]
        got = run_tasks(model, tok, [task], num_fewshot=shots, limit=limit, manager=manager)
        row = got["tasks"][task]
        assert row["n"] == limit and got["n_shot"][task] == (shots or 0)
        assert row["acc"] == want["acc,none"] and row["acc_norm"] == want["acc_norm,none"], task
        assert row["acc_stderr"] == pytest.approx(want["acc_stderr,none"])


def test_run_tasks_leaves_the_global_generators_alone(tok):
    model = tiny()  # (seeds torch itself)
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    want = random.random(), np.random.rand(), torch.rand(1).item()
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    run_tasks(model, tok, ["analogies_family"], limit=2, manager=task_manager(str(TASK_DIR), defaults=False))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == want


def _sharded(rank, world, dims, mode, tok):
    import axonn

    grid = axonn.init(*dims)
    model = axonn.parallelize(tiny(), grid, mode=mode)
    lm = ScorerLM(model, tok, batch_size=2, max_length=64, grid=grid)
    ll = lm.loglikelihood(requests("loglikelihood", PAIRS), disable_tqdm=True)
    gen = lm.generate_until(requests("generate_until", [("The capital of France is",
                                                          {"until": ["."], "max_gen_toks": 6})]), True)
    res = run_tasks(model, tok, ["analogies_family"], limit=5, grid=grid,
                    manager=task_manager(str(TASK_DIR), defaults=False))
    return {"ll": [list(x) for x in ll], "gen": gen, "acc": res["tasks"]["analogies_family"]["acc"]}


@pytest.mark.distributed
@pytest.mark.parametrize("dims,mode", [((1, 2, 1, 1), "paired"), ((1, 1, 2, 1), "easy"),
                                       ((1, 1, 1, 2), "easy")])
def test_sharded_adapter_equals_serial(tok, dims, mode):
    from axonn.spawn import run_distributed

    lm = ScorerLM(tiny(), tok, batch_size=2, max_length=64)
    want_ll = lm.loglikelihood(requests("loglikelihood", PAIRS), disable_tqdm=True)
    want_gen = lm.generate_until(requests("generate_until", [("The capital of France is",
                                                               {"until": ["."], "max_gen_toks": 6})]), True)
    manager = task_manager(str(TASK_DIR), defaults=False)
    want = run_tasks(tiny(), tok, ["analogies_family"], limit=5, manager=manager)
    want_acc = want["tasks"]["analogies_family"]["acc"]
    for r in run_distributed(_sharded, 2, dims, mode, tok, timeout=300):  # every rank: the same answers
        np.testing.assert_allclose([v for v, _ in r["ll"]], [v for v, _ in want_ll], rtol=1e-5, atol=1e-5)
        assert [g for _, g in r["ll"]] == [g for _, g in want_ll]
        assert r["gen"] == want_gen and r["acc"] == want_acc


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok):
    d = tmp_path_factory.mktemp("model")
    tiny().save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_memorize_eval_tasks_writes_the_tasks_section(model_dir, tmp_path, capsys):
    out = tmp_path / "ev"
    assert main(["eval", "--model", str(model_dir), "--tasks", "analogies_family,polarity", "--limit", "4",
                 "--num-fewshot", "1", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    tasks = report["tasks"]
    assert set(tasks["tasks"]) == {"analogies_family", "polarity"}
    # analogies are zero-shot by construction (their YAML fixes 0: shots would leak word pairs)
    assert tasks["n_shot"] == {"analogies_family": 0, "polarity": 1}
    for row in tasks["tasks"].values():
        assert row["n"] == 4 and 0 <= row["acc"] <= 1 and row["acc_stderr"] >= 0
    md = (out / "report.md").read_text()
    assert "downstream tasks (lm-evaluation-harness)" in md and "| polarity | 4 | 1 |" in md


@pytest.mark.parametrize("args,field", [
    (["--tasks", "no_such_task"], "--tasks='no_such_task'"),
    (["--tasks", ","], "--tasks"),
    (["--tasks", "polarity", "--num-fewshot", "-1"], "--num-fewshot=-1"),
    (["--tasks", "polarity", "--limit", "-1"], "--limit=-1"),
    (["--corpus", "wiki-leads", "--num-fewshot", "2"], "--num-fewshot=2"),
])
def test_bad_task_requests_are_one_line_and_write_nothing(model_dir, tmp_path, capsys, args, field):
    out = tmp_path / "ev"
    assert main(["eval", "--model", str(model_dir), "--out", str(out), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and field in err, err
    if args[1] == "no_such_task":  # the bundled names and the hub hint
        assert all(name in err for name in BUNDLED_TASKS) and "network" in err
    assert not out.exists()


def _task_state() -> dict[str, str]:
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(TASK_DIR.iterdir())
             if p.is_file()}
    return {**files, **{t: dataset_fingerprint(t) for t in BUNDLED_TASKS if t != "analogies"}}


def test_a_fine_tune_step_does_not_change_the_bundled_tasks(tmp_path, monkeypatch):
    from helpers import tiny_base_yaml

    before = _task_state()
    cfg = tmp_path / "base.yaml"
    cfg.write_text(tiny_base_yaml(max_steps=1))
    monkeypatch.setenv("MEMORIZE_CACHE", str(tmp_path / "cache"))
    assert main(["train", str(cfg), "--out", str(tmp_path / "run")]) == 0
    assert _task_state() == before
