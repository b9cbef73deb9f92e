"""Every experiment end to end on a micro corpus/model, its report files, and resuming without retraining."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from memorization.compare import compare_folders
from memorization.experiments import run_experiment

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "experiments"
MICRO = [
    "base.data.limit=8", "base.data.vocab_size=300", "base.data.block_len=32", "base.data.min_tokens=16",
    "base.eval.prefix=8", "base.eval.suffix=8", "base.trainer.epochs=2", "base.trainer.batch_size=2",
    "base.trainer.warmup_steps=1",
    "base.model.overrides={hidden_size: 32, num_hidden_layers: 1, intermediate_size: 64, "
    "num_attention_heads: 2, num_key_value_heads: 2}",
    "base.wandb.mode=disabled", "base.trainer.progress=false", "samples=2",
]


@pytest.fixture(scope="module", autouse=True)
def _isolated_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEMORIZE_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


def _run(name: str, out: Path, extra: list[str] = ()) -> dict:
    return run_experiment(CONFIGS / f"{name}.yaml", out=out, overrides=MICRO + list(extra))


def _mtimes(out: Path) -> dict[str, float]:
    return {p.parent.name: p.stat().st_mtime_ns for p in sorted((out / "runs").glob("*/run.json"))}


def _check_files(out: Path, report: dict, pngs: int) -> dict:
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["runs"] and on_disk["kind"] == report["kind"]
    md = (out / "report.md").read_text()
    assert md.startswith("# ")
    assert len(list(out.glob("*.png"))) == pngs and sorted(on_disk["plots"]) == sorted(
        p.name for p in out.glob("*.png"))
    for run in on_disk["runs"]:
        d = out / "runs" / run["name"]
        files = {p.name for p in d.iterdir()}
        assert {"run.json", "metrics.jsonl", "inputs.json", "report.md", "report.png"} <= files
        assert f"- [{run['name']}](runs/{run['name']}/report.md)" in md  # linked from the experiment's report
    return on_disk


def test_goldfish_extreme_then_resume_and_partial_change(tmp_path):
    out = tmp_path / "extreme"
    report = _run("goldfish-extreme", out)
    r = _check_files(out, report, pngs=1)
    assert [x["name"] for x in r["runs"]] == ["standard", "goldfish-static", "goldfish-hash"]
    assert all(0.0 <= x["mia_auc"] <= 1.0 and not x["reused"] for x in r["runs"])
    assert r["runs"][0]["loss"] == "standard" and r["runs"][2]["goldfish_strategy"] == "hash"
    # each goldfish run against standard loss, document by document: what memorize compare gives by hand
    tests = r["paired_tests"]
    assert list(tests) == ["goldfish-static", "goldfish-hash"]
    by_hand = compare_folders(str(out / "runs" / "standard"), [str(out / "runs" / "goldfish-hash")])
    for q in ("em", "rougeL"):
        mine, theirs = tests["goldfish-hash"][q], by_hand["tests"]["goldfish-hash"][q]
        assert {k: v for k, v in mine.items() if k != "p_adjusted"} == \
            {k: v for k, v in theirs.items() if k != "p_adjusted"}
    assert tests["goldfish-hash"]["em"]["n"] == r["runs"][0]["docs"]
    em = {}
    for n in ("standard", "goldfish-hash"):
        rows = map(json.loads, (out / "runs" / n / "extraction.jsonl").read_text().splitlines())
        em[n] = {row["doc"]: row["exact_match"] for row in rows}
    pairs = (("goldfish-hash", "standard"), ("standard", "goldfish-hash"))
    only = [sum(em[a][d] and not em[b][d] for d in em["standard"]) for a, b in pairs]
    assert [tests["goldfish-hash"]["em"][k] for k in ("a_only", "b_only")] == only
    assert "## Paired tests: each run − 'standard', document by document" in (out / "report.md").read_text()
    before = _mtimes(out)

    again = _run("goldfish-extreme", out)
    assert _mtimes(out) == before and all(x["reused"] for x in again["runs"])
    assert [x["exact_match_rate"] for x in again["runs"]] == [x["exact_match_rate"] for x in r["runs"]]

    # A goldfish setting changes only the goldfish runs; standard loss is reused.
    changed = _run("goldfish-extreme", out, ["base.goldfish.k=3"])
    after = _mtimes(out)
    assert [x["reused"] for x in changed["runs"]] == [True, False, False]
    assert after["standard"] == before["standard"] and after["goldfish-hash"] != before["goldfish-hash"]


def test_goldfish_sweep_grid_and_table(tmp_path, capsys):
    out = tmp_path / "sweep"
    report = _run("goldfish-sweep", out, ["ks=[2,8]", "hs=[1]", "static_ks=[3]", "token_budget=[true]"])
    r = _check_files(out, report, pngs=3)  # + the (n, p) plot
    names = [x["name"] for x in r["runs"]]
    assert names == ["standard", "hash-k2-h1-budget", "hash-k8-h1-budget", "static-k3-budget"]
    beyond = r["tables"]["Extraction beyond greedy: (n, p)-extractable fraction"]
    assert {x["scheme"] for x in beyond} == {"greedy", "t=1.0", "t=0.7,top_k=40", "top_p=0.9"}
    for x in r["runs"]:  # greedy p_z from the one forward agrees with the greedy decode's exact match
        assert x["sampled"]["offsets"]["0"]["exact_match_rate"] == x["exact_match_rate"]
    by = {x["name"]: x for x in r["runs"]}
    assert by["hash-k2-h1-budget"]["epochs"] == 4 and by["standard"]["epochs"] == 2  # k/(k-1) = 2
    assert by["hash-k8-h1-budget"]["goldfish_k"] == 8 and by["static-k3-budget"]["goldfish_h"] is None
    lines = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("hash-k8-h1-budget ") for line in lines) == 1  # one summary table
    assert any("MIA AUC" in line for line in lines)


def test_catastrophic_memorization_scores_every_pass(tmp_path):
    out = tmp_path / "cat"
    sizes = ("sizes=[{name: a, overrides: {hidden_size: 16, intermediate_size: 32}}, "
             "{name: b, overrides: {hidden_size: 32}}]")
    report = _run("catastrophic-memorization", out, [sizes, "passes=3", "plot_passes=[1,3]",
                                                     "scan_corpus=true", "scan_stride=16"])
    r = _check_files(out, report, pngs=3)  # + the (n, p) plot
    assert [x["name"] for x in r["runs"]] == ["a-standard", "a-goldfish", "b-standard", "b-goldfish"]
    for x in r["runs"]:  # every pass scores (n, p) and exact match at the offsets 0, 16, 32
        assert all(set(p["sampled"]["offsets"]) == {"0", "16", "32"} for p in x["passes"])
        assert x["sampled"] == x["passes"][-1]["sampled"]
    assert "Exact match by prefix offset" in r["tables"]
    for x in r["runs"]:
        assert [p["pass"] for p in x["passes"]] == [1, 2, 3] and x["epochs"] == 3
        assert x["em_pass_3"] == x["exact_match_rate"]
        assert (out / "runs" / x["name"] / "passes.jsonl").read_text().count("\n") == 3
        # the training-set scan (windows every 16 tokens: more than one per document) after every pass
        assert x["scan_windows"] == x["passes"][-1]["scan_windows"] > x["docs"]
        assert x["scan_em_last"] == x["passes"][-1]["scan_exact_match_rate"]
    assert r["runs"][0]["params"] < r["runs"][2]["params"]
    table = (out / "report.md").read_text()
    assert "EM of every window, pass 3" in table and f"| {r['runs'][0]['scan_windows']:,} |" in table
    # paired by document: b against a with the same loss, goldfish against standard at each size; exact
    # match after pass 1 from that pass's ids, the last pass's from the result files
    tests = r["paired_tests"]
    assert list(tests["by_size"]) == ["b-standard", "b-goldfish"]
    assert list(tests["by_loss"]) == ["a-goldfish", "b-goldfish"]
    runs = {x["name"]: x for x in r["runs"]}
    first = {n: runs[n]["passes"][0] for n in ("b-standard", "a-standard")}
    b_hit, a_hit = (set(first[n]["extracted"]) for n in ("b-standard", "a-standard"))
    em1 = tests["by_size"]["b-standard"]["em_pass_1"]
    assert (em1["a_only"], em1["b_only"], em1["n"]) == (len(b_hit - a_hit), len(a_hit - b_hit),
                                                         len(first["a-standard"]["ids"]))
    assert tests["by_loss"]["b-goldfish"]["em"]["reference"] == "b-standard"
    assert "em_pass_3" not in tests["by_size"]["b-standard"]  # the last pass is the files' EM
    # the last pass's (n, p) under each scheme and greedy EM at the other offsets, from sampled.jsonl
    assert (out / "runs" / "b-standard" / "sampled.jsonl").is_file()
    keys = set(tests["by_size"]["b-standard"])
    assert {"np@0:t=1.0", "np@0:top_p=0.9", "np@16:greedy", "np@16:t=1.0"} <= keys, keys
    assert "## Paired tests: each size − 'a' with the same loss" in table


def test_sizes_pair_with_the_one_of_fewest_parameters_whatever_their_order():
    from memorization.experiments.catastrophic import Config, ModelSize, size_pairs

    sizes = [ModelSize("big"), ModelSize("small"), ModelSize("mid")]
    cfg = Config(sizes=sizes, losses=["standard", "goldfish"])
    runs = [{"size": s, "params": n} for s, n in (("big", 900), ("small", 10), ("mid", 100))]
    smallest, pairs = size_pairs(cfg, runs)
    assert smallest == "small"
    losses = ("standard", "goldfish")
    assert pairs == [(f"{s}-{loss}", f"small-{loss}") for s in ("big", "mid") for loss in losses]


def test_canary_exposure_with_manifest(tmp_path):
    out = tmp_path / "canary"
    report = _run("canary-exposure", out, ["counts=[1,3]", "canaries.per_count=2", "duplicates.per_count=1",
                                          "canaries.space.length=2", "base.data.block_len=64"])
    r = _check_files(out, report, pngs=1)
    manifest = json.loads((out / "manifest.json").read_text())
    kinds = sorted((i["kind"], i["count"]) for i in manifest["items"])
    assert kinds == [("canary", 1), ("canary", 1), ("canary", 3), ("canary", 3), ("duplicate", 1),
                     ("duplicate", 3)]
    assert all(len(i["token_positions"]) == i["count"] for i in manifest["items"])
    rows = r["tables"]["By copy count"]
    assert [(x["loss"], x["count"]) for x in rows] == [("standard", 1), ("standard", 3), ("goldfish", 1),
                                                      ("goldfish", 3)]
    for run in r["runs"]:
        ev = run["canary_eval"]
        assert ev["exact"] and ev["scored"] == 100 and len(ev["canaries"]) == 4 and len(ev["duplicates"]) == 2
        assert all(0.0 <= c["exposure"] <= ev["max_exposure"] + 1e-9 for c in ev["canaries"])
        for c in ev["canaries"]:  # the kept-token exposure: only a canary with a token dropped and one kept
            partial = 0 < c["secret_tokens_dropped"] < c["secret_tokens"]
            assert (c["kept_exposure"] is not None) == partial
            if partial:
                assert 1 <= c["kept_groups"] <= 100
                assert 0.0 <= c["kept_exposure"] <= math.log2(c["kept_groups"])
    assert "masked: exposure of kept tokens" in (out / "report.md").read_text()  # goldfish hash: split shown
    # paired, canary by canary: goldfish − standard equals the tests evals.paired gives on the runs' scores
    from evals.paired import mcnemar, paired_difference

    std, gold = ({c["id"]: c for c in run["canary_eval"]["canaries"]} for run in r["runs"])
    ids = list(std)
    tests = r["paired_tests"]["goldfish"]
    assert tests["exposure"]["diff"] == pytest.approx(
        paired_difference([gold[i]["exposure"] for i in ids], [std[i]["exposure"] for i in ids])["diff"])
    assert tests["secrets"]["p_value"] == mcnemar([gold[i]["extracted"] for i in ids],
                                                  [std[i]["extracted"] for i in ids])["p_value"]
    masked = [i for i in ids if std[i]["secret_tokens_dropped"]]
    assert masked == [i for i in ids if gold[i]["secret_tokens_dropped"]]  # one grouping in both runs
    unmasked = [i for i in ids if i not in masked]
    for key, group in (("exposure_masked", masked), ("exposure_unmasked", unmasked)):
        if not group:
            assert key not in tests
            continue
        assert tests[key]["n"] == len(group) and tests[key]["diff"] == pytest.approx(
            sum(gold[i]["exposure"] - std[i]["exposure"] for i in group) / len(group))
    assert tests["em_dup"]["n"] == 2
    assert "Paired tests: each loss − 'standard', canary by canary" in (out / "report.md").read_text()


def test_canary_exposure_on_chat_data(tmp_path):
    """On a chat corpus the canaries are answers and the duplicated items conversations: each scored in
    its conversation, grouped by the mask alike in both runs, and the report says so."""
    out = tmp_path / "chat"
    template = "canaries.template=the access code of the old east wing is {secret}"
    report = _run("canary-exposure", out, ["base.data.corpus=wiki-chat", "base.data.block_len=128", template,
                                          "counts=[1,2]", "canaries.per_count=2", "duplicates.per_count=1",
                                          "canaries.space.length=2", "canaries.prompt=What was the note?",
                                          "base.eval.audit=true", "base.eval.audit_canaries=8"])
    r = _check_files(out, report, pngs=1)
    manifest = json.loads((out / "manifest.json").read_text())
    assert {i["prompt"] for i in manifest["items"] if i["kind"] == "canary"} == {"What was the note?"}
    assert all(json.loads(i["text"])[-1]["role"] == "assistant" for i in manifest["items"]
               if i["kind"] == "duplicate")
    std, gold = (run["canary_eval"] for run in r["runs"])
    assert "What was the note?" in std["prompt"]  # the scored prefix is the conversation's
    assert len(std["canaries"]) == 4 and len(std["duplicates"]) == 2
    assert [c["secret_tokens_dropped"] for c in std["canaries"]] == [c["secret_tokens_dropped"]
                                                                     for c in gold["canaries"]]
    assert all(run["audit"]["m"] == 8 and 0 < run["audit"]["included"] < 8 for run in r["runs"])
    md = (out / "report.md").read_text()
    assert "trained as the answer to the user turn 'What was the note?'" in md
    assert "Duplicated conversations" in md and "Paired tests" in md


def test_near_verbatim_keys_a_run_only_where_the_run_bounds_it():
    """Off (the default), or on where the run extracts nothing (an experiment that bounds near-copies
    itself keys them in its eval_key), the setting leaves a run's key as before it existed: finished runs
    are reused; on in a run that extracts, it is part of what the run computes."""
    from dataclasses import replace

    from memorization.config import load_run_config
    from memorization.experiments.runner import run_key
    from memorization.models import REPO_ROOT

    cfg = load_run_config(REPO_ROOT / "configs" / "train" / "tiny-wiki.yaml", [])
    base = run_key(cfg)
    assert "near_verbatim" not in base["eval"] and "nv_beams" not in base["eval"]
    quiet = replace(cfg, eval=replace(cfg.eval, extraction=False, near_verbatim=2, nv_beams=3))
    assert run_key(quiet) == run_key(replace(cfg, eval=replace(cfg.eval, extraction=False)))
    on = run_key(replace(cfg, eval=replace(cfg.eval, near_verbatim=2)))
    assert on["eval"]["near_verbatim"] == 2 and on != base


def test_run_key_of_the_default_config_is_stable():
    """A finished experiment run is reused only while its key is unchanged: a new RunConfig field
    that enters every key makes every experiment retrain from scratch after an upgrade (eval.decode
    once did: it picks a decoder, not the tokens). tests/data/run_key_tiny_wiki.json is the key
    tiny-wiki.yaml had before eval.decode existed. If this fails, pop the new field in
    memorization.experiments.runner.run_key where it does not change what the run computes (or while
    it is off); regenerate the file only for a field that changes every run's results."""
    from memorization.config import load_run_config
    from memorization.experiments.runner import _jsonable, run_key
    from memorization.models import REPO_ROOT

    cfg = load_run_config(REPO_ROOT / "configs" / "train" / "tiny-wiki.yaml", [])
    frozen = json.loads((Path(__file__).parent / "data" / "run_key_tiny_wiki.json").read_text())
    assert _jsonable(run_key(cfg)) == frozen


