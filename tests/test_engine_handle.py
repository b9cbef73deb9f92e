"""What `parallelize` leaves behind: one typed EngineHandle whose layouts cover every sharded tensor.

Run on rank 0's view of real grids (`ProcessGrid.virtual`, a meta model): no process group needed.
"""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import axonn
from axonn.grid import ProcessGrid


def _meta_llama(tied: bool) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


@pytest.mark.parametrize("dims,mode,tied", [((2, 2, 2, 1), "paired", True), ((2, 1, 1, 1), "easy", False),
                                            ((1, 2, 2, 2), "paired", False)])
def test_handle_layouts_cover_every_sharded_tensor_and_nothing_is_tagged(dims, mode, tied):
    model = _meta_llama(tied)
    params_before = {n: set(vars(p)) for n, p in model.named_parameters()}
    grid = ProcessGrid.virtual(*dims, rank=0)
    assert axonn.parallelize(model, grid, mode=mode) is model
    handle = axonn.engine_of(model)
    assert isinstance(handle, axonn.EngineHandle) and handle.grid is grid and handle.mode == mode
    assert axonn.layouts_of(model) is handle.layouts
    state = model.state_dict(keep_vars=True)
    linears = {k for k in state if k.endswith("proj.weight")}
    linears |= {"lm_head.weight", "model.embed_tokens.weight"}
    assert set(handle.layouts) == linears  # norms and rotary buffers stay replicated
    for name, spec in handle.layouts.items():
        assert tuple(state[name].shape) == spec.local_shape, name
        assert spec.grid is grid
    if tied:  # one shared shard, known under both of its names
        assert state["lm_head.weight"] is state["model.embed_tokens.weight"]
    # the engine's state is on the handle only: parameters carry no attribute they lacked before
    for n, p in model.named_parameters():
        assert set(vars(p)) <= params_before.get(n, set()), n


def test_plain_model_has_no_handle_and_no_layouts():
    model = _meta_llama(True)
    assert axonn.engine_of(model) is None and not axonn.is_parallel(model)
    assert axonn.layouts_of(model) == {}


def test_norms_take_the_model_not_its_parameters():
    model = torch.nn.Linear(3, 2)
    model(torch.ones(1, 3)).sum().backward()
    with pytest.raises(TypeError, match="take the model"):
        axonn.clip_grad_norm_(model.parameters(), 1.0)
    want = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    assert axonn.grad_norm(model) == pytest.approx(want, rel=1e-6)  # a plain model: all replicated
