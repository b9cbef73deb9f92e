"""Planner search: grid enumeration (hand-counted), divisibility of every answer, the one chooser."""
import pytest

from axonn.plan import Train, choose_grid, get_hardware, load_shape, plan
from axonn.plan.search import factorizations, valid_grids
from axonn.plan.volumes import Grid
from memorize_core import ConfigError


def test_factorizations_of_4_and_12():
    # 4 = 2^2 into 4 ordered factors: C(2+3, 3) = 10; 12 = 2^2 * 3: 10 * C(1+3, 3) = 40.
    assert len(factorizations(4)) == 10
    assert len(factorizations(12)) == 40
    assert all(g.size == 12 for g in factorizations(12))


def test_enumeration_counts_by_hand():
    tiny = load_shape("tiny")  # hidden 256, 4 heads / 4 kv, ffn 688, vocab 4096: no X/Y limit at 4
    # batch 3: data must divide 3 -> data = 1; z <= 3 rows -> z in {1, 2}.
    # z = 1: (x, y) in {(1,4), (2,2), (4,1)}; z = 2: {(1,2), (2,1)} -> 5 grids.
    assert len(valid_grids(tiny, 4, 3)) == 5
    # strict: z*data must divide 3 -> only z = 1 -> 3 grids.
    assert sorted((g.x, g.y) for g in valid_grids(tiny, 4, 3, strict=True)) == [(1, 4), (2, 2), (4, 1)]
    # batch 2: (z, data) in {(1,1), (2,1), (1,2)} -> 3 + 2 + 2 = 7, strict or not.
    assert len(valid_grids(tiny, 4, 2)) == 7
    assert len(valid_grids(tiny, 4, 2, strict=True)) == 7


def test_every_answer_multiplies_out_and_divides():
    shape = load_shape("llama-8b")
    rows = plan(shape, 64, 8, 2048, 128, "h100", include_unfit=True)
    assert rows
    for r in rows:
        assert r.x * r.y * r.z * r.data == 64
        assert shape.hidden % r.x == 0
        assert shape.heads % r.y == 0 and shape.kv_heads % r.y == 0
        assert shape.ffn % r.y == 0 and shape.vocab % r.y == 0
        assert 128 % r.data == 0 and 128 // r.data >= r.z
        per_rank = -(-(128 // r.data) // r.z)
        assert per_rank % r.micro_batch == 0
    fits = [r for r in rows if r.fits]
    assert [r.time_s for r in fits] == sorted(r.time_s for r in fits)


def test_easy_mode_needs_x_to_divide_ffn():
    shape = load_shape("tiny")  # ffn 688 = 16 * 43
    grids = valid_grids(shape, 32, 32, mode="easy")
    assert all(688 % g.x == 0 and 256 % g.y == 0 for g in grids)
    assert Grid(32, 1, 1, 1) in valid_grids(shape, 32, 32, mode="paired")
    assert Grid(32, 1, 1, 1) not in grids


@pytest.mark.parametrize("world", [1, 2, 8])
def test_the_chooser_small_worlds(world):
    hw = get_hardware("h100")
    g = choose_grid(load_shape("tiny"), world, 8, hw, Train(seq=128, batch=8)).grid
    assert len(g) == 4 and g[0] * g[1] * g[2] * g[3] == world
    assert 8 % (g[2] * g[3]) == 0  # training is strict: the engine shards the batch evenly
    assert choose_grid(load_shape("tiny"), 1, 8, hw, Train(seq=128, batch=8)).grid == (1, 1, 1, 1)


def test_the_chooser_accepts_an_hf_config_dict():
    cfg = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8,
           "num_key_value_heads": 8, "intermediate_size": 128, "vocab_size": 128}
    g = choose_grid(load_shape(cfg), 8, 8, get_hardware("h100"), Train(seq=16, batch=8)).grid
    assert g[0] * g[1] * g[2] * g[3] == 8


def test_paper_example_has_only_uneven_grids():
    # 6144 = 2^11 * 3: with hidden 2^14, <= 8 KV heads and batch 2^10 the factor 3 must go to Z.
    rows = plan("llama-405b", 6144, 4, 4096, 1024, "alps-h100")
    assert rows and all(r.z % 3 == 0 and not r.even_batch for r in rows)
    with pytest.raises(ConfigError, match="gpus=6144"):
        plan("llama-405b", 6144, 4, 4096, 1024, "alps-h100", strict=True)


def test_nothing_fits_and_bad_sizes():
    with pytest.raises(ConfigError, match="no configuration of llama-405b fits"):
        plan("llama-405b", 8, 8, 4096, 8, "h100")
    with pytest.raises(ConfigError, match="gpus=6"):
        plan("tiny", 6, 4, 128, 8, "h100")
    with pytest.raises(ConfigError, match="seq"):
        plan("tiny", 2, 8, 0, 8, "h100")
    with pytest.raises(ConfigError, match="hardware='nope'"):
        plan("tiny", 2, 8, 128, 8, "nope")
    with pytest.raises(ConfigError, match="unknown model; choose one of"):
        plan("llama-9000b", 2, 8, 128, 8, "h100")


def test_overlap_only_helps_and_checkpointing_saves_memory():
    on = {r.grid: r for r in plan("llama-8b", 16, 8, 2048, 32, "h100", checkpoint=False)}
    off = {r.grid: r for r in plan("llama-8b", 16, 8, 2048, 32, "h100", checkpoint=False,
                                   overlap=False)}
    for g in on.keys() & off.keys():
        a, b = on[g], off[g]
        if a.micro_batch == b.micro_batch:
            assert a.time_s <= b.time_s + 1e-12
            assert b.exposed_comm_s == pytest.approx(b.comm_s)
        assert 0 <= a.exposed_comm_s <= a.comm_s + 1e-12
    ck = {r.grid: r for r in plan("llama-8b", 16, 8, 2048, 32, "h100", checkpoint=True,
                                  micro_batch=1)}
    nock = {r.grid: r for r in plan("llama-8b", 16, 8, 2048, 32, "h100", checkpoint=False,
                                    micro_batch=1, include_unfit=True)}
    for g in ck.keys() & nock.keys():
        assert ck[g].memory_gb < nock[g].memory_gb
        assert ck[g].compute_s > nock[g].compute_s  # the forward runs twice
