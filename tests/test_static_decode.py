"""The static-cache decode (evals/static_decode.py) gives greedy_generate's tokens, eager and
compiled (Dynamo's `eager` backend on CPU: the same capture, no code generation), keeps its compiled
step for later calls, and refuses an engine-sharded model in one line."""
from __future__ import annotations

import pytest
import torch
from helpers import memorized_model, tiny_model

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


def _tensor_split(model: torch.nn.Module) -> torch.nn.Module:
    """`model` parallelized serially, its engine handle then claiming a 1,2,1,1 grid (a Y split)."""
    import dataclasses

    import axonn
    from axonn.engine import engine_of, set_engine

    model = axonn.parallelize(model, ProcessGrid.serial())
    grid = ProcessGrid.__new__(ProcessGrid)
    grid._place((1, 2, 1, 1), 0)
    set_engine(model, dataclasses.replace(engine_of(model), grid=grid))
    return model


def test_tensor_split_model_refused_engine_at_one_rank_decoded() -> None:
    import axonn

    with pytest.raises(ConfigError, match="serial models only"):
        static_greedy_generate(_tensor_split(tiny_model()), _prefixes(), 4)
    # the engine at 1,1,1,1 (what a GPU run trains and evaluates with) splits nothing: decoded, the same
    from axonn.compile import compile_blocks

    model = axonn.parallelize(tiny_model(), ProcessGrid.serial())
    pre = _prefixes()
    assert torch.equal(static_greedy_generate(model, pre, 6, backend="eager"), greedy_generate(model, pre, 6))
    compile_blocks(model, True, backend="eager")  # its blocks compiled, as a GPU run trains them
    assert torch.equal(static_greedy_generate(model, pre, 6, backend="eager"), greedy_generate(model, pre, 6))


def test_extraction_on_the_static_path_equals_greedy_generate_on_a_trained_model() -> None:
    from evals import extract
    from evals.static_decode import DecodeLog

    model, docs = memorized_model()
    # half memorized rows, half random ones (flat logits, nothing to copy): both kinds of row
    other = torch.randint(0, 64, (5, 20), generator=torch.Generator().manual_seed(9)).tolist()
    docs = docs + other
    log = DecodeLog()
    got = extract(model, docs, prefix_len=8, suffix_len=12, batch_size=4, decode="static", decode_log=log)
    kv = extract(model, docs, prefix_len=8, suffix_len=12, batch_size=4, decode="kv")
    want = greedy_generate(model, torch.tensor(docs)[:, :8], 12).tolist()
    assert [r.generated_ids for r in got] == want == [r.generated_ids for r in kv]
    assert sum(r.exact_match for r in got) >= 5  # the trained rows are extracted: the logits are peaked
    d = log.to_dict()
    assert d.pop("gap_shift_max") < 1e-4  # fp32 on CPU: the static and eager gaps agree closely
    assert d == {"path": "static", "rows": 11, "checked": 11, "verified": 11, "redecoded": 0,
                 "disagreements": []}


def test_a_row_the_static_step_gets_wrong_is_caught_and_decoded_again(monkeypatch) -> None:
    """The teacher-forced check is what makes the static path safe: corrupt one token of one row in
    the static decode and the extraction still equals greedy_generate, the row listed in the log."""
    import evals.static_decode as sd
    from evals import extract

    model, docs = memorized_model(n=4)
    real = sd.StaticDecoder.generate

    def corrupted(self, prefixes, max_new_tokens):
        out = real(self, prefixes, max_new_tokens)
        out[1, 3] = (out[1, 3] + 1) % 64
        return out

    monkeypatch.setattr(sd.StaticDecoder, "generate", corrupted)
    log = sd.DecodeLog()
    got = extract(model, docs, prefix_len=8, suffix_len=12, batch_size=4, decode="static", decode_log=log,
                  doc_ids=["a", "b", "c", "d"])
    assert [r.generated_ids for r in got] == greedy_generate(model, torch.tensor(docs)[:, :8], 12).tolist()
    d = log.to_dict()
    assert (d["rows"], d["checked"], d["verified"], d["redecoded"]) == (4, 4, 3, 1)
    assert d["disagreements"][0]["row"] == "b" and d["disagreements"][0]["position"] == 3
    assert d["disagreements"][0]["top2_gap"] > 0


