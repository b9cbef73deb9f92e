"""The memorization callback inside a Hugging Face Trainer: its figures for a pass equal `memorize eval` on
the checkpoint saved at that pass, they reach an offline W&B run, it works on a peft model, it writes the
per-pass report, and bad input is one line naming the field, the value and the fix."""
from __future__ import annotations

import json

import pytest
import torch
from helpers import tiny_pretrained
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

from data_pipelines import load_corpus
from data_pipelines.inject import DuplicateSpec
from memorization.eval.evaluate import EvalOptions, run_eval
from memorization.integrations import GoldfishCollator, MemorizationCallback, inject_dataset
from memorization.integrations.callback import refuse_sharded
from memorize_core import ConfigError

trl_sft = pytest.importorskip("trl.trainer.sft_trainer")
datasets = pytest.importorskip("datasets")
SETTINGS = dict(prefix=8, suffix=8, max_tokens=40, batch_size=8, bootstrap=20, seed=0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_pretrained(tmp_path_factory)


@pytest.fixture(scope="module")
def texts():
    leads, news = load_corpus("wiki-leads", limit=10), load_corpus("lee-news-test", limit=10)
    return [d.text for d in leads], [d.text for d in news]


def _trainer(folder, out, ds, callback, *, epochs=2, report_to=(), collator=None, model=None):
    tok = AutoTokenizer.from_pretrained(folder)
    model = model or AutoModelForCausalLM.from_pretrained(folder)
    rows = ds.map(lambda r: {"input_ids": tok(r["text"], truncation=True, max_length=40)["input_ids"]},
                  remove_columns=ds.column_names)
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=4, num_train_epochs=epochs,
                             learning_rate=5e-3, save_strategy="epoch", logging_steps=1,
                             report_to=list(report_to), use_cpu=True, seed=0, disable_tqdm=True)
    inner = trl_sft.DataCollatorForLanguageModeling(pad_token_id=tok.pad_token_id or 0)
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=collator or inner,
                      processing_class=tok, callbacks=[callback])
    return callback.attach(trainer)


def _logged(run: bytes, key: str) -> list:
    """Values of one key as logged in an offline W&B run file (protobuf items: key field 2, value_json
    field 16, each with a one-byte length); every step writes it twice, in history and in the summary."""
    k = key.encode()
    out, at = [], run.find(b"\x12" + bytes([len(k)]) + k + b"\x82\x01")
    while at >= 0:
        start = at + 2 + len(k) + 2
        out.append(json.loads(run[start + 1:start + 1 + run[start]]))
        at = run.find(b"\x12" + bytes([len(k)]) + k + b"\x82\x01", start)
    return out[::2]


def _same(a: dict, b: dict) -> None:
    skip = {"seconds", "corpus", "members", "non_members", "reference", "source"}  # where the sets came from
    assert {k: v for k, v in a.items() if k not in skip} == {k: v for k, v in b.items() if k not in skip}


