"""Every evaluation on a parallelized model equals serial: greedy, beam and target-verified decoding,
MIA scores and AUCs, exposure ranks, perplexity, at grids that split X, Y (vocab and heads), Z and
data, with batches that do not divide across the batch shards. Every rank returns the same results.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from evals import (
    beam_generate,
    corpus_loss,
    exposure_rank,
    extract,
    greedy_generate,
    membership_inference,
    score_sequences,
    sequence_log_perplexity,
)
from evals.decoding import verified_greedy

pytestmark = pytest.mark.distributed
VOCAB, PREFIX, NEW = 64, 6, 10


def model(seed: int = 0) -> LlamaForCausalLM:
    """A seeded 2-layer Llama with grouped KV heads (4 heads, 2 KV heads), vocab 64.

    Weights drawn 10x wider than HF's default, so next-token distributions are peaked like a trained
    model's: at init they are near uniform, and Min-K%++ divides by their tiny spread, which turns
    float32 rounding (a split matmul sums in another order) into 1e-5 relative noise."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      initializer_range=0.2)
    return LlamaForCausalLM(cfg).eval()


def inputs() -> dict:
    """7 prefixes (7 rows: no batch-shard count divides them), ragged sequences for scoring."""
    g = torch.Generator().manual_seed(11)
    prefixes = torch.randint(0, VOCAB, (7, PREFIX), generator=g)
    lengths = (9, 17, 5, 30, 12, 21, 8, 14, 26)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]
    return {"prefixes": prefixes, "seqs": seqs}


def evaluate(m: torch.nn.Module, beams: bool) -> dict:
    """Every evaluation of `m` (the same calls serial and on every rank of a grid)."""
    x = inputs()
    p, seqs = x["prefixes"], x["seqs"]
    greedy = greedy_generate(m, p, NEW)
    # targets: rows 0, 2, 4 are the model's own continuation (verified in one pass), row 1 diverges
    # at position 3, the rest are random (the model disagrees at once)
    targets = torch.randint(0, VOCAB, (7, NEW), generator=torch.Generator().manual_seed(5))
    targets[[0, 2, 4]] = greedy[[0, 2, 4]]
    targets[1, :3] = greedy[1, :3]
    docs = [row.tolist() + t.tolist() for row, t in zip(p, targets)]
    out = {
        "greedy": greedy,
        "verified": verified_greedy(m, p, targets),
        "extract": [(r.doc, r.generated_ids, r.exact_match, r.rougeL)
                    for r in extract(m, docs, prefix_len=PREFIX, suffix_len=NEW, batch_size=3)],
        "scores": score_sequences(m, seqs, batch_size=2, ref_model=m),
        "mia": membership_inference(m, seqs[:5], seqs[5:], batch_size=3, bootstrap=50),
        "logppl": sequence_log_perplexity(m, seqs, spans=(1, 5), batch_size=4),
        # candidates of one template (a shared prefix run once through the KV cache), 7 of them
        "shared": sequence_log_perplexity(m, [seqs[3][:6] + s[:1 + i % 3] for i, s in enumerate(seqs[:7])],
                                          spans=[(6, 7 + i % 3) for i in range(7)], batch_size=3),
        "loss": corpus_loss(m, seqs, batch_size=3),
    }
    out["exposure"] = exposure_rank(float(out["logppl"][0]), out["logppl"][1:], 2 ** 10)
    if beams:
        out["beam"] = beam_generate(m, p, 5, 3)
    # plain values: tensors would travel back from a rank through shared memory the rank frees on exit
    return {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in out.items()}


def _on_grid(rank, world, dims, mode, beams):
    import axonn

    grid = axonn.init(*dims)
    m = axonn.parallelize(model(), grid, mode=mode)
    return evaluate(m, beams)


def _same(got: dict, want: dict) -> None:
    assert got["greedy"] == want["greedy"]
    assert got["verified"] == want["greedy"]  # verified decoding is greedy decoding
    assert got["extract"] == want["extract"]
    for method, v in want["scores"].items():
        np.testing.assert_allclose(got["scores"][method], v, rtol=1e-5, atol=1e-7, err_msg=method)
    for method, v in want["mia"].items():
        assert got["mia"][method] == v, method  # AUCs, TPRs and bootstrap CIs identical
    np.testing.assert_allclose(got["logppl"], want["logppl"], rtol=1e-5)
    np.testing.assert_allclose(got["shared"], want["shared"], rtol=1e-5)
    assert got["exposure"] == want["exposure"]
    assert got["loss"]["scored_tokens"] == want["loss"]["scored_tokens"]
    assert got["loss"]["loss"] == pytest.approx(want["loss"]["loss"], rel=1e-5)
    if "beam" in want:
        assert got["beam"] == want["beam"]


@pytest.fixture(scope="module")
def serial():
    return evaluate(model(), beams=True)


@pytest.mark.parametrize("dims,mode,beams", [
    ((2, 1, 1, 1), "easy", False),
    ((1, 2, 1, 1), "paired", True),    # vocab and heads split over Y: distributed argmax / top-k
    ((1, 1, 2, 1), "easy", True),      # Z: weights gathered per layer, shards in lockstep
    ((1, 1, 1, 2), "easy", False),     # data: independent replicas of the batch split
    ((2, 2, 2, 1), "paired", False),
    ((1, 2, 2, 2), "paired", False),
])
def test_sharded_evaluation_equals_serial(serial, dims, mode, beams):
    from axonn.spawn import run_distributed

    world = dims[0] * dims[1] * dims[2] * dims[3]
    results = run_distributed(_on_grid, world, dims, mode, beams, timeout=300)
    want = dict(serial) if beams else {k: v for k, v in serial.items() if k != "beam"}
    for r in results:  # every rank holds every result
        _same(r, want)
