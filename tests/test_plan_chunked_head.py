"""The planner's terms for the chunked LM head (trainer.loss_chunk): the full-logit memory is replaced
by one chunk's plus the fp32 dW accumulator, the logit bytes drop from 20 to 8 per logit (the summed
loss's gradient formed in forward: no recompute GEMM); loss_chunk=0 predicts exactly as before."""
from __future__ import annotations

from axonn.plan.calibrate import get_hardware
from axonn.plan.compute import elementwise_time
from axonn.plan.memory import auto_chunk
from axonn.plan.model import predict
from axonn.plan.shapes import load_shape
from axonn.plan.volumes import Grid


def test_chunked_head_terms_for_llama_1b() -> None:
    shape, hw, grid = load_shape("llama-1b"), get_hardware("h100"), Grid(1, 1, 1, 1)
    chunk = auto_chunk(shape.vocab)
    full = predict(shape, grid, 2048, 8, hw, gpus_per_node=1, mode="paired")
    chunked = predict(shape, grid, 2048, 8, hw, gpus_per_node=1, mode="paired", loss_chunk=chunk)
    tokens = 8 * 2048
    saved = (2 + 8) * (tokens - chunk) * shape.vocab - 8 * tokens - 4 * shape.vocab * shape.hidden
    got = (full.memory_by_kind["activations"] - chunked.memory_by_kind["activations"]) * 2**30
    assert abs(got - saved) <= 1e-6 * saved  # ~17 GiB at 8 x 2048 tokens
    assert full.memory_gb - chunked.memory_gb > 15
    ef, eb = elementwise_time(shape, grid, 2048, 8, hw, False)
    cf, cb = elementwise_time(shape, grid, 2048, 8, hw, False, loss_chunk=chunk)
    per_logit = tokens * shape.vocab / hw.hbm_bw
    assert abs((ef + eb) - (cf + cb) - 12 * per_logit) <= 1e-9 and cb == eb - 10 * per_logit
    assert abs(chunked.time_s - (full.time_s - 12 * per_logit)) <= 1e-9
    assert predict(shape, grid, 2048, 8, hw, gpus_per_node=1, mode="paired", loss_chunk=0) == full
