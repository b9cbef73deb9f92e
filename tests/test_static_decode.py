"""The static-cache decode (evals/static_decode.py) gives greedy_generate's tokens, eager and
compiled (Dynamo's `eager` backend on CPU: the same capture, no code generation), keeps its compiled
step for later calls, and refuses an engine-sharded model in one line."""
from __future__ import annotations

import pytest
import torch
from helpers import tiny_model

from axonn.grid import ProcessGrid
from evals.decoding import greedy_generate
from evals.static_decode import static_decoder, static_greedy_generate
from memorize_core import ConfigError


def _prefixes(batch: int = 6, length: int = 10, vocab: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_static_cache_tokens_equal_greedy_generate() -> None:
    model = tiny_model()
    for seed in range(3):
        pre = _prefixes(seed=seed)
        got = static_greedy_generate(model, pre, 12, compile=False)
        assert torch.equal(got, greedy_generate(model, pre, 12))
    assert static_greedy_generate(model, _prefixes(), 0, compile=False).shape == (6, 0)


def test_compiled_step_equals_and_is_reused() -> None:
    model = tiny_model()
    pre = _prefixes()
    ref = greedy_generate(model, pre, 8)
    assert torch.equal(static_greedy_generate(model, pre, 8, backend="eager"), ref)
    dec = static_decoder(model, 6, 18, backend="eager")
    first = dec.compile_s
    assert first is not None and first > 0
    other = _prefixes(seed=5)
    got = static_greedy_generate(model, other, 8, backend="eager")
    assert torch.equal(got, greedy_generate(model, other, 8))
    assert static_decoder(model, 6, 18, backend="eager") is dec and dec.compile_s == first  # compiled once


def test_sharded_model_refused() -> None:
    import axonn

    model = axonn.parallelize(tiny_model(), ProcessGrid.serial())
    with pytest.raises(ConfigError, match="serial models only"):
        static_greedy_generate(model, _prefixes(), 4)
