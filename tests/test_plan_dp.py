"""The planner prices DP-SGD with ghost clipping (`example_norms`): per micro-batch a norm pass (a backward
without weight GEMMs, plus the per-example norm GEMMs) before the clipped backward, its collectives,
the step's Gaussian noise and the norm buffers; off, it predicts exactly as before. Opacus' per-sample
clipping (`example_norms="materialized"`): the weight-gradient GEMMs again, one gradient per row held,
written and read twice, the noise. The run's chooser and memory check ask for whichever the run
clips by, and `grid: auto` only weighs grids the run accepts."""
from __future__ import annotations

from dataclasses import replace

import pytest

from axonn.plan.calibrate import get_hardware
from axonn.plan.choose import train_cost
from axonn.plan.collectives import collective_time, group_strides
from axonn.plan.compute import attention_time, elementwise_time, example_norm_time, gemm_time
from axonn.plan.memory import Adapters, example_norm_bytes, memory_breakdown
from axonn.plan.model import predict
from axonn.plan.shapes import load_shape
from axonn.plan.volumes import Grid, step_ops
from memorization.config import load_run_config
from memorization.models import REPO_ROOT
from memorization.train.parallel import Launch, _train_objective, choose_grid, example_norms
from memorize_core import ConfigError


def _norm_gemms_by_hand(shape, seq: int, rows: int, hw) -> float:
    """Llama-1B at 1,1,1,1 and T = 2,048 (H = 2,048, kv 512, F = 8,192), per example: q and o form their
    per-example weight gradient G^T A (a [2048, 2048] block, the size of T^2: half the Grams'
    multiply-adds), k and v too (their [512, 2048] block is smaller than T^2); gate, up and down their
    Gram matrices (a block of 4 T^2 would outgrow the Gram pair), up reusing gate's input Gram as the
    hooks' cache does; the head's Grams and the embedding's dE dE^T. A G^T A block is written, squared
    and summed (12 bytes per element, fp32), a Gram pair multiplied and summed (12 per [T, T] element)."""
    h, kv, f, t = shape.hidden, shape.kv_dim, shape.ffn, seq
    assert (h, kv, f, t) == (2048, 512, 8192, 2048)
    products = 12.0 * t * t / hw.hbm_bw  # each pair of [T, T] Grams multiplied and summed, fp32

    def gram(width: int) -> float:
        return gemm_time(t, t, width, hw)

    def direct(out: int, inp: int) -> float:
        return gemm_time(out, inp, t, hw) + 12.0 * out * inp / hw.hbm_bw

    layer = (direct(h, h)  # q
             + 2 * direct(kv, h)  # k, v
             + direct(h, h)  # o
             + gram(h) + gram(f) + products  # gate
             + gram(f) + products  # up: gate's input Gram again
             + gram(f) + gram(h) + products)  # down
    head = gram(h) + gram(shape.vocab) + products
    embedding = gram(h) + products
    return rows * (shape.layers * layer + head + embedding)


def test_norm_pass_terms_for_llama_1b_at_one_gpu():
    shape, hw, grid = load_shape("llama-1b"), get_hardware("h100"), Grid(1, 1, 1, 1)
    seq, rows = 2048, 4
    kw = dict(gpus_per_node=1, mode="paired", loss_chunk="off")
    plain = predict(shape, grid, seq, rows, hw, **kw)
    dp = predict(shape, grid, seq, rows, hw, example_norms=True, **kw)
    assert predict(shape, grid, seq, rows, hw, example_norms=False, **kw) == plain
    gemms, _, _ = step_ops(shape, grid, seq, rows, False, "paired")
    dgrad = sum(gemm_time(g.m, g.n, g.k, hw) * g.count for g in gemms if g.role == "dgrad")
    attn_bwd = attention_time(shape, grid, seq, rows, hw, False, "paired")[1]
    elem_bwd = elementwise_time(shape, grid, seq, rows, hw, False, "paired", 0)[1]
    noise = 16.0 * shape.params / hw.hbm_bw
    want = dgrad + attn_bwd + elem_bwd + _norm_gemms_by_hand(shape, seq, rows, hw) + noise
    assert abs((dp.time_s - plain.time_s) - want) <= 1e-9 * want
    assert dp.comm_s == plain.comm_s == 0.0
    # three quarters of a plain step more here: the dgrad GEMMs again, and the norms (the Grams of the
    # MLP's layers at T = 2,048 cost 1.25x their weight GEMMs; q and o's G^T A one: 1.77x with Grams there)
    assert 1.7 < dp.time_s / plain.time_s < 1.76
    extra = (dp.memory_gb - plain.memory_gb) * 2**30
    assert abs(extra - example_norm_bytes(shape, grid, seq, rows, "paired")) <= 1.0