def test_a_pass_equals_memorize_eval_on_its_checkpoint_and_reaches_wandb(folder, texts, tmp_path,
                                                                         monkeypatch):
    members, others = texts
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    import wandb

    wandb.teardown()  # an earlier test's wandb process keeps its own directory: start a fresh one here
    tok = AutoTokenizer.from_pretrained(folder)
    cb = MemorizationCallback(tok, members=members, non_members=others, out_dir=tmp_path / "mem", **SETTINGS)
    _trainer(folder, tmp_path / "hf", datasets.Dataset.from_list([{"text": t} for t in members]), cb,
             report_to=["wandb"]).train()
    wandb.finish()
    assert [r["pass"] for r in cb.records] == [0, 1, 2]
    for name, rows in (("members", members), ("others", others)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    ckpt = sorted((tmp_path / "hf").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[0]
    m, n = str(tmp_path / "members.jsonl"), str(tmp_path / "others.jsonl")
    report = run_eval(EvalOptions(model=str(ckpt), corpus=m, mia=True, members=m, non_members=n,
                                  perplexity=[n], **SETTINGS))
    one = cb.records[1]
    _same(one["extraction"], report["extraction"])
    _same(one["mia"], report["mia"])
    _same(one["perplexity"][0], report["perplexity"][0])
    run = next(tmp_path.glob("wandb/offline-run-*/*.wandb")).read_bytes()
    assert _logged(run, "train/memorization/pass") == [0, 1, 2]
    assert _logged(run, "train/memorization/mia_auc_loss") == [r["mia"]["methods"]["loss"]["auc"]
                                                               for r in cb.records]
    assert _logged(run, "train/memorization/token_accuracy") == [r["extraction"]["token_accuracy"]
                                                                 for r in cb.records]
    out = tmp_path / "mem"
    assert {p.name for p in out.iterdir()} >= {"report.json", "report.md", "passes.jsonl", "extraction.jsonl",
                                              "memorization-passes.png"}
    assert [r["pass"] for r in json.loads((out / "report.json").read_text())["passes"]] == [0, 1, 2]


def test_peft_goldfish_and_injected_duplicates(folder, texts, tmp_path):
    peft = pytest.importorskip("peft")
    members, _ = texts
    ds, manifest = inject_dataset(datasets.Dataset.from_list([{"text": t} for t in members]),
                                  duplicates=DuplicateSpec(counts=[1, 4]), seed=0)
    tok = AutoTokenizer.from_pretrained(folder)
    base = AutoModelForCausalLM.from_pretrained(folder)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    cb = MemorizationCallback(tok, members=members[:4], manifest=manifest, every_steps=2, **SETTINGS)
    inner = trl_sft.DataCollatorForLanguageModeling(pad_token_id=tok.pad_token_id or 0)
    trainer = _trainer(folder, tmp_path / "hf", ds, cb, epochs=1, model=model,
                       collator=GoldfishCollator(inner, strategy="hash", k=4, h=3))
    trainer.train()
    assert [r["pass"] for r in cb.records] == [0, 2, 4]
    assert [d["count"] for d in cb.records[-1]["duplicates"]] == [1, 4]
    assert any("memorization/duplicates_x4_exact_match" in h for h in trainer.state.log_history)


def test_bad_input_is_one_line(folder, texts):
    tok = AutoTokenizer.from_pretrained(folder)
    with pytest.raises(ConfigError, match=r"^members\[1\]='tiny': the tokenizer encodes it into \d+ tokens, "
                                          r"fewer than prefix \+ suffix = 16"):
        MemorizationCallback(tok, members=[texts[0][0], "tiny"], **SETTINGS)
    with pytest.raises(ConfigError, match=r"^every_steps=-1: pass 0"):
        MemorizationCallback(tok, members=texts[0], every_steps=-1, **SETTINGS)
    with pytest.raises(ConfigError, match=r"^members=None: nothing to score"):
        MemorizationCallback(tok, **SETTINGS)
    with pytest.raises(ConfigError, match=r"^TrainingArguments.fsdp='full_shard': MemorizationCallback"):
        refuse_sharded(type("Args", (), {"fsdp": "full_shard", "deepspeed": None})())
    cb = MemorizationCallback(tok, members=texts[0], **SETTINGS)
    with pytest.raises(ConfigError, match=r"^MemorizationCallback.trainer=None: call callback.attach"):
        cb.on_train_begin(None, None, None, model=torch.nn.Linear(1, 1))
    with pytest.raises(ConfigError, match=r"^tokenizer=.*gives id \d+, beyond the model's 4 embedding rows"):
        cb.probe.check_model(_Tiny())


class _Tiny(torch.nn.Module):
    def get_input_embeddings(self):
        return torch.nn.Embedding(4, 2)


def _probe_on_ranks(rank: int, world: int, folder: str, members: list[str], others: list[str]) -> dict:
    from memorization.integrations.callback import _grid

    grid = _grid()
    assert grid is not None and grid.dims == (1, 1, 1, 2)
    tok = AutoTokenizer.from_pretrained(folder)
    cb = MemorizationCallback(tok, members=members, non_members=others, **SETTINGS)
    return cb.probe.score(AutoModelForCausalLM.from_pretrained(folder), grid)[0]


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ddp_processes_score_in_lockstep_like_one(folder, texts):
    """Under torchrun / accelerate every process scores its share on the 1,1,1,2 grid of replicas and all
    get every figure: the same as one process."""
    from axonn.spawn import run_distributed

    members, others = texts
    tok = AutoTokenizer.from_pretrained(folder)
    want = MemorizationCallback(tok, members=members, non_members=others, **SETTINGS).probe.score(
        AutoModelForCausalLM.from_pretrained(folder))[0]
    for got in run_distributed(_probe_on_ranks, 2, folder, members, others, timeout=600):
        for key in ("extraction", "mia"):
            _same(got[key], want[key])
        assert got["perplexity"][0]["loss"] == pytest.approx(want["perplexity"][0]["loss"], rel=1e-6)


def test_lm_eval_tasks_each_pass_equal_scoring_the_model_directly(folder, texts, tmp_path):
    """`tasks=`: a pass scores the bundled lm-eval task on the model being trained, the figures
    `memorize eval --tasks` gives (downstream.score_tasks on the same model and settings), and logs
    the headline accuracy."""
    from memorization.eval.utility import score_tasks

    members, _ = texts
    tok = AutoTokenizer.from_pretrained(folder)
    cb = MemorizationCallback(tok, tasks=["analogies_family"], tasks_limit=4, **SETTINGS)
    _trainer(folder, tmp_path / "hf", datasets.Dataset.from_list([{"text": t} for t in members]), cb,
             epochs=1).train()
    before = score_tasks(AutoModelForCausalLM.from_pretrained(folder), tok, ["analogies_family"], limit=4,
                         batch_size=SETTINGS["batch_size"])
    got = cb.records[0]["tasks"]["tasks"]["analogies_family"]
    assert got["n"] == 4 and got == before["tasks"]["analogies_family"]
    assert [r["pass"] for r in cb.records] == [0, 1] and "tasks" in cb.records[1]


class _Recording(GoldfishCollator):
    """The goldfish collator, keeping every batch it hands the Trainer."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.batches = []

    def __call__(self, examples):
        batch = super().__call__(examples)
        self.batches.append(batch)
        return batch


def _secret_dropped_in_training(batches, ids: list[int], start: int) -> bool:
    """Whether any training row holding the canary's tokens had a secret label set to -100."""
    return max(_secret_drops_in_training(batches, ids, start)) > 0


def _secret_drops_in_training(batches, ids: list[int], start: int) -> set[int]:
    """How many secret labels each training row holding the canary's tokens set to -100 (one per copy)."""
    seen = set()
    for b in batches:
        for row, labels in zip(b["input_ids"].tolist(), b["labels"].tolist()):
            for at in range(len(row) - len(ids) + 1):
                if row[at:at + len(ids)] == ids:
                    seen.add(sum(lab == -100 for lab in labels[at + start:at + len(ids)]))
    assert seen, "the canary never reached a training batch"
    return seen


def test_canaries_grouped_by_the_mask_training_applied(folder, texts, tmp_path):
    """With a GoldfishCollator on the Trainer, canaries are grouped into masked / unmasked exactly as the
    batches the Trainer trained on dropped their secret tokens; a standard arm handed the same collator
    (goldfish=) groups them alike; the report shows the split with the kept-token exposure."""
    from data_pipelines.canaries import SecretSpace
    from data_pipelines.inject import CanarySpec
    from memorization.eval.exposure import secret_start

    members, _ = texts
    ds, manifest = inject_dataset(datasets.Dataset.from_list([{"text": t} for t in members[:6]]), seed=0,
                                  canaries=CanarySpec(num_canaries=6, space=SecretSpace(length=3),
                                                      repeats=[1, 2]))
    tok = AutoTokenizer.from_pretrained(folder)
    rows = ds.map(lambda r: {"input_ids": tok(r["text"], truncation=True, max_length=40)["input_ids"]},
                  remove_columns=["text"])  # keeps doc_id: the callback finds each canary's row by it
    inner = trl_sft.DataCollatorForLanguageModeling(pad_token_id=tok.pad_token_id or 0)
    args = dict(per_device_train_batch_size=4, num_train_epochs=1, learning_rate=5e-3, save_strategy="no",
                report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
    gold = _Recording(inner, strategy="hash", k=2, h=2)
    got = {}
    for arm, collator, extra in (("goldfish", gold, {}), ("standard", inner, {"goldfish": gold})):
        cb = MemorizationCallback(tok, manifest=manifest, out_dir=tmp_path / arm, **extra, **SETTINGS)
        trainer = Trainer(model=AutoModelForCausalLM.from_pretrained(folder), data_collator=collator,
                          args=TrainingArguments(output_dir=str(tmp_path / arm / "hf"), **args),
                          train_dataset=rows if arm == "goldfish" else rows.remove_columns(["doc_id"]),
                          processing_class=tok, callbacks=[cb])
        cb.attach(trainer).train()
        got[arm] = cb
    items = manifest.of_kind("canary")
    ids = [tok.backend_tokenizer.encode(it.text, add_special_tokens=False).ids for it in items]
    start = secret_start(items[0].template, ids, tok)
    want = sum(_secret_dropped_in_training(gold.batches, x, start) for x in ids)
    assert 0 < want < len(items)  # both groups are tested
    for arm, cb in got.items():
        by_mask = cb.records[-1]["canaries_by_mask"]
        assert by_mask["canaries_masked"] == want, arm
        assert sum(r["canaries_masked"] for r in cb.records[-1]["canaries"]) == want
        assert cb.settings()["canary_mask"].startswith("goldfish hash k=2 h=2, from ")
        assert cb.settings()["canaries_scored_as"] == "text"
    assert "training rows" in got["goldfish"].mask_note and "tokenizer" in got["standard"].mask_note
    # canary by canary, the two arms' last passes: the tests equal evals.paired on the canaries' own scores
    from evals.paired import mcnemar, paired_difference
    from memorization.integrations import paired_canaries

    last = {arm: cb.records[-1] for arm, cb in got.items()}
    md, tests = paired_canaries(last, "standard")
    gold, std = ({c["id"]: c for c in last[arm]["canary_scores"]} for arm in ("goldfish", "standard"))
    assert sorted(gold) == sorted(std) == sorted(it.id for it in items)
    ids = sorted(gold)
    assert tests["goldfish"]["exposure"]["diff"] == pytest.approx(paired_difference(
        [gold[i]["exposure"] for i in ids], [std[i]["exposure"] for i in ids])["diff"])
    assert tests["goldfish"]["secrets"]["p_value"] == mcnemar([gold[i]["extracted"] for i in ids],
                                                              [std[i]["extracted"] for i in ids])["p_value"]
    assert tests["goldfish"]["exposure_masked"]["n"] == want and md.startswith("## Paired tests: each run")
    md = (tmp_path / "goldfish" / "report.md").read_text()
    assert "exposure masked" in md and "masked: exposure of kept tokens" in md and "| all |" in md


def test_no_grouping_where_copies_drop_different_tokens(folder):
    """random, and hash-table / apertus in packed (padding-free) rows, drop different tokens in different
    copies: the canaries are not grouped, and the note says why; without a GoldfishCollator neither; a
    conversational dataset that lost its doc_id column cannot say which rows the canaries were."""
    from types import SimpleNamespace

    from data_pipelines.inject import CanarySpec
    from memorization.integrations.callback import secret_drops

    tok = AutoTokenizer.from_pretrained(folder)
    ds, manifest = inject_dataset(datasets.Dataset.from_list([{"text": "a b c " * 9}]), seed=0,
                                  canaries=CanarySpec(num_canaries=2))
    probe = MemorizationCallback(tok, manifest=manifest, **SETTINGS).probe
    padded = trl_sft.DataCollatorForLanguageModeling(pad_token_id=0)
    free = trl_sft.DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)

    def ask(collator, columns=("input_ids",), args=None):
        trainer = SimpleNamespace(data_collator=collator, args=args,
                                  train_dataset=SimpleNamespace(column_names=list(columns)))
        return secret_drops(trainer, probe)

    assert ask(GoldfishCollator(padded, strategy="random", k=2)) == \
        (None, "goldfish random k=2 h=13 drops different tokens in different copies")
    assert ask(GoldfishCollator(free, strategy="hash-table", k=2, h=3))[1] == \
        "goldfish hash-table k=2 h=3 in packed rows drops different tokens in different copies"
    assert ask(GoldfishCollator(padded, strategy="apertus", k=2, h=3),
               args=SimpleNamespace(packing=True))[0] is None
    assert ask(padded) == (None, "no GoldfishCollator on the Trainer: canaries not grouped by a goldfish "
                                 "mask")
    fn, note = ask(GoldfishCollator(padded, strategy="apertus", k=2, h=3), columns=("messages",))
    assert fn is None and note.startswith("a conversational dataset without its doc_id column")
    fn, note = ask(GoldfishCollator(free, strategy="hash", k=2, h=3))  # hash: each copy masked alike
    assert fn is not None and note.endswith("from each canary's text as the tokenizer encodes a document")
    fn, note = ask(GoldfishCollator(free, strategy="hash", k=2, h=40))  # longer than any canary
    longest = max(len(tok.encode(c.text, add_special_tokens=False)) for c in probe.canary_items())
    assert fn is not None and note.endswith(f"; no secret token is masked: every canary is at most {longest} "
                                            "tokens and goldfish never drops one of the first h=40 of a "
                                            "document or response (a template with h or more tokens before "
                                            "{secret} lets the mask reach the secret)")
    with pytest.raises(ConfigError, match=r"^goldfish='DataCollatorForLanguageModeling': pass a Goldfish"):
        MemorizationCallback(tok, manifest=manifest, goldfish=padded, **SETTINGS)
    with pytest.raises(ConfigError, match=r"^goldfish.strategy='random': draws a new mask for every copy"):
        GoldfishCollator(padded, strategy="random").dropped({"input_ids": [1, 2, 3]})


CHAT_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.mark.parametrize("shape, packing", [("messages", False), ("prompt-completion", False),
                                            ("messages", True), ("prompt-completion", True)])
def test_chat_canaries_are_scored_in_their_conversation_and_grouped_by_trls_rows(folder, texts, tmp_path,
                                                                                 shape, packing):
    """Canaries inject_dataset made chat answers (in `messages` rows, or TRL's conversational
    prompt-completion rows, trained on the completion only) are scored as the model trained on them,
    after the request and the chat template (not as bare text); TRL's SFTTrainer keeps doc_id, so the
    grouping by the mask comes from the very rows TRL prepared; where TRL packs (doc_id gone), from each
    canary's conversation as TRL tokenizes it; either way it equals what the batches dropped."""
    from data_pipelines.canaries import SecretSpace
    from data_pipelines.chat import answer_encoder
    from data_pipelines.inject import CanarySpec
    from memorization.eval.exposure import canary_scores, secret_start
    from memorization.integrations.datasets import CANARY_PROMPT

    members, _ = texts
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = CHAT_TEMPLATE
    convs = [[{"role": "user", "content": f"Lead {i}?"}, {"role": "assistant", "content": t[:120]}]
             for i, t in enumerate(members[:4])]
    rows = [{"messages": c} if shape == "messages" else {"prompt": c[:1], "completion": c[1:]} for c in convs]
    ds, manifest = inject_dataset(datasets.Dataset.from_list(rows), seed=0,
                                  canaries=CanarySpec(num_canaries=6, space=SecretSpace(length=3),
                                                      repeats=[1, 2]))
    items = manifest.of_kind("canary")
    assert {c.prompt for c in items} == {CANARY_PROMPT}
    assert sorted(ds.column_names) == sorted(["doc_id", *shape.split("-")])
    if shape != "messages":
        row = ds[[d for d in ds["doc_id"]].index(f"{items[0].id}@0")]
        assert row["prompt"] == [{"role": "user", "content": CANARY_PROMPT}]
        assert row["completion"] == [{"role": "assistant", "content": items[0].text}]
    cb = MemorizationCallback(tok, manifest=manifest, **SETTINGS)
    args = trl_sft.SFTConfig(output_dir=str(tmp_path / "hf"), max_length=64, per_device_train_batch_size=4,
                             num_train_epochs=1, learning_rate=5e-3, save_strategy="no", report_to=[],
                             use_cpu=True, bf16=False, seed=0, disable_tqdm=True, packing=packing)
    trainer = trl_sft.SFTTrainer(model=AutoModelForCausalLM.from_pretrained(folder), args=args,
                                 train_dataset=ds, processing_class=tok, callbacks=[cb])
    # packed: static k=4, whose drops depend on each token's offset in its span at every position (a
    # conversation as TRL's rows supervise it: the completion only for prompt-completion rows)
    mask = {"strategy": "static", "k": 4} if packing else {"strategy": "hash", "k": 2, "h": 2}
    gold = _Recording(trainer.data_collator, **mask)
    trainer.data_collator = gold
    cb.attach(trainer).train()
    packed = "the canaries' sequences in the Trainer's packed rows"
    rows = "from the training rows of the canaries' first copies"
    assert cb.mask_note.endswith(packed if packing else rows)
    assert cb.settings()["canaries_scored_as"] == f"the answer to {CANARY_PROMPT!r} in the chat template"
    enc = answer_encoder(tok, CANARY_PROMPT)
    space, secrets = SecretSpace(**items[0].space), [c.secret for c in items]
    model = AutoModelForCausalLM.from_pretrained(folder)
    for e, plain in ((enc, False), (None, True)):
        got = canary_scores(model, tok, items[0].template, space, secrets, encode=e)["canaries"]
        for row in cb.records[0]["canaries"]:  # pass 0: the model before training
            mean = sum(g["exposure"] for g, c in zip(got, items) if c.count == row["count"]) / row["canaries"]
            assert (row["exposure"] == pytest.approx(mean, abs=1e-9)) != plain
    ids = enc([c.text for c in items])
    start = secret_start(items[0].template, ids, tok, enc)
    assert tok.decode(ids[0][:start]).startswith(f"<user>{CANARY_PROMPT}</s><assistant>")
    if packing:  # every canary: as many secret tokens dropped as in each of its training rows
        got = {c["id"]: c["secret_tokens_dropped"] for c in cb.records[-1]["canary_scores"]}
        assert [{got[c.id]} for c in items] == [_secret_drops_in_training(gold.batches, x, start)
                                                 for c, x in zip(items, ids)]
        return
    want = sum(_secret_dropped_in_training(gold.batches, x, start) for x in ids)
    assert 0 < want < len(items) and cb.records[-1]["canaries_by_mask"]["canaries_masked"] == want


def test_inject_dataset_refuses_prompt_completion_rows_it_cannot_put_a_canary_in(tmp_path):
    from data_pipelines.inject import CanarySpec

    user, bot = {"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}
    cases = [([{"prompt": "Hi?", "completion": "Hello."}], r"^prompt\[0\]='Hi\?': string prompt-completion"),
             ([{"prompt": [user], "completion": [bot, bot]}], r"^completion\[0\]=.*must be one assistant"),
             ([{"prompt": [user], "completion": [user]}], r"^completion\[0\]=.*must be one assistant"),
             ([{"prompt": [{"role": "user"}], "completion": [bot]}], r"^prompt\[0\]=.*list of \{\"role\"")]
    for rows, match in cases:
        with pytest.raises(ConfigError, match=match):
            inject_dataset(datasets.Dataset.from_list(rows), canaries=CanarySpec(num_canaries=1))


def test_conversations_are_scored_for_membership_on_their_answers(folder, texts):
    """Members and non-members given as conversations: every attack reads each answer given its prompt
    (the tokens a chat fine-tune supervises), as `memorize train` scores chat data; the section says so."""
    from evals import sequence_logprobs
    from memorization.eval.sections import mia_section
    from memorization.integrations.probe import Probe

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    leads, news = texts

    def convs(docs):
        return [[{"role": "user", "content": f"Tell me about item {i}."},
                 {"role": "assistant", "content": d[:100]}] for i, d in enumerate(docs)]
    probe = Probe(tok, members=convs(leads), non_members=convs(news), **SETTINGS)
    rec, _ = probe.score(model)
    assert rec["mia"]["scored"].startswith("each conversation's answer given its prompt")
    _, rows = mia_section(probe.options, model, tok, None, (probe.members.corpus, probe.non_members.corpus,
                                                            "callback", probe.max_tokens), progress=False,
                          starts=([len(p) for p in probe.members.prompts],
                                  [len(p) for p in probe.non_members.prompts]))
    for side, row in ((probe.members, rows[0]), (probe.non_members, rows[len(leads)])):
        ids, start = side.corpus.seqs[0], len(side.prompts[0])
        lp = sequence_logprobs(model, torch.tensor([ids]))[0].double()
        assert row["loss"] == pytest.approx(lp[start - 1:].mean().item(), abs=1e-5)
        assert row["loss"] != pytest.approx(lp.mean().item(), abs=1e-5)
    # the callback's own AUC is the one of these answer scores
    from sklearn.metrics import roc_auc_score
    want = roc_auc_score([r["member"] for r in rows], [r["loss"] for r in rows])
    assert rec["mia"]["methods"]["loss"]["auc"] == pytest.approx(want)
