"""Training and teacher-forced scoring never build a KV cache, and per-block compile makes one graph per
block class, not one per layer.

Transformers builds a DynamicCache in every forward of a model whose config says `use_cache` unless the
caller passes `use_cache=False`: memory and time for nothing in a training or scoring forward, and
under per-block compile a guard on the cache's per-layer state that recompiles each block per layer
index until Dynamo's recompile limit sends the rest back to eager."""
from __future__ import annotations

import logging

import pytest
import torch
from helpers import Rows, tiny_model
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import Cache

from axonn.compile import compile_blocks
from axonn.config import TrainerConfig
from axonn.grid import ProcessGrid
from axonn.lm_head import LossHead
from axonn.trainer import Trainer


@pytest.fixture
def caches(monkeypatch):
    """How many KV caches of any kind were built (a list that grows by one per cache: transformers'
    DynamicCache, evals' preallocated one, ...)."""
    made: list[int] = []
    init = Cache.__init__

    def counting(self, *a, **k):
        made.append(1)
        init(self, *a, **k)

    monkeypatch.setattr(Cache, "__init__", counting)
    return made


def _rows(n: int = 8, t: int = 24, vocab: int = 64) -> Rows:
    g = torch.Generator().manual_seed(0)
    return Rows(torch.randint(0, vocab, (n, t), generator=g))


@pytest.mark.parametrize("loss_chunk", ["off", 16])
def test_a_training_step_builds_no_cache(caches, loss_chunk):
    model = tiny_model()
    assert model.config.use_cache  # the HF default: the caller must say no
    cfg = TrainerConfig(batch_size=4, max_steps=2, lr=1e-3, warmup_steps=0, progress=False,
                        loss_chunk=loss_chunk, compile=False)
    Trainer(model, cfg, _rows()).fit()
    assert caches == []


def test_teacher_forced_scoring_builds_no_cache_and_decoding_does(caches):
    from evals import extract, membership_inference
    from evals.scan import score_windows

    model = tiny_model().eval()
    docs = _rows(6, 24).ids.tolist()
    membership_inference(model, docs[:3], docs[3:], batch_size=4, bootstrap=0)
    from evals.sampling import parse_schemes

    score_windows(model, torch.tensor(docs), 12, schemes=parse_schemes("t=0.7,top_k=8;top_p=0.9"))
    assert caches == []  # every teacher-forced forward said use_cache=False
    extract(model, docs[:2], prefix_len=8, suffix_len=4, batch_size=2)
    assert caches  # greedy decoding keeps a cache, as it should: the counter sees one


def test_per_block_compile_makes_one_graph_per_block_class(caplog):
    """16 layers through the trainer's loss forward: one Dynamo graph for the block class, no
    recompile-limit warning (with a KV cache in the forward, each layer index recompiled)."""
    torch._dynamo.reset()
    graphs: list[int] = []

    def backend(gm, example_inputs):  # needs no code generator: runs the traced graph as it is
        graphs.append(1)
        return gm.forward

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=16, num_attention_heads=4,
                                         num_key_value_heads=4, max_position_embeddings=64))
    assert compile_blocks(model, True, torch.device("cpu"), backend=backend) == 16
    head = LossHead(model, ProcessGrid.serial(device="cpu"), "off")
    ids = _rows(4, 24).ids
    with caplog.at_level(logging.WARNING, logger="torch._dynamo"):
        for _ in range(2):
            head.forward(ids).float().sum().backward()
    torch._dynamo.reset()
    assert 1 <= len(graphs) <= 2, f"{len(graphs)} graphs for 16 blocks of one class"
    assert "recompile" not in caplog.text.lower(), caplog.text[-2000:]
