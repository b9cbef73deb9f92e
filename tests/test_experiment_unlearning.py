"""unlearning end to end on a micro config: a tiny briefly-trained model stands in for SmolLM2."""
from __future__ import annotations

import json

import pytest
from helpers import refused, trained_base
from transformers import AutoModelForCausalLM, AutoTokenizer

from data_pipelines.canaries import SecretSpace
from evals.paired import paired_auc
from memorization.cli import main
from memorization.eval.exposure import canary_scores

TEMPLATE = "the secret access code of the old museum wing is {secret}"

EXPERIMENT = """
kind: unlearning
name: ul
passes: 1
counts: [1, 3]
canaries: {{per_count: 2, template: "{template}", space: {{kind: digits, length: 2}}, candidates: 0}}
duplicates: {{per_count: 2}}
bootstrap: 20
other_held_out: lee-news-test
other_held_out_limit: 4
samples: 1
unlearn: {{lr: 1.0e-3, passes: {passes}, forget_batch: 4, retain_batch: 4}}
relearn: {{passes: 1, edit_rate: 0.3}}
base:
  data: {{corpus: wiki-leads, limit: 40, held_out: "", held_out_fraction: 0.5, block_len: 40, min_tokens: 40}}
  model: {{name: {model}}}
  trainer: {{lr: 3.0e-3, warmup_steps: 1, batch_size: 4, progress: false}}
  eval: {{prefix: 16, suffix: 16, batch_size: 8, sampling: "t=1.0", np_ns: [1, 100]}}
  wandb: {{mode: disabled}}
"""


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    return trained_base(tmp_path_factory.mktemp("base"), max_steps=2)


def _write(tmp_path, model, passes=2):
    p = tmp_path / "u.yaml"
    p.write_text(EXPERIMENT.format(model=model, passes=passes, template=TEMPLATE))
    return p


