"""Decoding against HF generate and brute force; extraction on a model that memorized its data."""
import itertools

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

from evals import (
    ExtractionResult,
    beam_generate,
    extract,
    extractability,
    greedy_generate,
    sequence_logprobs,
    summarize,
)
from evals._model import cache_keyword
from evals.kv_cache import preallocated_cache
from memorize_core import ConfigError

torch.set_num_threads(1)


def tiny_llama(vocab: int = 256, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    # No EOS: HF generate must not stop early or mask a token, so its output is comparable.
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(cfg)


def hf_generate(model, prefixes, new, **kw):
    was_training = model.training
    model.eval()  # generate() leaves dropout on in train mode (GPT-2 has dropout 0.1)
    out = model.generate(prefixes, attention_mask=torch.ones_like(prefixes), do_sample=False,
                         max_new_tokens=new, min_new_tokens=new, pad_token_id=0, **kw)
    model.train(was_training)
    return out[:, prefixes.shape[1]:]


def sum_logprob(model, prefixes, gen):
    lp = sequence_logprobs(model, torch.cat([prefixes, gen], dim=1))
    return lp[:, prefixes.shape[1] - 1:].sum(dim=1)


@pytest.fixture(scope="module")
def memorizer():
    """A tiny model trained until it reproduces 4 random 24-token documents."""
    model = tiny_llama(seed=1)
    docs = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(120):
        loss = model(docs, labels=docs).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05
    return model, docs.tolist()


def other_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                          bos_token_id=None, eos_token_id=None))
    # A sliding window the prompt outgrows: the preallocated cache must step aside for it.
    return MistralForCausalLM(MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            sliding_window=4, bos_token_id=None, eos_token_id=None))


def test_greedy_matches_hf_generate_and_restores_mode():
    model = tiny_llama()
    model.train()
    prefixes = torch.randint(0, 256, (5, 7), generator=torch.Generator().manual_seed(2))
    ours = greedy_generate(model, prefixes, 16)
    assert model.training  # eval mode only for the call
    assert ours.shape == (5, 16) and ours.dtype == torch.long
    assert torch.equal(ours, hf_generate(model, prefixes, 16))


@pytest.mark.parametrize("kind", ["gpt2", "mistral_sliding"])
def test_greedy_and_beam_match_hf_on_other_architectures(kind):
    model = other_model(kind)
    assert (preallocated_cache(model, 16) is None) == (kind == "mistral_sliding")
    prefixes = torch.randint(0, 256, (3, 6), generator=torch.Generator().manual_seed(3))
    assert torch.equal(greedy_generate(model, prefixes, 10), hf_generate(model, prefixes, 10))
    assert torch.equal(beam_generate(model, prefixes, 6, num_beams=3),
                       hf_generate(model, prefixes, 6, num_beams=3, early_stopping=False, length_penalty=0.0))


def test_preallocated_cache_grows_past_its_capacity():
    model = tiny_llama().eval()
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(8))
    cache = preallocated_cache(model, capacity=3)  # too small on purpose
    key = {cache_keyword(model): cache}  # `cache` since transformers 5.x renamed `past_key_values`
    with torch.no_grad():
        full = model(ids).logits
        first = model(ids[:, :5], use_cache=True, **key).logits
        rest = [model(ids[:, t:t + 1], use_cache=True, **key).logits for t in range(5, 9)]
    assert cache.get_seq_length() == 9
    assert torch.allclose(torch.cat([first, *rest], dim=1), full, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_greedy_matches_hf_generate_on_cuda():
    model = tiny_llama().cuda()
    prefixes = torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(2)).cuda()
    ours = greedy_generate(model, prefixes, 16)
    assert ours.device.type == "cuda"
    assert torch.equal(ours, hf_generate(model, prefixes, 16))


def test_beam_matches_hf_beam_search_and_beats_greedy():
    model = tiny_llama(seed=3)
    prefixes = torch.randint(0, 256, (4, 6), generator=torch.Generator().manual_seed(4))
    ours = beam_generate(model, prefixes, 8, num_beams=3)
    ref = hf_generate(model, prefixes, 8, num_beams=3, early_stopping=False, length_penalty=0.0)
    assert torch.equal(ours, ref)
    greedy = greedy_generate(model, prefixes, 8)
    assert not torch.equal(ours, greedy)  # otherwise this test could not tell beam from greedy
    assert (sum_logprob(model, prefixes, ours) >= sum_logprob(model, prefixes, greedy) - 1e-5).all()


def test_wide_beam_equals_brute_force_argmax():
    # With num_beams >= V^(S-1) every (S-1)-token prefix survives, so beam search is exact.
    vocab, new = 8, 3
    model = tiny_llama(vocab=vocab, seed=5)
    prefixes = torch.randint(0, vocab, (3, 4), generator=torch.Generator().manual_seed(6))
    ours = beam_generate(model, prefixes, new, num_beams=vocab ** (new - 1))
    every = torch.tensor(list(itertools.product(range(vocab), repeat=new)))
    for b in range(prefixes.shape[0]):
        scores = sum_logprob(model, prefixes[b].expand(len(every), -1), every)
        assert ours[b].tolist() == every[scores.argmax()].tolist()


