"""Canaries and duplicated conversations injected into chat data (data_pipelines.inject_chat), and the
injection experiments on it: canaries trained as answers, grouped by the mask chat rows give them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from data_pipelines import CanarySpec, ChatExample, DuplicateSpec, inject_chat
from data_pipelines.chat import answer_encoder
from memorization.experiments import load_experiment
from memorization.experiments.injection import ChatPair, build_corpus, secret_mask
from memorization.mitigations.goldfish import goldfish_labels
from memorize_core import IGNORE_INDEX, ConfigError

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "experiments"
CHAT = ["base.data.corpus=wiki-chat", "base.data.limit=10", "base.data.vocab_size=300",
        "base.data.block_len=128", "canaries.template=the access code of the old east wing is {secret}",
        "counts=[1,3]", "canaries.per_count=2", "duplicates.per_count=1", "canaries.space.length=2",
        "base.wandb.mode=disabled"]


def _convs(n: int) -> list[ChatExample]:
    return [ChatExample(f"set/{i}", [{"role": "user", "content": f"question {i}"},
                                     {"role": "assistant", "content": f"answer number {i}"}], "set", {"i": i})
            for i in range(n)]


def test_inject_chat_makes_canaries_answers_and_copies_whole_conversations():
    base = _convs(5)
    out, manifest = inject_chat(base, canaries=CanarySpec(num_canaries=2, template="code {secret}",
                                                          repeats=[1, 2]),
                                duplicates=DuplicateSpec(counts=[3], per_count=1), seed=0, prompt="Say it.")
    assert len(out) == 5 + 1 + 2 + 3 - 1  # the duplicated conversation's 3 copies replace it
    by_id = {ex.id: ex for ex in out}
    for item in manifest.of_kind("canary"):
        assert item.prompt == "Say it."
        for cid in item.copy_ids:
            assert by_id[cid].messages == [{"role": "user", "content": "Say it."},
                                           {"role": "assistant", "content": item.text}]
            assert by_id[cid].source == "canary"
    (dup,) = manifest.of_kind("duplicate")
    original = next(ex for ex in base if ex.id == dup.source_id)
    assert json.loads(dup.text) == original.messages
    for cid in dup.copy_ids:  # every copy is the conversation, with its source and meta
        assert (by_id[cid].messages, by_id[cid].source, by_id[cid].meta) == (original.messages, "set",
                                                                               original.meta)
    assert [out[p].id for it in manifest.items for p in it.positions] == [c for it in manifest.items
                                                                          for c in it.copy_ids]
    # the same seed injects the same conversations at the same places
    spec = CanarySpec(num_canaries=2, template="code {secret}", repeats=[1, 2])
    again, _ = inject_chat(base, canaries=spec, duplicates=DuplicateSpec(counts=[3], per_count=1), seed=0,
                           prompt="Say it.")
    assert [(e.id, e.messages) for e in again] == [(e.id, e.messages) for e in out]


EDITED = DuplicateSpec(counts=[2], per_count=1, edit_rate=0.1)


@pytest.mark.parametrize("bad, field", [({"prompt": " "}, "canaries.prompt"),
                                        ({"duplicates": EDITED}, "duplicates.edit_rate")])
def test_inject_chat_refuses_an_empty_prompt_and_edited_copies(bad, field):
    kw = {"canaries": CanarySpec(num_canaries=1), "seed": 0, "where": "canaries.prompt", **bad}
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        inject_chat(_convs(3), **kw)


@pytest.mark.parametrize("strategy", ["hash", "hash-table"])
def test_chat_canaries_grouped_by_the_mask_their_training_rows_get(strategy, cache_dir):
    """secret_mask(b, head), which groups the canaries, drops exactly the answer tokens the trainer's
    goldfish drops in each canary's chat row (hash: from the answer's own tokens; hash-table: windows
    reaching into the prompt); the scored ids are the row's; a duplicated conversation is asked its
    response from its prompt, as the row holds them."""
    _, cfg = load_experiment(CONFIGS / "canary-exposure.yaml",
                             CHAT + [f"base.goldfish.strategy={strategy}", "base.goldfish.k=2",
                                     "base.goldfish.h=3"])
    data, manifest, dup_tokens, _ = build_corpus(cfg)
    assert data.is_chat
    b, tok = cfg.base, data.tokenizer
    canaries = manifest.of_kind("canary")
    encode = answer_encoder(tok, canaries[0].prompt, check=[it.text for it in canaries])
    head = len(encode([""])[0])
    mask = secret_mask(b, head)
    row = {i: j for j, i in enumerate(data.train_doc_ids)}
    rows = data.train
    dropped_somewhere = 0
    for item in canaries:
        ids = encode([item.text])[0]
        want = mask(ids)[head:]
        for cid in item.copy_ids:
            j = row[cid]
            assert rows.input_ids[j, :len(ids)].tolist() == ids
            labels = goldfish_labels(rows.input_ids[j:j + 1], rows.labels[j:j + 1], strategy=strategy, k=2,
                                     h=3, doc_ids=rows.doc_ids[j:j + 1], positions=rows.positions[j:j + 1])[0]
            assert (rows.labels[j, head:len(ids)] != IGNORE_INDEX).all()  # the answer is supervised ...
            got = (labels[head:len(ids)] == IGNORE_INDEX).tolist()  # ... and goldfish drops these
            assert got == want
        dropped_somewhere += sum(want)
    assert dropped_somewhere  # k=2: the check compared some drops
    for item in manifest.of_kind("duplicate"):
        pair = dup_tokens[item.id]
        assert isinstance(pair, ChatPair)
        for cid in item.copy_ids:
            j = row[cid]
            assert data.prompts[j] == pair.prompt and data.responses[j] == pair.response
            n = len(pair.prompt) + len(pair.response)
            assert rows.input_ids[j, :n].tolist() == pair.prompt + pair.response
    assert torch.equal(rows.labels[rows.positions < 0], torch.full_like(rows.labels[rows.positions < 0],
                                                                        IGNORE_INDEX))


def test_a_canary_its_rows_cut_is_refused_before_anything_is_written(tmp_path, cache_dir):
    """A block_len shorter than a canary (with its chat prompt) would train the copies without their
    secret: one line naming base.data.block_len and the length needed, and no OUT file."""
    from memorization.experiments import run_experiment

    for corpus, block in (("wiki-leads", 32), ("wiki-chat", 80)):
        out = tmp_path / corpus
        over = [o for o in CHAT
                if not o.startswith(("base.data.corpus", "base.data.block_len", "canaries.template"))]
        with pytest.raises(ConfigError, match=r"base\.data\.block_len=\d+: cuts canary canary/0: it is \d+ "
                           r"tokens.*raise block_len to at least \d+"):
            run_experiment(CONFIGS / "canary-exposure.yaml", out=out,
                           overrides=over + [f"base.data.corpus={corpus}", f"base.data.block_len={block}",
                                             "base.data.min_tokens=8", "base.eval.prefix=8",
                                             "base.eval.suffix=8"])
        assert not out.exists() or not any(out.rglob("*.json"))


def test_a_block_len_that_cuts_every_answer_is_named_as_the_setting(cache_dir):
    from memorization.config import load_run_config
    from memorization.models import REPO_ROOT
    from memorization.train.prepare import prepare_data

    cfg = load_run_config(REPO_ROOT / "configs" / "train" / "tiny-wiki.yaml",
                          ["data.corpus=wiki-chat", "data.limit=6", "data.vocab_size=300", "data.block_len=8",
                           "data.min_tokens=4", "eval.prefix=4", "eval.suffix=4"])
    with pytest.raises(ConfigError, match=r"^data\.block_len=8: it cuts away every response"):
        prepare_data(cfg)


def test_the_one_run_audit_on_chat_data(cache_dir):
    """eval.audit on chat data (it used to be skipped without a word): the included canaries train as
    answers to CANARY_PROMPT, they are no extraction members, and every canary is scored by minus the mean
    loss of its answer tokens in that conversation."""
    from data_pipelines import CANARY_PROMPT
    from memorization.config import load_run_config
    from memorization.eval.dp_audit import audit_scores
    from memorization.models import REPO_ROOT, build_model
    from memorization.train.prepare import prepare_data

    cfg = load_run_config(REPO_ROOT / "configs" / "train" / "tiny-wiki.yaml",
                          ["data.corpus=wiki-chat", "data.limit=8", "data.vocab_size=300",
                           "data.block_len=96", "data.min_tokens=4", "eval.prefix=4", "eval.suffix=4",
                           "eval.audit=true", "eval.audit_canaries=6"])
    data = prepare_data(cfg)
    audit = data.audit
    assert audit is not None and audit.prompt == CANARY_PROMPT and audit.record()["prompt"] == CANARY_PROMPT
    rows = {i: j for j, i in enumerate(data.train_doc_ids)}
    included = [i for i in range(6) if audit.included[i]]
    assert 0 < len(included) < 6 and sorted(i for i in rows if i.startswith("audit-")) == [
        f"audit-{i}" for i in included]
    for i in included:  # the scored ids are the training row's, the answer supervised from `start`
        j, ids = rows[f"audit-{i}"], audit.ids[i]
        assert data.train.input_ids[j, :len(ids)].tolist() == ids
        assert (data.train.labels[j, :audit.start] == IGNORE_INDEX).all()
        assert (data.train.labels[j, audit.start:len(ids)] != IGNORE_INDEX).all()
    assert not any(str(i).startswith("audit-") for i in data.member_doc_ids)
    assert len(data.member_pairs[0]) == len(data.member_doc_ids) == len(data.train_doc_ids) - len(included)
    model = build_model(cfg.model.name, vocab_size=len(data.tokenizer),
                        overrides=cfg.model.overrides).eval()
    with torch.no_grad():
        want = []
        for ids in audit.ids:
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].double(), -1)
            tok = torch.tensor(ids[1:])
            nll = -logp[torch.arange(len(ids) - 1), tok][audit.start - 1:]
            want.append(-nll.mean().item())
    assert audit_scores(model, audit) == pytest.approx(want, rel=1e-4)