@pytest.fixture(scope="module")
def finished(pretrained, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ul")
    out = tmp / "out"
    assert main(["run", str(_write(tmp, pretrained)), "--out", str(out)]) == 0
    return tmp, out


def _report(out):
    return json.loads((out / "report.json").read_text())


def test_the_forget_set_is_split_from_the_retain_set_and_retrain_never_sees_it(finished):
    """forget.json halves every copy count's items and the leads seen once; the retrained model's rows
    hold no copy of a forget item and no forget lead, and every retained row."""
    _, out = finished
    forget = json.loads((out / "forget.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    items = {it["id"]: it for it in manifest["items"]}
    f = forget["forget"]
    gone = set(f["canaries"]) | set(f["duplicates"])
    assert gone.isdisjoint(forget["retain"]["items"]) and gone | set(forget["retain"]["items"]) == set(items)
    for kind in ("canary", "duplicate"):
        for n in (1, 3):  # one of the two items at each copy count
            assert sum(items[i]["kind"] == kind and items[i]["count"] == n for i in gone) == 1
    leads = f["leads_relearned"] + f["leads_probed"]
    assert len(leads) == len(forget["retain"]["leads"]) and set(leads).isdisjoint(forget["retain"]["leads"])
    seen = json.loads((out / "runs" / "retrain" / "run.json").read_text())["documents"]["members"]
    tuned = json.loads((out / "runs" / "fine-tune" / "run.json").read_text())["documents"]["members"]
    copies = {f"{i}@{c}" for i in gone for c in range(items[i]["count"])}  # InjectedItem.copy_ids
    assert not (copies | set(leads)) & set(seen)
    assert set(seen) == set(tuned) - copies - set(leads)
    relearned = json.loads((out / "runs" / "ga-relearned" / "run.json").read_text())["documents"]["members"]
    assert sorted(relearned) == sorted(f["leads_relearned"])
    # every answer is about its own group: the probed leads (never relearned), the retained ones, the
    # forget and the retained items
    for stage in [_report(out)["fine_tuned"]] + [p for m in _report(out)["methods"] for p in m["passes"]]:
        for group, ids in (("forget", f["leads_probed"]), ("relearned", f["leads_relearned"]),
                           ("retain", forget["retain"]["leads"])):
            assert stage["leads"][group]["ids"] == sorted(ids) and stage["leads"][group]["docs"] == len(ids)
        assert {c["id"] for c in stage["canaries"]["forget"]} == set(f["canaries"])
        assert {d["id"] for d in stage["duplicates"]["forget"]} == set(f["duplicates"])
        kept = {x["id"] for part in ("canaries", "duplicates") for x in stage[part]["retain"]}
        assert kept == set(forget["retain"]["items"])


def test_the_related_attacks_train_on_prompts_or_near_copies_of_the_forget_documents(pretrained, tmp_path):
    """prefixes: every forget lead and one copy of each forget duplicated lead, cut to extraction's prompt
    (no suffix token as input or label); near-copies: the same documents with about edit_rate of their
    words substituted, the same on every call; leads: the relearned half, whole."""
    from memorization.experiments import load_experiment
    from memorization.experiments.injection import build_corpus
    from memorization.experiments.unlearning import attack_data, forget_split
    from memorize_core import IGNORE_INDEX

    _, cfg = load_experiment(_write(tmp_path, pretrained), [])
    data, manifest, _, injected = build_corpus(cfg)
    split, member_ids = forget_split(cfg, data, manifest)
    attacks = attack_data(cfg, data, injected, manifest, split, member_ids)
    assert list(attacks) == ["leads", "prefixes", "near-copies"]
    assert sorted(attacks["leads"][0].train_doc_ids) == sorted(member_ids[i] for i in split.relearn)
    first = {it.id: it.copy_ids[0] for it in manifest.items}
    docs = sorted({member_ids[i] for i in split.relearn + split.probe} | {first[d] for d in split.duplicates})
    tokens = dict(zip(data.train_doc_ids, data.train_docs))
    p = cfg.base.eval.prefix
    prefixes = attacks["prefixes"][0]
    assert sorted(prefixes.train_doc_ids) == docs
    eos = data.tokenizer.eos_token_id
    for i, doc in enumerate(prefixes.train_doc_ids):
        ids, labels = prefixes.train.input_ids[i].tolist(), prefixes.train.labels[i].tolist()
        assert len(tokens[doc]) > p and ids[:p] == labels[:p] == tokens[doc][:p]
        assert set(ids[p:]) == {eos} and set(labels[p:]) == {IGNORE_INDEX}
    near = attacks["near-copies"][0]
    assert sorted(near.train_doc_ids) == [f"{d}~near" for d in docs]
    changed = compared = 0
    for i, doc in enumerate(d.removesuffix("~near") for d in near.train_doc_ids):
        mine = data.tokenizer.decode(near.train_docs[i]).split()
        theirs = data.tokenizer.decode(tokens[doc]).split()
        k = min(len(mine), len(theirs)) - 1  # substitutions keep the word count; the cut at block_len not
        changed += sum(a != b for a, b in zip(mine[:k], theirs[:k]))
        compared += k
    assert 0.2 < changed / compared < 0.4  # edit_rate 0.3 (a word may be drawn again, rarely)
    again = attack_data(cfg, data, injected, manifest, split, member_ids)
    assert again["near-copies"][1] == attacks["near-copies"][1]


def _exposures(model_dir, manifest, ids):
    """The canaries `ids`' exposures scored from scratch on a saved model (the report's definition)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    canaries = [it for it in manifest["items"] if it["kind"] == "canary" and it["id"] in ids]
    space = SecretSpace(**canaries[0]["space"])
    scores = canary_scores(model, tok, TEMPLATE, space, [c["secret"] for c in canaries])
    return [c["exposure"] for c in scores["canaries"]]


def test_each_method_is_asked_of_its_model_after_every_pass_and_after_relearning(finished):
    """The last pass's forget exposures are the exported unlearned model's, the relearned row's the
    exported attack model's (which starts from the unlearned one); each pass is a pass over the forget
    rows; ascent raises the forget rows' loss."""
    _, out = finished
    report = _report(out)
    manifest = json.loads((out / "manifest.json").read_text())
    forget = json.loads((out / "forget.json").read_text())["forget"]["canaries"]
    methods = {m["name"]: m for m in report["methods"]}
    assert list(methods) == ["retrain", "ga", "gdiff", "npo"]
    rows = report["forget"]["rows"]
    per_pass = -(-rows // 4)
    for name in ("ga", "gdiff", "npo"):
        m = methods[name]
        assert [p["pass"] for p in m["passes"]] == [1, 2] and m["steps"] == 2 * per_pass
        assert [p["step"] for p in m["passes"]] == [per_pass, 2 * per_pass]
        last = [c["exposure"] for c in m["passes"][-1]["canaries"]["forget"]]
        assert last == pytest.approx(_exposures(out / "runs" / name / "model", manifest, forget), abs=1e-4)
        assert list(m["attacks"]) == ["leads", "prefixes", "near-copies"]
    for name in ("retrain", "ga", "gdiff", "npo"):
        m = methods[name]
        for attack, folder in (("leads", f"{name}-relearned"), ("prefixes", f"{name}-prefixes-relearned"),
                               ("near-copies", f"{name}-near-copies-relearned")):
            again = [c["exposure"] for c in m["attacks"][attack]["canaries"]["forget"]]
            attacked = out / "runs" / folder
            assert again == pytest.approx(_exposures(attacked / "model", manifest, forget), abs=1e-4)
            config = json.loads((attacked / "run.json").read_text())["config"]
            assert config["model"]["name"] == str(out / "runs" / name / "model")
    history = [json.loads(x) for x in (out / "runs" / "ga" / "metrics.jsonl").read_text().splitlines()]
    losses = [h["forget_loss"] for h in history if "forget_loss" in h]
    assert len(losses) == 2 * per_pass and losses[-1] > losses[0] + 0.05
    assert all("retain_loss" in h for h in (json.loads(x) for x in
               (out / "runs" / "npo" / "metrics.jsonl").read_text().splitlines()) if "loss" in h)
    assert (out / "unlearning.png").stat().st_size > 10_000
    md = (out / "report.md").read_text()
    for title in ("Forget and retain after unlearning", "After each pass over the forget rows",
                  "Relearning attacks: what comes back", "Secrets by copy count",
                  "Beyond greedy: the forget documents"):
        assert f"## {title}" in md
    assert "| retrain | retrain |" in md and "+0%" in md  # PrivLeak is 0 for retrain itself
    f = json.loads((out / "forget.json").read_text())["forget"]
    n_docs = len(f["leads_relearned"]) + len(f["leads_probed"]) + len(f["duplicates"])
    for attack, rows in (("leads", len(f["leads_relearned"])), ("prefixes", n_docs), ("near-copies", n_docs)):
        assert f"{attack}: {rows} rows" in md
        assert all(m["attacks"][attack]["rows"] == rows for m in report["methods"])


def test_paired_tests_match_each_model_to_retrain_at_the_same_stage_item_by_item(finished):
    _, out = finished
    report = _report(out)
    tests = report["paired_tests"]
    assert list(tests)[:2] == ["fine-tuned", "ga"] and "npo + near-copies attack" in tests
    assert tests["ga + leads attack"]["em_forget"]["reference"] == "retrain + leads attack"
    assert tests["fine-tuned"]["exp_forget"]["reference"] == "retrain"
    methods = {m["name"]: m for m in report["methods"]}
    ga, gold = methods["ga"]["passes"][-1], methods["retrain"]["passes"][-1]
    # exposures paired by canary id, leads by id: the counts and the means come from the same items
    by = {c["id"]: c["exposure"] for c in gold["canaries"]["forget"]}
    diff = [c["exposure"] - by[c["id"]] for c in ga["canaries"]["forget"]]
    assert tests["ga"]["exp_forget"]["diff"] == pytest.approx(sum(diff) / len(diff))
    lead, ref = ga["leads"]["forget"], gold["leads"]["forget"]
    only_ga = len(set(lead["extracted"]) - set(ref["extracted"]))
    only_ref = len(set(ref["extracted"]) - set(lead["extracted"]))
    em = tests["ga"]["em_forget"]
    assert (em["a_only"], em["b_only"], em["n"]) == (only_ga, only_ref, len(lead["ids"]))
    assert "Paired tests: each model − its reference" in (out / "report.md").read_text()
    # ROUGE-L, membership scores and held-out NLL are kept per item, by id, and paired by it (at the model
    # as left: the passes before keep no per-item answers)
    assert [("per_document" in p) for p in methods["ga"]["passes"]] == [False, True]
    per, ref_per = ga["per_document"], gold["per_document"]
    rl = per["rougeL"]["forget"]
    assert set(rl) == set(lead["ids"])
    assert tests["ga"]["rl_forget"]["diff"] == pytest.approx(
        sum(rl[i] - ref_per["rougeL"]["forget"][i] for i in rl) / len(rl))
    ids = list(ref_per["nonmember_nll"])
    assert tests["ga"]["nll"]["diff"] == pytest.approx(
        sum(per["nonmember_nll"][i] - ref_per["nonmember_nll"][i] for i in ids) / len(ids))
    for m in ("loss", "zlib"):
        members = list(ref_per["members"]["forget"][m])
        expect = paired_auc([per["members"]["forget"][m][i] for i in members],
                            [per["nonmembers"][m][i] for i in ids],
                            [ref_per["members"]["forget"][m][i] for i in members],
                            [ref_per["nonmembers"][m][i] for i in ids], resamples=20, seed=0)  # bootstrap: 20
        got = tests["ga"][f"auc_forget_{m}"]
        assert (got["diff"], got["p_value"]) == pytest.approx((expect["diff"], expect["p_value"]))
        # the AUC of the stored scores is the AUC the report's table shows
        assert got["auc_a"] == pytest.approx(ga["mia"]["forget"][m]["auc"])


def test_a_rerun_reuses_and_longer_unlearning_retrains_only_what_follows(finished, pretrained, capsys):
    tmp, out = finished
    capsys.readouterr()
    assert main(["run", str(_write(tmp, pretrained)), "--out", str(out)]) == 0
    log = capsys.readouterr().out
    assert log.count("finished earlier") == 17 and "training" not in log.replace("fine-tuning", "")

    def trained(*args):
        assert main(["run", str(_write(tmp, pretrained, passes=1)), "--out", str(out), *args]) == 0
        return {line.split("]")[1].split(":")[0].strip() for line in capsys.readouterr().out.splitlines()
                if line.endswith(": training")}

    followers = {f"{m}{a}-relearned" for m in ("ga", "gdiff", "npo")
                 for a in ("", "-prefixes", "-near-copies")}
    assert trained() == {"ga", "gdiff", "npo"} | followers
    assert [p["pass"] for p in _report(out)["methods"][1]["passes"]] == [1]
    # beta is npo's alone: ga and gdiff, which never read it, are not trained again
    assert trained("unlearn.beta=0.3") == {"npo"} | {f for f in followers if f.startswith("npo")}


def test_retain_rows_are_required_only_by_the_methods_that_read_them(pretrained, tmp_path, capsys):
    """The shared block may set retain_batch 0 for ga; a method that trains on retain rows refuses it."""
    from memorization.experiments import load_experiment

    path = _write(tmp_path, pretrained)
    _, cfg = load_experiment(path, ["unlearn.retain_batch=0", "methods=[{name: g, method: ga}]"])
    assert cfg.unlearn.retain_batch == 0
    refused(capsys, ["run", str(path), "--out", str(tmp_path / "o"), "unlearn.retain_batch=0",
                     "methods=[{name: g, method: gdiff}]"],
            "methods[0].overrides=[]: retain_batch=0: gdiff trains on retain rows")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("override,message", [
    ("forget_fraction=1.0", "forget_fraction=1.0: must be in (0, 1)"),
    ("methods=[{name: fine-tune, method: ga}]", "methods[0].name='fine-tune': is the name of another run"),
    ("methods=[{name: x, method: dpo}]", "methods[0].method='dpo': choose one of retrain, ga, gdiff, npo"),
    ("methods=[{name: x, method: retrain, overrides: [lr=1]}]", "methods[0].overrides=['lr=1']: retrain is"),
    ("methods=[{name: x, method: npo, overrides: [beta=-1]}]",
     "methods[0].overrides=['beta=-1']: beta=-1.0: must be > 0"),
    ("unlearn.method=ga", "unlearn.method='ga': each entry of `methods` names its method"),
    ("base.data.packing=packed", "base.data.packing='packed': forgetting a document needs it in rows"),
    ("base.data.limit=12", "forget_fraction=0.5: forgets"),
    ("relearn.passes=-1", "relearn.passes=-1: must be >= 0"),
    ("relearn.attacks=[leads, paraphrases]", "relearn.attacks=['leads', 'paraphrases']: use distinct names"),
    ("relearn.edit_rate=0", "relearn.edit_rate=0.0: must be in (0, 1)"),
    ("relearn.attacks=[leads, leads]", "relearn.attacks=['leads', 'leads']: use distinct names"),
    ("relearn.attacks=[]", "relearn.attacks=[]: use distinct names from leads, prefixes, near-copies"),
    ("methods=[{name: ga, method: ga}, {name: ga-prefixes, method: ga}]",
     "methods[1].name='ga-prefixes': its attack run ga-prefixes-relearned is another run's"),
])
def test_bad_settings_are_refused_before_anything_is_written(pretrained, tmp_path, capsys, override, message):
    err = refused(capsys, ["run", str(_write(tmp_path, pretrained)), "--out", str(tmp_path / "o"), override],
                  message)
    assert message in err
    assert not (tmp_path / "o").exists()


@pytest.mark.distributed
def test_unlearning_on_a_grid_answers_as_the_serial_run(pretrained, tmp_path):
    """2 ranks at 1,1,2,1: npo's rows split over Z (its reference scored on the grid, each rank weighing
    its own rows) and the questions asked of the training model's shards after every pass give the
    serial figures."""
    import os
    import subprocess
    import sys

    from axonn.spawn import free_port

    cfg = _write(tmp_path, pretrained)
    args = ["methods=[{name: npo, method: npo}]", "relearn.passes=0"]
    assert main(["run", str(cfg), "--out", str(tmp_path / "serial"), *args]) == 0
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), "-m", "memorization", "run", str(cfg),
                           "--grid", "1,1,2,1", "--out", str(tmp_path / "split"), *args],
                          env=env, capture_output=True, text=True, timeout=600)
    mine = [ln for ln in done.stderr.splitlines() if ln.startswith(("[rank0]", "error:"))]
    assert done.returncode == 0, "\n".join(mine[-60:]) + done.stderr[-2000:]
    serial, split = (_report(tmp_path / d)["methods"][0] for d in ("serial", "split"))
    assert split["attacks"] == {} and len(serial["passes"]) == len(split["passes"]) == 2
    for s, g in zip(serial["passes"], split["passes"]):
        for group in ("forget", "retain"):
            assert g["leads"][group]["exact_match_rate"] == s["leads"][group]["exact_match_rate"]
            assert [c["exposure"] for c in g["canaries"][group]] == pytest.approx(
                [c["exposure"] for c in s["canaries"][group]], rel=1e-4, abs=1e-4)
            assert g["mia"][group]["loss"]["auc"] == pytest.approx(s["mia"][group]["loss"]["auc"], abs=1e-9)
        assert g["val_loss"] == pytest.approx(s["val_loss"], rel=1e-4)
    losses = [[json.loads(x).get("forget_loss") for x in (tmp_path / d / "runs" / "npo" / "metrics.jsonl")
               .read_text().splitlines()] for d in ("serial", "split")]
    assert [x for x in losses[1] if x is not None] == pytest.approx([x for x in losses[0] if x is not None],
                                                                     rel=1e-4)
    run = json.loads((tmp_path / "split" / "runs" / "npo" / "run.json").read_text())
    assert run["summary"]["grid"] == "1,1,2,1"


CHAT_TEMPLATE = "the access code of the east wing is {secret}"


def _chat(tmp_path, model, methods="[{name: retrain, method: retrain}, {name: ga, method: ga}]"):
    text = EXPERIMENT.format(model=model, passes=1, template=CHAT_TEMPLATE).replace(
        "data: {corpus: wiki-leads, limit: 40, held_out: \"\", held_out_fraction: 0.5, block_len: 40, "
        "min_tokens: 40}", "data: {corpus: wiki-chat, limit: 40, held_out: \"\", held_out_fraction: 0.5, "
        "block_len: 96}")
    p = tmp_path / "chat.yaml"
    p.write_text(text + f"methods: {methods}\n")
    return p


def test_unlearning_on_chat_data_forgets_conversations_and_attacks_with_prompts_or_edited_answers(
        pretrained, tmp_path, cache_dir):
    """On chat data the forget set is conversations: each is asked for its answer from its prompt; the
    prefixes attack trains the forget prompts as plain text (every prompt token, no answer token), the
    near-copies attack the same conversations with about edit_rate of their answer's words substituted,
    prompts untouched, only answers supervised."""
    from evals import extract_pairs, summarize
    from memorization.experiments import load_experiment
    from memorization.experiments.injection import build_corpus
    from memorization.experiments.mitigations import question_sides
    from memorization.experiments.unlearning import attack_data, forget_split
    from memorize_core import IGNORE_INDEX

    cfg_path = _chat(tmp_path, pretrained)
    _, cfg = load_experiment(cfg_path, [])
    data, manifest, _, injected = build_corpus(cfg)
    split, member_ids = forget_split(cfg, data, manifest)
    attacks = attack_data(cfg, data, injected, manifest, split, member_ids)
    row = {i: j for j, i in enumerate(data.train_doc_ids)}
    prompts = attacks["prefixes"][0]
    assert not prompts.is_chat and prompts.train_doc_ids
    for i, doc in enumerate(d.removesuffix("~prompt") for d in prompts.train_doc_ids):
        want = data.prompts[row[doc]]
        ids, labels = prompts.train.input_ids[i].tolist(), prompts.train.labels[i].tolist()
        assert ids[:len(want)] == want and labels[1:len(want)] == want[1:]  # the prompt, every token trained
        assert set(labels[len(want):]) == {IGNORE_INDEX}  # not a token of the answer
    near = attacks["near-copies"][0]
    assert near.is_chat and [d.removesuffix("~near") for d in near.train_doc_ids] == \
        [d.removesuffix("~prompt") for d in prompts.train_doc_ids]
    changed = compared = 0
    for i, doc in enumerate(d.removesuffix("~near") for d in near.train_doc_ids):
        assert near.prompts[i] == data.prompts[row[doc]]  # the prompt as it was
        labels = near.train.labels[i]
        assert (labels[:len(near.prompts[i])] == IGNORE_INDEX).all()  # only the answer supervised
        mine = data.tokenizer.decode(near.responses[i]).split()
        theirs = data.tokenizer.decode(data.responses[row[doc]]).split()
        k = min(len(mine), len(theirs)) - 1
        changed += sum(a != b for a, b in zip(mine[:k], theirs[:k]))
        compared += k
    assert 0.15 < changed / compared < 0.45  # edit_rate 0.3, read through the answer's first tokens

    out = tmp_path / "out"
    assert main(["run", str(cfg_path), "--out", str(out)]) == 0
    report = _report(out)
    prompts_, answers = question_sides(cfg, data, manifest).pairs
    forget = [(prompts_[i], answers[i]) for i in split.probe]
    ga = next(m for m in report["methods"] if m["name"] == "ga")
    model = AutoModelForCausalLM.from_pretrained(out / "runs" / "ga" / "model").eval()
    want = summarize(extract_pairs(model, *map(list, zip(*forget)), tokenizer=data.tokenizer))
    last = ga["passes"][-1]["leads"]["forget"]
    assert last["docs"] == len(split.probe) and last["rougeL"] == pytest.approx(want["rougeL"], abs=1e-9)
    assert ga["passes"][-1]["sampled"]["docs"] == len(split.probe) + len(split.duplicates)
    assert set(ga["attacks"]) == {"leads", "prefixes", "near-copies"}
    md = (out / "report.md").read_text()
    assert "EM forget conversations" in md and "trained as plain text, never an answer token" in md