def test_norm_pass_collectives_repeat_the_backwards_but_the_weight_reduction():
    """On a Z x Y split: the norm pass gathers the Linears' weights over Z once more (the backward's
    gathers; the embedding's backward does not run in it), reduces no weight gradient (the Z
    reduce-scatter is the plain step's), and adds the norms' all-reduce over Y (X is 1: nothing)."""
    shape, hw, grid = load_shape("llama-1b"), get_hardware("h100"), Grid(1, 2, 2, 1)
    kw = dict(gpus_per_node=4, mode="paired", loss_chunk="off")
    plain = predict(shape, grid, 2048, 4, hw, **kw)
    dp = predict(shape, grid, 2048, 4, hw, example_norms=True, **kw)
    p, d = plain.comm_by_group, dp.comm_by_group
    assert d["reduce_scatter:z"] == p["reduce_scatter:z"]
    _, comms, _ = step_ops(shape, grid, 2048, 4, False, "paired")
    stride = group_strides(1, 2, 2, 1)["z"][1]
    gathers = sum(collective_time("all_gather", c.elems * 2, 2, stride, 4, hw, 4) * c.count for c in comms
                  if c.kind == "all_gather" and c.group == "z" and c.phase == "bwd")
    assert gathers > 0 and abs(d["all_gather:z"] - p["all_gather:z"] - gathers) <= 1e-9 * gathers
    assert d["all_reduce:y"] > p["all_reduce:y"] and "all_reduce:x" not in d
    assert dp.exposed_comm_s > plain.exposed_comm_s


def test_the_run_asks_for_the_norm_pass_where_it_clips_by_ghost_norms():
    """A ghost-clipping DP run's training objective prices the norm pass and its buffers (the auto
    grid and the memory check use it); Opacus' per-sample clipping its per-row gradients; a plain run
    neither."""
    cfg = load_run_config(REPO_ROOT / "configs" / "train" / "tiny-wiki.yaml", [])
    dp = replace(cfg, trainer=replace(cfg.trainer, dp=replace(cfg.trainer.dp, enabled=True)))
    per_sample = replace(dp, trainer=replace(dp.trainer, dp=replace(dp.trainer.dp, clipping="per_sample")))
    kinds = (example_norms(cfg), example_norms(dp), example_norms(per_sample))
    assert kinds == (False, "ghost", "materialized")
    shape, hw = load_shape("llama-1b"), get_hardware("h100")
    costs = {}
    for name, c in (("plain", cfg), ("ghost", dp)):
        obj = replace(_train_objective(c, None, shape, "bf16"), extra_bytes=None, micro_batch=None)
        assert obj.example_norms == ("ghost" if name == "ghost" else False)
        costs[name] = train_cost(shape, Grid(1, 1, 1, 1), hw, replace(obj, seq=2048, batch=4), mode="paired",
                                 gpus_per_node=1, headroom=0.1)
    assert costs["ghost"][0] > 1.5 * costs["plain"][0] and costs["ghost"][1] > costs["plain"][1]


