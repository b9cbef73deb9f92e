"""Paired blocks pick their orientation: heads over the larger of X and Y when it divides them."""
import pytest

from axonn.grid import model_dims, validate_grid_for_model
from axonn.pairing import layer_axes, pair_axes
from memorize_core import ConfigError

LLAMA = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "vocab_size": 128, "tie_word_embeddings": True}


class _Cfg:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _sizes(**over):
    return model_dims(_Cfg(**{**LLAMA, **over}))


@pytest.mark.parametrize("x,y,over,want", [
    (2, 1, {}, ("y", "x")),                          # Megatron over X
    (4, 2, {"num_attention_heads": 8, "num_key_value_heads": 4}, ("y", "x")),
    (1, 2, {}, ("x", "y")),                          # already heads over the larger axis
    (2, 2, {}, ("x", "y")),                          # ties keep the paper's orientation
    (4, 1, {}, ("x", "y")),                          # X = 4 cannot split 2 KV heads
    (2, 1, {"intermediate_size": 129}, ("x", "y")),  # nor an odd FFN width
])
def test_orientation_rule(x, y, over, want):
    assert pair_axes(x, y, _sizes(**over)) == want
    assert layer_axes("column", want) == want and layer_axes("row", want) == want[::-1]
    assert layer_axes("easy", want) == ("x", "y") == layer_axes("head", want)


def test_without_model_sizes_nothing_flips():
    assert pair_axes(2, 1) == ("x", "y")


def test_a_grid_that_cannot_flip_stays_valid():
    # X = 4 does not divide the 2 KV heads: the pair keeps heads over Y = 1 (valid before the flip
    # existed, so it must stay valid), and the error for a Y that cannot split them still names Y
    validate_grid_for_model((4, 1, 1, 1), _Cfg(**LLAMA), mode="paired")
    with pytest.raises(ConfigError, match=r"grid\.y=4: must divide num_key_value_heads=2"):
        validate_grid_for_model((1, 4, 1, 1), _Cfg(**LLAMA), mode="paired")


def _flipped_forward(rank, world):
    import torch
    import transformers as tf

    import axonn

    torch.manual_seed(0)
    serial = tf.LlamaForCausalLM(tf.LlamaConfig(**LLAMA)).float()
    ids = torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(1))
    want = serial(input_ids=ids).logits
    grid = axonn.ProcessGrid(2, 1, 1, 1)
    torch.manual_seed(0)
    model = axonn.parallelize(tf.LlamaForCausalLM(tf.LlamaConfig(**LLAMA)).float(), grid, mode="paired")
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    layout = {n: (m.in_axis, m.out_axis, tuple(m.weight.shape)) for n, m in
              (("q", attn.q_proj), ("k", attn.k_proj), ("o", attn.o_proj), ("up", mlp.up_proj),
               ("down", mlp.down_proj))}
    grid.stats.reset()
    got = model(input_ids=ids).logits
    fwd = grid.stats.snapshot()
    return {"pair": axonn.engine_of(model).pair_axes, "layout": layout, "fwd": fwd,
            "err": float((got - want).abs().max())}


@pytest.mark.distributed
def test_x_only_grid_runs_megatron_split():
    from axonn.spawn import run_distributed

    out = run_distributed(_flipped_forward, 2)[0]
    assert out["pair"] == ("y", "x")
    # q/k/up: whole input, half the heads / FFN rows; o/down: half the input columns, whole output
    assert out["layout"] == {"q": ("y", "x", (32, 64)), "k": ("y", "x", (16, 64)),
                             "o": ("x", "y", (64, 32)), "up": ("y", "x", (64, 64)),
                             "down": ("x", "y", (64, 64))}
    # forward: one all-reduce over X after o_proj and one after down_proj per block, one for the LM
    # head's partial logits; the only all-gather is the embedding's (X splits its columns)
    assert out["fwd"]["x"]["all_reduce"]["calls"] == 2 * LLAMA["num_hidden_layers"] + 1
    assert out["fwd"]["x"]["all_gather"]["calls"] == 1
    assert out["err"] < 1e-5
