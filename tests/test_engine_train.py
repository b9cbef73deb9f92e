"""The trainer contract end to end: AdamW steps with clipping on a grid track the serial run.

fp64: losses, grad norms and parameters after every step agree to <= 1e-10 (the engine is exact).
fp32: losses and norms agree to <= 1e-5; parameters to <= 1e-3 of their largest entry, because Adam
divides by sqrt(v) and so turns the ~1e-7 rounding differences of near-zero gradients into
lr-sized update differences (seen at 5 steps: ~1e-4 on zero-initialised biases, ~5e-5 on weights).
"""
from __future__ import annotations

from pathlib import Path

import engine_cases as ec
import pytest

from axonn.spawn import run_distributed

STEPS, LR, CLIP = 5, 1e-3, 0.5
TOLS = {"float64": (1e-10, 1e-10), "float32": (1e-5, 1e-3)}  # (loss and norm, parameters)


def _serial_copy(model, state):
    """A fresh serial HF model of `model`'s class and config holding the full state dict `state`."""
    import torch  # in the spawned rank, as the other helpers here

    from axonn.swap import _materialize_meta

    with torch.device("meta"):
        serial = type(model)(model.config)
    serial.load_state_dict(state, assign=True)
    if getattr(model.config, "tie_word_embeddings", False):
        serial.tie_weights()
    _materialize_meta(serial, torch.device("cpu"))  # non-persistent buffers (rotary) recomputed
    return serial


def _step(model, grid, ids, labels, opt) -> tuple[float, float]:
    import axonn

    opt.zero_grad(set_to_none=True)
    local_ids, local_labels = axonn.shard_batch(ids, grid), axonn.shard_batch(labels, grid)
    logits = model(input_ids=local_ids).logits
    loss_sum, count = axonn.cross_entropy(logits[:, :-1], local_labels[:, 1:], grid)
    total = axonn.all_reduce_sum(count.clone(), grid)
    (loss_sum / total).backward()
    axonn.sync_gradients(model, grid)
    norm = axonn.clip_grad_norm_(model, CLIP, grid)
    opt.step()
    return (axonn.all_reduce_sum(loss_sum.detach().clone(), grid) / total).item(), norm


def _train(rank: int, world: int, out_dir: str) -> list[dict]:
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    import axonn

    results = []
    for dims, mode, dtype_name in [((2, 1, 2, 1), "easy", "float64"), ((1, 2, 1, 2), "paired", "float64"),
                                   ((2, 2, 1, 1), "paired", "float32")]:
        grid = axonn.ProcessGrid(*dims)
        serial = ec.llama(tied=True, kv_heads=4).to(getattr(torch, dtype_name))
        model = axonn.parallelize(copy.deepcopy(serial), grid, mode=mode)
        s_opt = torch.optim.AdamW(serial.parameters(), lr=LR)
        p_opt = torch.optim.AdamW(model.parameters(), lr=LR)
        steps = []
        for step in range(STEPS):
            ids, labels = ec.batch(seed=step)
            steps.append((_step(serial, axonn.ProcessGrid.serial(), ids, labels, s_opt),
                          _step(model, grid, ids, labels, p_opt)))
        want = serial.state_dict()
        state = axonn.full_state_dict(model, rank0_only=True)
        back = _serial_copy(model, state) if state else None  # rank 0 only
        path = Path(out_dir) / f"{mode}-{dtype_name}"
        axonn.save_pretrained(model, path)
        grid.comm.all_reduce(torch.zeros(1), "world")  # rank 0 has finished writing
        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype_name))
        results.append({
            "dims": dims, "dtype": dtype_name, "steps": steps,
            "params": max(ec.rel(v, want[k]) for k, v in axonn.full_state_dict(model).items()),
            "serial_model": None if back is None else max(ec.rel(v, want[k])
                                                          for k, v in back.state_dict().items()),
            "saved": max(ec.rel(v, want[k]) for k, v in loaded.state_dict().items()),
            "tied": back is None or back.lm_head.weight is back.model.embed_tokens.weight,
        })
    return results


@pytest.mark.distributed
def test_adamw_steps_with_clipping_track_serial(tmp_path: Path) -> None:
    res = run_distributed(_train, 4, str(tmp_path), timeout=300)
    for rank_rows in res:
        for r in rank_rows:
            tol, ptol = TOLS[r["dtype"]]
            for (s_loss, s_norm), (p_loss, p_norm) in r["steps"]:
                assert abs(p_loss - s_loss) <= tol * abs(s_loss), r
                assert abs(p_norm - s_norm) <= tol * s_norm, r
                assert s_norm > CLIP  # clipping was active
            assert r["params"] <= ptol and r["saved"] <= ptol and r["tied"], r
            assert r["serial_model"] is None or r["serial_model"] <= ptol, r
    assert res[0][0]["serial_model"] is not None and res[1][0]["serial_model"] is None
    print("\n", [(r["dims"], r["dtype"], f"{r['params']:.1e}") for r in res[0]])