def test_with_adapters_only_their_norms_are_formed():
    """DP-SGD on LoRA adapters: the norm pass still runs the backward through the frozen base, but forms
    norms of the rank-r adapters only (per-example G^T A of [r, in] and [out, r], bound by reading the
    activations: a fifth of the full model's norm work here)."""
    shape, hw, grid = load_shape("llama-1b"), get_hardware("h100"), Grid(1, 1, 1, 1)
    lora = Adapters(rank=16)
    full = example_norm_time(shape, grid, 2048, 4, hw, "paired")
    adapters = example_norm_time(shape, grid, 2048, 4, hw, "paired", lora)
    assert 0 < adapters < 0.25 * full
    by_hand = 4 * shape.layers * sum(gemm_time(16, i, 2048, hw) + gemm_time(o, 16, 2048, hw)
                                     + 12.0 * 16 * (i + o) / hw.hbm_bw  # the [r, in], [out, r] blocks
                                     for _, o, i, _ in shape.block_linears())  # T^2 > r * in: direct
    assert abs(adapters - by_hand) <= 1e-12
    kw = dict(gpus_per_node=1, mode="paired", loss_chunk="off", adapters=lora)
    plain = predict(shape, grid, 2048, 4, hw, **kw)
    dp = predict(shape, grid, 2048, 4, hw, example_norms=True, **kw)
    gemms, _, _ = step_ops(shape, grid, 2048, 4, False, "paired")
    dgrad = sum(gemm_time(g.m, g.n, g.k, hw) * g.count for g in gemms if g.role == "dgrad")
    assert dgrad + adapters < dp.time_s - plain.time_s < dgrad + adapters + 0.5 * plain.time_s


def test_per_sample_gradients_are_priced_by_hand():
    """Opacus' per-sample clipping on llama-1b at 1,1,1,1: memory gains one fp32 gradient per row and
    parameter; the step gains, per micro-batch, the weight-gradient GEMMs again and three passes over
    those gradients (written, read for the norms, read for the clipped sum), and the noise."""
    shape, hw, grid = load_shape("llama-1b"), get_hardware("h100"), Grid(1, 1, 1, 1)
    kw = dict(gpus_per_node=1, mode="paired", loss_chunk="off", micro_batch=2)
    plain = predict(shape, grid, 2048, 4, hw, **kw)
    ps = predict(shape, grid, 2048, 4, hw, example_norms="materialized", **kw)
    n = shape.params
    gemms, _, _ = step_ops(shape, grid, 2048, 2, False, "paired")
    wgrad = sum(gemm_time(g.m, g.n, g.k, hw) * g.count for g in gemms if g.role == "wgrad")
    extra = 2 * (wgrad + 12.0 * 2 * n / hw.hbm_bw) + 16.0 * n / hw.hbm_bw  # 2 micro-batches, then noise
    assert abs((ps.time_s - plain.time_s) - extra) <= 1e-9 * ps.time_s
    mem = memory_breakdown(shape, grid, 2048, 2, False, mode="paired", example_norms="materialized")
    assert mem["example_grads"] == 4.0 * 2 * n and "example_norms" not in mem
    assert abs((ps.memory_gb - plain.memory_gb) * 2 ** 30 - 4.0 * 2 * n) <= 1.0
    with pytest.raises(ConfigError, match="example_norms"):
        predict(shape, grid, 2048, 4, hw, example_norms="opacus", **kw)


def test_auto_grid_takes_only_grids_the_run_accepts():
    """`grid: auto` with Opacus' per-sample clipping, or LoRA with adapter dropout, weighs only grids that
    split no weight (the run refuses the others): it once chose 1,1,8,1 for per-sample DP-SGD."""
    cfg = load_run_config(REPO_ROOT / "configs" / "train" / "tiny-wiki.yaml",
                          ["model.name=llama-1b", "model.overrides={}", "data.block_len=2048",
                           "trainer.batch_size=16"])
    from memorization.train.run_plan import planned_model_config

    config = planned_model_config(cfg)[0]
    launch = Launch(8, 8, "h100")
    assert choose_grid(cfg, config, launch)[:3] != (1, 1, 1)  # a plain run splits the weights
    dp = replace(cfg.trainer.dp, enabled=True, clipping="per_sample", target_epsilon=8.0)
    per_sample = replace(cfg, trainer=replace(cfg.trainer, dp=dp))
    assert choose_grid(per_sample, config, launch) == (1, 1, 1, 8)
    # the dry run's suggestion ("planner best") weighs the same grids
    from memorization.train.dryrun import dry_run

    best = dry_run(per_sample, world=8, grid="1,1,1,8", hardware="h100")["planner_best"]
    assert best["grid"][:3] == [1, 1, 1]
    dropout = replace(cfg, model=replace(cfg.model, lora=replace(cfg.model.lora, enabled=True, dropout=0.1)))
    assert choose_grid(dropout, config, launch) == (1, 1, 1, 8)
