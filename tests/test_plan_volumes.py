"""collective_volumes: hand-checked bytes, and (distributed) equality with the engine's counters."""
import pytest

from axonn.plan import collective_volumes
from axonn.plan.shapes import ModelShape, shape_from_config
from axonn.plan.volumes import collective_counts
from memorize_core import ConfigError

TINY = ModelShape("t", hidden=8, layers=1, heads=2, kv_heads=2, ffn=16, vocab=32, tied=False)


def test_x_only_paired_by_hand():
    # X = 2 > Y = 1 and X divides the heads: the pair flips (column input over Y, output -- the
    # heads -- over X), Megatron's split.  T = 4 tokens; column q,k,v,gate,up: nothing forward
    # (the input is not split), bwd all-reduce of dX T*in over X (5 * 32 = 160); row o, down: fwd
    # all-reduce of the partial sums T*out over X (32 + 32), nothing backward; head: fwd all-reduce
    # T*V = 128, bwd all-gather 32; embedding: all-gather 32. bf16: x2 bytes.
    v = collective_volumes(TINY, 4, 1, 2, 1, 1, 1)
    assert v == {("all_reduce", "x"): 2 * (160 + 64 + 128), ("all_gather", "x"): 2 * (32 + 32)}


def test_x_only_paired_unflipped_by_hand():
    # one head: X = 2 cannot split it, so the pair keeps (X in, Y out).  Column q,k,v,gate,up: fwd
    # all-reduce T*out over X (32+32+32+64+64 = 224), bwd all-gather of the dX slices T*in
    # (5 * 32 = 160); row o, down: fwd all-gather T*out (2 * 32), bwd all-reduce T*in (32 + 64);
    # head: fwd all-reduce T*V = 128, bwd all-gather 32; embedding: all-gather 32.
    one_head = ModelShape("t1", hidden=8, layers=1, heads=1, kv_heads=1, ffn=16, vocab=32, tied=False)
    v = collective_volumes(one_head, 4, 1, 2, 1, 1, 1)
    assert v == {("all_reduce", "x"): 2 * (224 + 96 + 128), ("all_gather", "x"): 2 * (160 + 64 + 32 + 32)}


def test_z_only_by_hand():
    # one row per rank; blocks q,k,v,o 64, gate,up,down 128 -> 640 per layer, table 256.
    # all-gather: every Linear twice (fwd, bwd) + head twice + embedding once.
    # reduce-scatter: every Linear, head and embedding once. norms (24) over batch = Z.
    v = collective_volumes(TINY, 4, 2, 1, 1, 2, 1)
    assert v == {("all_gather", "z"): 2 * (2 * 640 + 2 * 256 + 256),
                 ("reduce_scatter", "z"): 2 * (640 + 256 + 256),
                 ("all_reduce", "batch"): 2 * 24}


def test_data_and_micro_batches():
    # data = 2: the Z-split weights (1176 - 24 norms) over data and the norms over batch, once.
    v = collective_volumes(TINY, 4, 4, 1, 1, 1, 2, dtype_bytes=4)
    assert v == {("all_reduce", "data"): 4 * 1152, ("all_reduce", "batch"): 4 * 24}
    # micro-batches repeat the per-layer traffic but not the gradient sync
    one = collective_counts(TINY, 4, 4, 2, 1, 1, 1)
    four = collective_counts(TINY, 4, 4, 2, 1, 1, 1, micro_batch=1)
    assert four[("all_reduce", "x")][0] == 4 * one[("all_reduce", "x")][0]
    assert four[("all_reduce", "x")][1] == one[("all_reduce", "x")][1]


def test_checkpointing_repeats_the_forward_collectives():
    plain = collective_counts(TINY, 4, 1, 2, 1, 1, 1)
    ck = collective_counts(TINY, 4, 1, 2, 1, 1, 1, checkpoint=True)
    # the block's forward (flipped pair, see test_x_only_paired_by_hand): the row layers'
    # all-reduce 64, once more; it has no all-gather
    assert ck[("all_reduce", "x")][1] - plain[("all_reduce", "x")][1] == 2 * 64
    assert ck[("all_gather", "x")][1] == plain[("all_gather", "x")][1]


def test_bad_grid_and_micro_batch():
    with pytest.raises(ConfigError, match="grid"):
        collective_volumes(TINY, 4, 4, 1, 4, 1, 1)  # 2 heads cannot split over y = 4
    with pytest.raises(ConfigError, match="micro_batch"):
        collective_volumes(TINY, 4, 4, 2, 1, 1, 1, micro_batch=3)


# -- against the engine -----------------------------------------------------------------------
B, S = 8, 8
CONFIGS = {
    "llama": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8,
              "num_key_value_heads": 8, "intermediate_size": 128, "vocab_size": 128,
              "tie_word_embeddings": True},
    "gpt2": {"n_embd": 64, "n_layer": 2, "n_head": 8, "vocab_size": 128, "n_positions": 64},
}


def _engine_counts(rank, world, grid_dims, mode, family):
    import torch
    import transformers as tf

    import axonn

    torch.manual_seed(0)
    if family == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**CONFIGS[family]))
    else:
        model = tf.GPT2LMHeadModel(tf.GPT2Config(**CONFIGS[family]))
    grid = axonn.ProcessGrid(*grid_dims)
    model = axonn.parallelize(model.float(), grid, mode=mode)
    ids = torch.randint(0, 128, (B, S), generator=torch.Generator().manual_seed(1))
    grid.comm.stats.reset()
    local = axonn.shard_batch(ids, grid)
    logits = model(input_ids=local).logits[:, :-1]
    loss, _ = axonn.cross_entropy(logits, local[:, 1:], grid)
    loss.backward()
    axonn.sync_gradients(model, grid)
    return grid.comm.stats.snapshot()


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("grid,mode,family", [((2, 1, 2, 1), "paired", "llama"),
                                              ((1, 2, 1, 2), "easy", "gpt2")])
def test_matches_engine_counters(grid, mode, family):
    from axonn.spawn import run_distributed

    snap = run_distributed(_engine_counts, 4, grid, mode, family)[0]
    got = {(kind, g): (v["calls"], v["bytes"]) for g, d in snap.items() for kind, v in d.items()}
    shape = shape_from_config(CONFIGS[family], family)
    want = collective_counts(shape, S, B, *grid, dtype_bytes=4, mode=mode)
    assert want == got
