"""Bad grids fail with a one-line ConfigError on every rank, before any collective, without hanging."""
from __future__ import annotations

import pytest

from axonn.spawn import run_ranks


def _catch(fn) -> str | None:
    import axonn

    try:
        fn()
    except axonn.ConfigError as e:
        return str(e)
    return None


def _llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
              num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=32)
    kw.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**kw))


def _bad_grids(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    import axonn

    msgs = {
        # before torch.distributed is initialised: only the environment is read
        "product": _catch(lambda: axonn.init(x=3)),
        "data": _catch(lambda: axonn.init(x=1, data=3)),
        "zero": _catch(lambda: axonn.init(x=0)),
        "fields": _catch(lambda: axonn.parse_grid("2,1,1")),
        "nonint": _catch(lambda: axonn.parse_grid("2,a,1,1")),
    }
    msgs["initialised_before_good_init"] = dist.is_initialized()
    grid = axonn.init(x=1, y=2)  # a good grid: torchrun-style env -> gloo
    msgs["product_after_init"] = _catch(lambda: axonn.init(x=2, y=2))
    msgs["vocab"] = _catch(lambda: axonn.parallelize(_llama(vocab_size=129), grid))
    msgs["heads"] = _catch(lambda: axonn.parallelize(_llama(hidden_size=48, num_attention_heads=3,
                                                            num_key_value_heads=3), grid, mode="paired"))
    msgs["kv_heads"] = _catch(lambda: axonn.parallelize(_llama(num_key_value_heads=1), grid, mode="paired"))
    msgs["mode"] = _catch(lambda: axonn.parallelize(_llama(), grid, mode="fast"))
    gx = axonn.ProcessGrid(2, 1, 1, 1)
    msgs["ffn"] = _catch(lambda: axonn.parallelize(_llama(intermediate_size=129), gx))
    msgs["batch"] = _catch(lambda: axonn.shard_batch(torch.zeros(3, 4), axonn.ProcessGrid(1, 1, 2, 1)))
    # after all those errors the ranks are still in step: a collective completes
    t = torch.ones(1)
    dist.all_reduce(t)
    msgs["after"] = t.item()
    return msgs


@pytest.mark.distributed
def test_bad_grids_fail_everywhere_with_one_line() -> None:
    results = run_ranks(_bad_grids, 2, init=False, timeout=120)
    assert all(r.ok for r in results), [r.traceback for r in results if not r.ok]
    per_rank = [r.value for r in results]
    assert per_rank[0]["initialised_before_good_init"] is False
    assert per_rank[0]["after"] == 2.0
    expect = {"product": "grid=", "data": "grid=", "zero": "grid.x=0", "fields": "grid=",
              "nonint": "grid.y='a'", "product_after_init": "grid=", "vocab": "grid.y=2",
              "heads": "grid.y=2", "kv_heads": "grid.y=2", "mode": "mode='fast'", "ffn": "grid.x=2",
              "batch": "batch_size=3"}
    for key, start in expect.items():
        msg = per_rank[0][key]
        assert msg is not None, f"{key}: no ConfigError"
        assert msg.startswith(start), f"{key}: {msg}"
        assert "\n" not in msg, f"{key}: not one line: {msg!r}"
        assert all(v[key] == msg for v in per_rank), f"{key}: ranks disagree"
    assert "vocab_size=129" in per_rank[0]["vocab"]
    assert "num_attention_heads=3" in per_rank[0]["heads"]
    assert "num_key_value_heads=1" in per_rank[0]["kv_heads"]
    assert "intermediate_size=129" in per_rank[0]["ffn"]


def _uncaught(rank: int, world: int) -> None:
    import axonn

    axonn.init(x=2, y=2, z=1, data=1)  # 4 != 2 ranks


@pytest.mark.distributed
def test_uncaught_error_reaches_every_rank_without_hang() -> None:
    results = run_ranks(_uncaught, 2, init=False, timeout=60)
    assert [r.error_type for r in results] == ["ConfigError", "ConfigError"]
    assert all("world size is 2" in r.error and "\n" not in r.error for r in results)


def test_parse_and_validate_without_collectives() -> None:
    from transformers import LlamaConfig

    import axonn

    assert axonn.parse_grid("2,2,1,2") == (2, 2, 1, 2)
    assert axonn.parse_grid(" 1, 8,1 ,1") == (1, 8, 1, 1)
    for bad, start in [("2,2,1", "grid="), ("2,2,1,2,1", "grid="), ("2,x,1,1", "grid.y="),
                       ("2,0,1,1", "grid.y=0"), ("", "grid=")]:
        with pytest.raises(axonn.ConfigError, match="^" + start.replace(".", r"\.")):
            axonn.parse_grid(bad)
    cfg = LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=96, num_attention_heads=8,
                      num_key_value_heads=2)
    axonn.validate_grid_for_model((2, 2, 4, 1), cfg)            # easy: kv_size 12 splits over y=2
    axonn.validate_grid_for_model((2, 2, 3, 5), cfg, "paired")  # z and data never constrain
    with pytest.raises(axonn.ConfigError, match=r"grid\.y=4.*num_key_value_heads=2"):
        axonn.validate_grid_for_model((1, 4, 1, 1), cfg, "paired")
    with pytest.raises(axonn.ConfigError, match=r"grid\.x=5.*hidden_size=48"):
        axonn.validate_grid_for_model((5, 1, 1, 1), cfg)
    with pytest.raises(axonn.ConfigError, match=r"grid\.y=64.*vocab_size=96"):
        axonn.validate_grid_for_model((1, 64, 1, 1), LlamaConfig(vocab_size=96, hidden_size=64,
                                                                intermediate_size=64, num_attention_heads=1,
                                                                head_dim=64))
    with pytest.raises(axonn.ConfigError, match=r"^grid="):
        axonn.validate_grid_for_model((1, 1), cfg)



def _many_grids(rank: int, world: int) -> dict:
    import os

    import torch

    import axonn

    counts, sums = [], []
    for dims in [(1, 2, 1, 1), (2, 1, 1, 1), (1, 1, 2, 1)] * 3:
        grid = axonn.ProcessGrid(*dims)
        for group in ("x", "y", "z"):
            t = torch.ones(3) * (rank + 1)
            grid.comm.all_reduce(t, group)
            sums.append(t.tolist() if grid.size(group) > 1 else None)
        counts.append(len(os.listdir("/proc/self/task")))
    return {"counts": counts, "sums": [s for s in sums if s is not None]}


def test_grids_built_one_after_another_reuse_their_process_groups():
    import os

    if not os.path.isdir("/proc/self/task"):
        pytest.skip("needs /proc to count threads")
    for r in run_ranks(_many_grids, 2):
        assert r.ok, r.traceback
        v = r.value
        assert len(v["sums"]) == 9 and all(s == [3.0, 3.0, 3.0] for s in v["sums"])
        # the second and third rounds of the same three grids add no backend threads
        assert v["counts"][-1] == v["counts"][2], v["counts"]