def test_extract_memorized_documents(memorizer):
    model, docs = memorizer
    unseen = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(99)).tolist()
    short = docs[0][:10]  # below prefix_len + suffix_len: skipped
    results = extract(model, docs + [short, unseen], prefix_len=8, suffix_len=16, batch_size=3,
                      doc_ids=["a", "b", "c", "d", "short", "unseen"])
    assert [r.doc for r in results] == ["a", "b", "c", "d", "unseen"]
    for r, doc in zip(results, docs):
        assert isinstance(r, ExtractionResult)
        assert r.prefix_ids == doc[:8] and r.target_ids == doc[8:24]
        assert r.exact_match and r.token_accuracy == 1.0 and r.lcp == 16 and r.rougeL == 1.0
    assert not results[-1].exact_match
    summary = summarize(results)
    assert summary["docs"] == 5
    assert summary["exact_match_rate"] == pytest.approx(0.8)
    assert summary["lcp_mean"] == pytest.approx((4 * 16 + results[-1].lcp) / 5)
    assert set(results[0].to_dict()) == {"doc", "prefix_ids", "target_ids", "generated_ids",
                                         "exact_match", "token_accuracy", "lcp", "rougeL"}


def test_extract_beam_and_tokenizer_text(memorizer):
    model, docs = memorizer

    class Letters:  # a stand-in tokenizer: RougeL must score its decoded words
        def decode(self, ids):
            return " ".join("w" + "abcdefghij"[i % 10] for i in ids)

    results = extract(model, docs, prefix_len=8, suffix_len=16, num_beams=2, tokenizer=Letters())
    assert all(r.exact_match for r in results) and [r.doc for r in results] == [0, 1, 2, 3]
    wrong = extract(tiny_llama(seed=7), docs[:1], prefix_len=8, suffix_len=16, tokenizer=Letters())[0]
    words = lambda ids: Letters().decode(ids)  # noqa: E731
    from evals.metrics import rouge_l
    assert wrong.rougeL == pytest.approx(rouge_l(words(wrong.generated_ids), words(wrong.target_ids)))


def test_extractability_fixed_target(memorizer):
    model, docs = memorizer
    table = extractability(model, docs, prefix_lens=[8, 2], suffix_len=16)
    assert sorted(table) == [2, 8]
    assert table[8] == summarize(extract(model, docs, prefix_len=8, suffix_len=16))
    assert table[2]["docs"] == 4  # same documents for every k


def test_too_short_documents_raise_config_error():
    model = tiny_llama()
    with pytest.raises(ConfigError, match=r"prefix_len\+suffix_len=40.*longest has 12"):
        extract(model, [[1] * 12, [2] * 5], prefix_len=32, suffix_len=8)
    with pytest.raises(ConfigError, match=r"max\(prefix_lens\)\+suffix_len=38"):
        extractability(model, [[1] * 12], prefix_lens=[4, 30], suffix_len=8)
    with pytest.raises(ConfigError, match="prefix_len=0"):
        extract(model, [[1] * 12], prefix_len=0, suffix_len=8)
    with pytest.raises(ConfigError, match="doc_ids"):
        extract(model, [[1] * 12], prefix_len=2, suffix_len=2, doc_ids=["a", "b"])


def test_verified_greedy_equals_greedy_for_any_draft():
    """The target-as-draft decoder returns exactly the greedy tokens, wherever the draft diverges."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from evals.decoding import greedy_generate, verified_greedy

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=4, max_position_embeddings=64)).eval()
    prefixes = torch.randint(0, 50, (10, 7))
    greedy = greedy_generate(model, prefixes, 9)
    drafts = greedy.clone()
    for row in range(10):  # row r diverges at position r (row 9: draft is the greedy output itself)
        if row < 9:
            drafts[row, row] = (drafts[row, row] + 1) % 50
    assert torch.equal(verified_greedy(model, prefixes, drafts), greedy)
    random_drafts = torch.randint(0, 50, (10, 9))
    assert torch.equal(verified_greedy(model, prefixes, random_drafts), greedy)
    assert torch.equal(verified_greedy(model, prefixes, greedy), greedy)  # every row verbatim
    assert torch.equal(verified_greedy(model, prefixes, drafts[:, :1]), greedy[:, :1])  # one token
    assert torch.equal(verified_greedy(model, prefixes[[4]], drafts[[4]]), greedy[[4]])  # one row, m=4


def test_a_peft_model_is_decoded_through_its_base_models_cache_keyword():
    """peft's forward takes **kwargs; the cache must still go under the base model's own keyword
    (`cache` in transformers 5.x: the old `past_key_values` is deprecated, removed in 5.40)."""
    import warnings

    from peft import LoraConfig, get_peft_model

    base = tiny_llama(seed=3)
    prefixes = torch.randint(0, base.config.vocab_size, (3, 5), generator=torch.Generator().manual_seed(1))
    want = greedy_generate(base, prefixes, 6)
    lora = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))  # B = 0: same model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = greedy_generate(lora, prefixes, 6)
    assert torch.equal(got, want)
    assert not [w for w in caught if "past_key_values" in str(w.message)]
