"""The evaluation figures of the dry run: memory by its definition, a batch that does not fit refused
with one line naming eval.batch_size and the largest that fits; eval.mia's config refusals."""
from __future__ import annotations

import pytest

from axonn.plan import get_hardware, load_shape
from axonn.plan.evaluation import eval_memory, eval_time
from axonn.plan.volumes import Grid
from memorization.config import load_run_config
from memorization.models import REPO_ROOT
from memorization.train.dryrun import dry_run
from memorize_core import ConfigError

CONFIGS = REPO_ROOT / "configs" / "train"


def test_kv_cache_and_gathered_weights_follow_their_definitions():
    shape = load_shape("llama-8b")  # 32 layers, 8 KV heads of 128, vocab 128256
    grid = Grid(1, 4, 2, 1)
    m = eval_memory(shape, grid, batch=16, context=32, new=32, seq=32, mode="paired", precision="bf16")
    # K and V, every layer, 16 rows x 64 positions, 8 KV heads split 4 ways over Y, bf16
    assert m["kv_cache"] == 2 * 32 * 16 * 64 * (8 * 128 // 4) * 2
    easy = eval_memory(shape, grid, batch=16, context=32, new=32, seq=32, mode="easy", precision="bf16")
    assert easy["kv_cache"] == 4 * m["kv_cache"]  # easy mode keeps every head on every rank
    assert m["logits"] == 3 * 4 * 16 * 32 * 128256 / 4
    held = eval_memory(shape, grid, batch=16, context=32, new=32, seq=32, mode="paired", precision="bf16",
                       keep_gathered=True)
    assert held["z_buffers"] == pytest.approx(held["weights"] / 4 * 2 * 2)  # fp32 shard x Z, in bf16
    assert eval_memory(shape, Grid(1, 4, 1, 2), batch=16, context=32, new=32, seq=32)["z_buffers"] == 0


def test_extraction_time_halves_with_twice_the_batch_shards():
    shape, hw = load_shape("llama-8b"), get_hardware("alps-h100")
    one = eval_time(shape, Grid(1, 4, 1, 1), hw, docs=1000, batch=8, context=32, new=32, gpus_per_node=4)
    two = eval_time(shape, Grid(1, 4, 1, 2), hw, docs=1000, batch=8, context=32, new=32, gpus_per_node=4)
    assert two["seconds"] == pytest.approx(one["seconds"] / 2, rel=0.02)


def test_the_dry_run_refuses_an_evaluation_batch_that_does_not_fit():
    cfg = load_run_config(CONFIGS / "llama-70b-finetune.yaml", ["eval.batch_size=32"])
    with pytest.raises(ConfigError) as e:  # a grid given (`auto` picks one where the scoring fits)
        dry_run(cfg, world=64, hardware="alps-h100", grid="1,2,16,2")
    msg = str(e.value)
    assert msg.startswith("eval.batch_size=32: ") and "lower it to 16" in msg and "\n" not in msg
    ok = dry_run(load_run_config(CONFIGS / "llama-70b-finetune.yaml"), world=64, hardware="alps-h100")
    ev = ok["evaluation"]
    assert ev["batch"] == 16 and ev["total_bytes"] <= ok["hardware"]["usable_bytes"]
    assert ev["mia_per_1000_pairs_s"] > 0 and ev["per_1000_docs_s"] > 0


@pytest.mark.parametrize("overrides,message", [
    (["eval.mia=true", "data.held_out=''", "data.held_out_fraction=0"], "needs non-members"),
    (["eval.mia=true", "data.corpus=wiki-chat", "data.held_out=lee-news"], "holds plain documents"),
    (["eval.mia_docs=-1"], "eval.mia_docs=-1"),
    (["eval.mia_k=0"], "eval.mia_k=0"),
])
def test_eval_mia_settings_are_checked_when_the_config_loads(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config(CONFIGS / "tiny-wiki.yaml", overrides)