def test_decode_choice_checked_in_one_line(monkeypatch) -> None:
    import axonn
    from evals import extract
    from evals.static_decode import uses_static

    model = tiny_model()
    assert not uses_static(model, "auto")  # a CPU model: the KV-cache decoder
    assert uses_static(model, "static") and not uses_static(model, "kv")
    with pytest.raises(ConfigError, match="decode=.*greedy"):
        uses_static(model, "static", num_beams=2)
    with pytest.raises(ConfigError, match="decode=.fast.: pass auto.*static or kv"):
        extract(model, [list(range(20))], prefix_len=4, suffix_len=4, decode="fast")
    sharded = _tensor_split(tiny_model())
    with pytest.raises(ConfigError, match="serial models only"):
        uses_static(sharded, "static")
    assert not uses_static(sharded, "auto")
    assert uses_static(axonn.parallelize(tiny_model(), ProcessGrid.serial()), "static")
    import evals.static_decode as sd

    monkeypatch.setattr(sd, "model_device", lambda m: torch.device("cuda"))
    assert uses_static(model, "auto")  # on a GPU: the static path, unless beams or a tensor split
    assert not uses_static(model, "auto", num_beams=2) and not uses_static(sharded, "auto")
    monkeypatch.setattr(type(model), "_can_compile_fullgraph", False)  # a class without a static cache
    assert not uses_static(model, "auto")
    with pytest.raises(ConfigError, match="does not declare static-cache support"):
        uses_static(model, "static")


def test_a_decoded_model_is_freed_with_its_cache() -> None:
    """The decoders kept per model must not keep the model alive (an experiment evaluates one model
    per arm: on a GPU each would hold its weights and static cache to the end of the process)."""
    import gc
    import weakref

    model = tiny_model()
    static_greedy_generate(model, _prefixes(), 4, backend="eager")
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


def test_check_below_checks_exactly_the_rows_with_a_small_margin() -> None:
    """The gated check: only rows whose smallest top-2 gap in the compiled decode is below the bound
    go through the teacher-forced forward; the tokens are the same."""
    from evals._model import evaluating
    from evals.scoring import Scorer
    from evals.static_decode import DecodeLog, static_local

    model, docs = memorized_model()
    other = torch.randint(0, 64, (6, 20), generator=torch.Generator().manual_seed(9)).tolist()
    pre = torch.tensor(docs + other)[:, :8]
    sc = Scorer(model)
    with evaluating(model):
        full = static_local(sc, pre, 12, batch=12)
        gaps = static_decoder(model, 12, 20, compile=False).min_gap.clone()
        tau = float(gaps.median())
        log = DecodeLog()
        gated = static_local(sc, pre, 12, batch=12, check_below=tau, log=log)
    assert torch.equal(gated, full) and torch.equal(full, greedy_generate(model, pre, 12))
    assert 0 < log.checked == int((gaps < tau).sum()) < 12


def test_decode_log_counts_every_failed_row_and_lists_the_first_fifty() -> None:
    from evals.static_decode import DecodeLog

    a, b = DecodeLog(path="static", rows=80, checked=80), DecodeLog(path="static", rows=20, checked=20)
    for i in range(60):
        a.add(i, 3, 0.01)
    b.add("x", 0, 0.5)
    a.merge(b)
    d = a.to_dict()
    assert (d["rows"], d["checked"], d["redecoded"], d["verified"]) == (100, 100, 61, 39)
    assert len(d["disagreements"]) == DecodeLog.LISTED == 50 and d["disagreements"][0]["row"] == 0
