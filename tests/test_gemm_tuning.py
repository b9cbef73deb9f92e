"""GEMM layout tuning (axonn/gemm.py): every formulation computes the same product, the winner is
cached in memory and on disk per device, the flag off is the plain matmul, and the layers use it."""
from __future__ import annotations

import json

import pytest
import torch

from axonn.gemm import VARIANTS, GemmTuner, _run, default_enabled, device_name
from axonn.spawn import run_distributed


def _operands(transposed_b: bool = True):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(48, 40, generator=g)
    w = torch.randn(24, 40, generator=g)
    return a, (w.t() if transposed_b else w.t().contiguous())


def test_variants_compute_the_same_product() -> None:
    a, b = _operands()
    ref = a.matmul(b)
    for v in VARIANTS:
        assert torch.allclose(_run(v, a, b), ref, rtol=1e-5, atol=1e-5), v


def test_off_is_the_plain_path(cache_dir) -> None:
    a, b = _operands()
    tuner = GemmTuner(enabled=False)
    assert torch.equal(tuner.mm(a, b), a.matmul(b))
    assert not tuner.timings and not (cache_dir / "gemm").exists()


def test_winner_is_cached_on_disk_per_device(cache_dir) -> None:
    a, b = _operands()
    tuner = GemmTuner(enabled=True)
    out = tuner.mm(a, b)
    assert torch.allclose(out, a.matmul(b), rtol=1e-5, atol=1e-5)
    key = GemmTuner.key(a, b)
    assert key in tuner.timings and set(tuner.timings[key]) == set(VARIANTS)
    path = cache_dir / "gemm" / f"{device_name(a.device)}.json"
    stored = json.loads(path.read_text())
    assert stored[key] in VARIANTS and torch.__version__ in key
    fresh = GemmTuner(enabled=True)  # a new process: reads the winner, times nothing
    assert torch.equal(fresh.mm(a, b), _run(stored[key], a, b))
    assert not fresh.timings
    # a different layout of the same shape is a different entry
    a2, b2 = _operands(transposed_b=False)
    fresh.mm(a2, b2)
    assert len(json.loads(path.read_text())) == 2


def test_auto_tunes_on_cuda_only() -> None:
    assert default_enabled(torch.device("cpu"), "auto") is False
    assert default_enabled(torch.device("cuda"), "auto") is True
    assert default_enabled(torch.device("cpu"), True) is True


def _layers(rank: int, world: int, cache: str) -> dict:
    import os

    os.environ["MEMORIZE_CACHE"] = cache
    from transformers import LlamaConfig, LlamaForCausalLM

    import axonn
    from axonn.schedule import EngineOptions

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=4)
    serial = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 64, (2, 8))
    ref = serial(input_ids=ids).logits
    out = {}
    for tuning in (False, True):
        torch.manual_seed(0)
        model = axonn.parallelize(LlamaForCausalLM(cfg), axonn.ProcessGrid(1, 1, 1, 1),
                                  options=EngineOptions(gemm_tuning=tuning))
        logits = model(input_ids=ids).logits
        model(input_ids=ids, labels=ids).loss.backward()
        out[tuning] = ((logits - ref).abs().max().item(), len(axonn.engine_of(model).scheduler.gemm.timings))
    return out


@pytest.mark.distributed
def test_layers_use_the_tuner(tmp_path) -> None:
    (res,) = run_distributed(_layers, 1, str(tmp_path / "cache"), timeout=120)
    assert res[False][1] == 0 and res[True][1] >= 3  # forward, dX and dW shapes tuned
    assert res[False][0] < 1e-5 and res[True][0] < 1e-5