def test_a_run_trained_before_an_inert_field_existed_is_reused(tmp_path):
    """Sub-runs trained before eval.sampling / offsets / np_* / audit existed (their inputs.json lacks
    them) are reused where those fields cannot matter (no extraction, no audit), as are runs whose key
    has them; a run that extracts, or audits, with a key lacking them retrains."""
    from dataclasses import replace

    from memorization.config import load_run_config
    from memorization.experiments.runner import Experiment, _jsonable, run_key
    from memorization.models import REPO_ROOT

    cfg = load_run_config(REPO_ROOT / "configs" / "train" / "tiny-wiki.yaml", [])
    exp = Experiment(out=tmp_path)

    def stored(c, drop):
        key = _jsonable({"run": run_key(c), "extra": {"seed": 0}})
        for name in drop:
            key["run"]["eval"].pop(name)
        d = exp.run_dir(c.name)
        d.mkdir(parents=True, exist_ok=True)
        (d / "run.json").write_text("{}")
        (d / "inputs.json").write_text(json.dumps(key))
        return {"run": run_key(c), "extra": {"seed": 0}}

    old = ("sampling", "offsets", "np_ns", "np_p", "audit", "audit_canaries")
    quiet = replace(cfg, name="quiet", eval=replace(cfg.eval, extraction=False))
    assert exp.finished("quiet", stored(quiet, old))
    assert exp.finished("quiet", stored(quiet, ()))
    # the same stored key does not stand for a run that now extracts, audits, or trains otherwise
    key = stored(quiet, old)
    for changed in (replace(quiet, eval=replace(quiet.eval, extraction=True)),
                    replace(quiet, eval=replace(quiet.eval, audit=True)),
                    replace(quiet, trainer=replace(quiet.trainer, lr=quiet.trainer.lr * 2))):
        assert not exp.finished("quiet", {**key, "run": run_key(changed)})
    extracting = replace(cfg, name="extracting")
    assert not exp.finished("extracting", stored(extracting, ("sampling",)))
    assert exp.finished("extracting", stored(extracting, ("audit", "audit_canaries")))
