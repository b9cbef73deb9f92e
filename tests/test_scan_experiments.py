"""The experiments' optional training-set scan (`scan_corpus: true`): after each scored pass the record
holds the fraction of every training window extractable, equal to scoring those windows directly."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from data_pipelines.scan_windows import Selection, windows
from data_pipelines.token_sources import in_memory
from evals.scan import score_windows
from memorization.config import load_run_config
from memorization.experiments import load_experiment
from memorization.experiments.corpus_scan import scan_training_set
from memorization.experiments.passes import train_with_passes
from memorization.models import REPO_ROOT
from memorization.train.prepare import prepare_data
from memorize_core import ConfigError

MICRO = [
    "data.limit=6", "data.vocab_size=300", "data.block_len=32", "data.min_tokens=16", "data.held_out_limit=4",
    "model.overrides={hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, "
    "num_attention_heads: 2, num_key_value_heads: 2}",
    "eval.prefix=4", "eval.suffix=4", "trainer.batch_size=2", "trainer.epochs=2", "trainer.warmup_steps=1",
    "trainer.progress=false", "wandb.mode=disabled",
]


@pytest.mark.slow  # trains a micro model for 2 passes: ~25 s on 2 shared cores
def test_pass_records_carry_the_training_set_scan(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMORIZE_CACHE", str(tmp_path / "cache"))
    cfg = load_run_config(REPO_ROOT / "configs" / "train" / "tiny-wiki.yaml", MICRO)
    data = prepare_data(cfg)
    summary = train_with_passes(cfg, tmp_path / "run", data, scan_stride=3)
    recs = summary["passes"]
    assert [r["pass"] for r in recs] == [1, 2]
    want = sum(len(range(0, len(d) - 8 + 1, 3)) for d in data.train_docs if len(d) >= 8)
    assert all(r["scan_windows"] == want > len(data.train_docs) for r in recs)
    assert all(0 <= r["scan_exact_match_rate"] <= 1 and 0 <= r["scan_lead_mean"] <= 4 for r in recs)


def test_scan_training_set_equals_scoring_the_windows(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2, initializer_range=0.5))
    docs = [np.random.default_rng(i).integers(0, 50, size=20 + i).tolist() for i in range(5)]
    got = scan_training_set(m, docs, prefix=3, suffix=2, stride=0, batch_size=4)
    ws = [w.tokens for w in windows(in_memory("d", docs), Selection(3, 2, offsets="stride:5"))]
    lead = score_windows(m, torch.from_numpy(np.stack(ws)), 3)["lead"]
    assert got["scan_windows"] == len(ws) and got["scan_exact_match_rate"] == float((lead == 2).mean())


def test_the_option_is_an_experiment_key():
    path = REPO_ROOT / "configs" / "experiments" / "catastrophic-memorization.yaml"
    _, exp = load_experiment(path, ["scan_corpus=true", "scan_stride=16"])
    assert exp.scan_corpus and exp.scan_stride == 16
    with pytest.raises(ConfigError, match="scan_stride"):
        load_experiment(path, ["scan_corpus=true", "scan_stride=-1"])
    assert replace(exp, scan_corpus=False).scan_corpus is False
