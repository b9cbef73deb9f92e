"""Canary scores of the canary-exposure experiment equal their definitions on an enumerable space."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from data_pipelines import SecretSpace, load_corpus, load_tokenizer, render
from memorization.eval.exposure import canary_scores, secret_start

TEMPLATE = "the door code is {secret}"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    texts = [d.text for d in load_corpus("lee-news-test")[:10]]
    tok = load_tokenizer("bpe", texts=texts, vocab_size=300, cache_dir=tmp_path_factory.mktemp("tok"))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))
    return tok, model.eval()


def _bits(model, ids, start):
    """-log2 p(ids[start:] | ids[:start]), one sequence at a time (no batching, no padding)."""
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)
    return -sum(float(logp[t - 1, ids[t]]) for t in range(start, len(ids))) / math.log(2)


def test_exposure_rank_and_extraction_follow_the_definition(setup):
    tok, model = setup
    space = SecretSpace("digits", 2)
    canaries = ["07", "42", "90"]
    out = canary_scores(model, tok, TEMPLATE, space, canaries)
    secrets = [space.secret(i) for i in range(100)]
    ids = {s: tok.encode(render(TEMPLATE, s), add_special_tokens=False) for s in secrets}
    start = secret_start(TEMPLATE, list(ids.values()), tok)
    head = tok.encode("the door code is", add_special_tokens=False)
    assert 1 <= start <= len(head) and all(v[:start] == head[:start] for v in ids.values())
    bits = {s: _bits(model, v, start) for s, v in ids.items()}
    best_other = min(b for s, b in bits.items() if s not in canaries)
    assert out["exact"] and out["scored"] == 100 and out["max_exposure"] == pytest.approx(math.log2(100))
    for c, got in zip(canaries, out["canaries"]):
        rank = 1 + sum(b <= bits[c] for s, b in bits.items() if s != c)
        assert got["secret"] == c and got["rank"] == rank
        assert got["logppl_bits"] == pytest.approx(bits[c], rel=1e-4)
        assert got["exposure"] == pytest.approx(math.log2(100) - math.log2(rank))
        assert got["extracted"] == (bits[c] < best_other)
    assert out["prompt"] == tok.decode(head[:start])


def test_a_memorized_canary_has_maximal_exposure_and_is_extracted(setup):
    tok, model = setup
    space = SecretSpace("digits", 2)
    canary = "58"
    ids = torch.tensor([tok.encode(render(TEMPLATE, canary), add_special_tokens=False)] * 4)
    # lr 3e-2 can stall this 1-layer model at loss ~0.107 (both ' ' tokens of "code is 58" look alike
    # to it, so it continues "is" with " is "); at 1e-2 it converges (loss ~1e-3 by 300 steps)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(300):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    out = canary_scores(model, tok, TEMPLATE, space, [canary])
    got = out["canaries"][0]
    assert got["rank"] == 1 and got["exposure"] == pytest.approx(math.log2(100)) and got["extracted"]
    assert out["greedy_continuation"].strip().startswith(canary)


def test_sampled_candidates_scale_the_rank(setup):
    tok, model = setup
    space = SecretSpace("digits", 3)
    out = canary_scores(model, tok, TEMPLATE, space, ["123", "456"], candidates=40, seed=1)
    assert not out["exact"] and out["scored"] == 42
    for c in out["canaries"]:
        assert c["rank"] is None and math.isfinite(c["exposure_extrapolated"])
        assert 0.0 <= c["exposure"] <= math.log2(1000) + 1e-9


def test_kept_exposure_ranks_the_kept_tokens_summed_over_the_dropped_one(setup):
    """With the secret's last token dropped, a canary's kept-token exposure ranks the group of secrets that
    tokenize alike and share its other tokens, by their summed probability, among all such groups."""
    tok, model = setup
    space = SecretSpace("digits", 2)
    secrets = [space.secret(i) for i in range(100)]
    ids = {s: tok.encode(render(TEMPLATE, s), add_special_tokens=False) for s in secrets}
    start = secret_start(TEMPLATE, list(ids.values()), tok)
    canaries = ["07", "42", "90"]
    assert all(len(ids[c]) - start >= 2 for c in canaries)  # a token to keep besides the dropped last one
    out = canary_scores(model, tok, TEMPLATE, space, canaries, dropped=lambda x: [0] * (len(x) - 1) + [1])
    bits = {s: _bits(model, v, start) for s, v in ids.items()}
    for c, got in zip(canaries, out["canaries"]):
        n = len(ids[c])
        groups: dict[tuple, float] = {}
        for s, v in ids.items():
            if len(v) == n:
                groups[tuple(v[start:n - 1])] = groups.get(tuple(v[start:n - 1]), 0.0) + 2.0 ** -bits[s]
        mine = groups.pop(tuple(ids[c][start:n - 1]))
        rank = 1 + sum(p >= mine * (1 - 1e-9) for p in groups.values())
        assert got["secret_tokens"] == n - start and got["secret_tokens_dropped"] == 1
        assert got["kept_groups"] == len(groups) + 1
        assert got["kept_exposure"] == pytest.approx(math.log2(len(groups) + 1) - math.log2(rank))
    # Nothing dropped (exposure says it all), everything dropped, or a sampled space: no kept-token exposure.
    for drop, kw in ((lambda x: [0] * len(x), {}), (lambda x: [1] * len(x), {}),
                     (lambda x: [0] * (len(x) - 1) + [1], {"candidates": 40})):
        for got in canary_scores(model, tok, TEMPLATE, space, canaries, dropped=drop, **kw)["canaries"]:
            assert got["kept_exposure"] is None and got["kept_groups"] is None
