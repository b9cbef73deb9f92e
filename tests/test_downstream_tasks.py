"""Bundled lm-eval tasks: items checked against gensim's source files (read independently here),
deterministic builds, and the YAMLs in data_pipelines/tasks as lm-eval 0.4.13 loads them, offline."""
from __future__ import annotations

import collections
import importlib.util
import re
import socket
from pathlib import Path

import datasets
import huggingface_hub.constants
import lm_eval.tasks
import pytest
import yaml

from data_pipelines import downstream as ds
from memorize_core import ConfigError

DATA = Path(importlib.util.find_spec("gensim").origin).parent / "test" / "test_data"
GROUPS = list(ds.ANALOGY_GROUPS)
# Pinned builds at the YAMLs' seed: a change here changes every recorded score, so it must come with a
# `metadata: version` bump in data_pipelines/tasks (or a changed gensim data file, which is news too).
FINGERPRINTS = {
    "analogies_capitals": "41d5722fad22d26419cc3b4cb19d245cfd0ed7eb702d5062732ffae53002e4c4",
    "analogies_currency": "fc05ac902ce25368aa72660c8ca5b869f10315c84872a6a4371dff74f9f3cf8a",
    "analogies_city_in_state": "f07f61e658abaeca2ffa0a03c4e8cfae7693b98987e09019ac6de8325a03dbc1",
    "analogies_family": "c1213353d059ad3e506f63c026a894c83f61f253f2462039c3c998e7e5bb36fa",
    "analogies_grammar": "da5495996f07f07291fce9f56466f9a3188924d9df76830d5002547681b79d23",
    "polarity": "7a6d4ad965f938bec894ba2a69e9f46bcf8d8cce925307d7f6c293120f63c60c",
}


def _raises(field: str, fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    assert str(info.value).startswith(f"{field}="), str(info.value)
    return str(info.value)


def _source_analogies() -> dict[str, list[list[str]]]:
    """section -> its `A B C D` lines, read straight from the file."""
    sections: dict[str, list[list[str]]] = {}
    for line in (DATA / "questions-words.txt").read_text().splitlines():
        if line.startswith(": "):
            name = line[2:]
            sections[name] = []
        elif line:
            sections[name].append(line.split())
    return sections


def _source_polarity() -> dict[int, tuple[str, str]]:
    """line number -> (label prefix, sentence)."""
    text = (DATA / "pang_lee_polarity.cor").read_bytes().decode("cp1252")  # strict: raises on a bad byte
    out = {}
    for n, line in enumerate(text.split("\n"), 1):
        if line.strip():
            prefix, sentence = line.strip().split(" ", 1)
            out[n] = (prefix, sentence.strip())
    return out


SOURCE = _source_analogies()


@pytest.fixture(scope="module")
def items() -> dict[str, list[dict]]:
    return {g: ds.analogy_items(g) for g in GROUPS}


def test_analogy_counts_match_the_source_file(items):
    assert list(SOURCE) == [s for g in GROUPS for s in ds.ANALOGY_GROUPS[g]]  # every section, in file order
    assert sum(len(lines) for lines in SOURCE.values()) == 19544
    for g in GROUPS:
        assert len(items[g]) == sum(len(SOURCE[s]) for s in ds.ANALOGY_GROUPS[g]), g
    assert sum(len(v) for v in items.values()) == 19544
    assert {r["name"]: r["items"] for r in ds.describe_tasks()} == {
        "analogies": 19544, "analogies_capitals": 5030, "analogies_currency": 866,
        "analogies_city_in_state": 2467, "analogies_family": 506, "analogies_grammar": 10675,
        "polarity": 160}
    assert [r["name"] for r in ds.describe_tasks()] == list(ds.BUNDLED_TASKS)


def test_every_analogy_item_is_its_source_line_with_same_section_distractors(items):
    pools = {s: {w for line in lines for w in (line[1], line[3])} for s, lines in SOURCE.items()}
    for g in GROUPS:
        seen = set()
        for it in items[g]:
            section, _, index = it["id"].partition(":")
            assert section == it["category"] and section in ds.ANALOGY_GROUPS[g]
            a, b, c, d = SOURCE[section][int(index)]
            assert (it["a"], it["b"], it["c"], it["d"]) == (a, b, c, d)
            assert it["question"] == f"{a} is to {b} as {c} is to"
            assert len(it["choices"]) == 4 and it["choices"][it["gold"]] == d
            distractors = [w for k, w in enumerate(it["choices"]) if k != it["gold"]]
            lowered = [w.lower() for w in distractors]
            assert len(set(lowered)) == 3 and not set(lowered) & {a.lower(), b.lower(), c.lower(), d.lower()}
            assert set(distractors) <= pools[section], it
            assert all(not w[0].isspace() for w in it["choices"])
            seen.add(it["id"])
        assert seen == {f"{s}:{i}" for s in ds.ANALOGY_GROUPS[g] for i in range(len(SOURCE[s]))}


def test_gold_positions_and_the_limit_prefix_are_spread(items):
    positions = collections.Counter(it["gold"] for it in items["grammar"])
    assert set(positions) == {0, 1, 2, 3} and min(positions.values()) > 0.2 * len(items["grammar"])
    # lm-eval's --limit 50 takes the first 50 docs: they reach most of the grammar sections
    assert len({it["category"] for it in items["grammar"][:50]}) >= 7


def test_builds_are_deterministic_and_independent(items):
    for task, digest in FINGERPRINTS.items():
        assert ds.dataset_fingerprint(task) == ds.dataset_fingerprint(task, seed=1234) == digest, task
    other = {it["id"]: it for it in ds.analogy_items("capitals", seed=7)}
    base = {it["id"]: it for it in items["capitals"]}
    assert other.keys() == base.keys()
    assert all(other[k]["choices"][other[k]["gold"]] == base[k]["d"] for k in base)  # same gold words
    assert sum(other[k]["choices"] != base[k]["choices"] for k in base) > 0.95 * len(base)
    assert [it["id"] for it in items["capitals"]] != list(other)
    # an item depends on its own line and the seed only, not on what else was built before it
    ds.analogy_items("grammar", seed=99, choices=6)
    assert ds.analogy_items("family") == items["family"]
    assert ds.dataset_fingerprint("polarity", seed=7) != FINGERPRINTS["polarity"]


def test_polarity_split_is_balanced_and_labelled_like_the_source():
    source = _source_polarity()
    assert len(source) == 200 and any("\u2014" in s for _, s in source.values())  # 0x97 -> em dash
    split = ds.polarity_items()
    train, test = split["train"], split["test"]
    assert (len(train), len(test)) == (40, 160)
    assert [r["label"] for r in train] == [0, 1] * 20  # alternating: first_n's k shots are balanced
    assert collections.Counter(r["label"] for r in test) == {0: 80, 1: 80}
    assert sorted(r["id"] for r in train + test) == sorted(source)
    for r in train + test:
        prefix, sentence = source[r["id"]]
        assert r["label"] == {"__label__neg": 0, "__label__pos": 1}[prefix] and r["sentence"] == sentence
    assert ds.polarity_items() == split
    assert ds.polarity_items(seed=1) != split
    assert len(ds.polarity_items(shots_pool=5)["train"]) == 10


def test_task_dataset_splits_and_extra_metadata():
    family = ds.task_dataset("analogies_family", version=1.0, config_source="x.yaml")  # lm-eval's metadata
    assert list(family) == ["test"] and family["test"].num_rows == 506
    assert family["test"][0]["choices"] == ds.analogy_items("family")[0]["choices"]
    polarity = ds.task_dataset("polarity", seed=1234)
    assert {k: v.num_rows for k, v in polarity.items()} == {"train": 40, "test": 160}


def test_bad_input_names_the_field():
    assert "choose one of" in _raises("task", ds.task_dataset, "nope")
    _raises("task", ds.dataset_fingerprint, "analogies")  # the group is no dataset of its own
    _raises("group", ds.analogy_items, "planets")
    _raises("choices", ds.analogy_items, "family", choices=1)
    _raises("choices", ds.analogy_items, "family", choices=500)
    _raises("shots_pool", ds.polarity_items, shots_pool=100)
    _raises("seed", ds.task_dataset, "polarity", seed="1234")


def _go_offline(mp: pytest.MonkeyPatch) -> None:
    """No network: HF offline switches on (also where datasets/hub read them at import); sockets refuse."""
    mp.setenv("HF_DATASETS_OFFLINE", "1")
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    def refuse(*args, **kwargs):
        raise OSError("network used in an offline test")

    mp.setattr(socket.socket, "connect", refuse)


@pytest.fixture(scope="module")
def loaded():
    """The bundled YAMLs through lm-eval's TaskManager, built once (2-3 s) with the network off."""
    with pytest.MonkeyPatch.context() as mp:
        _go_offline(mp)
        # include_defaults=False: indexing lm-eval's ~14k built-in YAMLs takes ~25 s (the slow test below)
        manager = lm_eval.tasks.TaskManager(include_path=str(ds.TASK_DIR), include_defaults=False)
        yield manager, manager.load(["analogies", "polarity"])  # what lm_eval.simple_evaluate calls


def _args(task, *, limit: int) -> list[tuple[str, str]]:
    task.build_all_requests(limit=limit, rank=0, world_size=1)
    return [inst.args for inst in task.instances]


def test_yamls_build_every_task_offline_with_exact_requests(loaded):
    manager, result = loaded
    assert manager.all_tasks == sorted(ds.BUNDLED_TASKS)
    tasks = result["tasks"]
    assert result["group_map"] == {"analogies": [f"analogies_{g}" for g in GROUPS]}
    sizes = {r["name"]: r["items"] for r in ds.describe_tasks()}
    assert {name: len(t.eval_docs) for name, t in tasks.items()} == {
        name: n for name, n in sizes.items() if name != "analogies"}

    for g in GROUPS:
        first = ds.analogy_items(g)[0]
        context = f"{first['a']} is to {first['b']} as {first['c']} is to"
        assert _args(tasks[f"analogies_{g}"], limit=1) == [(context, f" {w}") for w in first["choices"]]
        assert tasks[f"analogies_{g}"].doc_to_target(tasks[f"analogies_{g}"].eval_docs[0]) == first["gold"]

    polarity = tasks["polarity"]
    polarity.set_config(key="num_fewshot", value=2)
    split = ds.polarity_items()
    shots = "".join(f"Review: {r['sentence']}\nSentiment: {['negative', 'positive'][r['label']]}\n\n"
                    for r in split["train"][:2])
    assert [r["label"] for r in split["train"][:2]] == [0, 1]
    polarity.set_fewshot_seed(seed=1)
    args = _args(polarity, limit=2)
    assert args == [(shots + f"Review: {r['sentence']}\nSentiment:", f" {label}")
                    for r in split["test"][:2] for label in ("negative", "positive")]
    polarity.set_fewshot_seed(seed=2)  # first_n: the shots do not depend on lm-eval's fewshot seed
    assert _args(polarity, limit=2) == args
    polarity.set_config(key="num_fewshot", value=0)
    assert _args(polarity, limit=1)[0] == (f"Review: {split['test'][0]['sentence']}\nSentiment:", " negative")


def test_simple_evaluate_runs_the_group_and_pins_analogies_to_zero_shots(loaded):
    """lm-eval's own evaluator path (the CLI's) with its dummy model: --num_fewshot reaches polarity only."""
    manager, result = loaded
    # back to the YAML's unset shots: simple_evaluate keeps any configured 0 (analogies' pinned one,
    # and the one an earlier test set here), and overrides only None
    result["tasks"]["polarity"].set_config(key="num_fewshot", value=None)
    tasks = [result["groups"]["analogies"], result["tasks"]["polarity"]]
    out = lm_eval.simple_evaluate(model="dummy", tasks=tasks, task_manager=manager, num_fewshot=2, limit=3,
                                  bootstrap_iters=0, log_samples=True,  # global RNGs left to the suite:
                                  random_seed=None, numpy_random_seed=None, torch_random_seed=None)
    assert {"acc,none", "acc_norm,none"} <= out["results"]["analogies"].keys()
    assert out["n-shot"]["polarity"] == 2 and out["n-shot"]["analogies_family"] == 0
    family = out["samples"]["analogies_family"][0]["arguments"][0][0]
    assert "\n" not in family and family.endswith(" is to")
    polarity = out["samples"]["polarity"][0]["arguments"][0][0]
    assert polarity.count("Review: ") == 3 and polarity.endswith("\nSentiment:")


def test_yamls_record_the_seed_and_the_spacing():
    loader = type("Loader", (yaml.SafeLoader,), {})
    loader.add_constructor("!function", lambda lo, node: lo.construct_scalar(node))
    configs = {p.stem: yaml.load(p.read_text(), Loader=loader) for p in ds.TASK_DIR.glob("*.yaml")}
    template = configs.pop("_analogies_template")
    assert set(configs) == set(ds.BUNDLED_TASKS)
    for cfg in (template, configs["polarity"]):
        assert cfg["custom_dataset"] == "_datasets.task_dataset" and cfg["target_delimiter"] == ""
    assert template["num_fewshot"] == 0  # pinned: lm-eval never overrides a configured 0
    assert "num_fewshot" not in configs["polarity"]  # 0 shots unless the user passes --num_fewshot
    assert configs["polarity"]["doc_to_choice"] == [" negative", " positive"]
    for name in ds.BUNDLED_TASKS:
        if name != "analogies":
            assert configs[name]["dataset_kwargs"] == {"task": name, "seed": ds.DEFAULT_SEED}, name


def _registered_names(cfg) -> set[str]:
    names = {cfg.get("task"), cfg.get("group")} if isinstance(cfg, dict) else set()
    tags = cfg.get("tag") if isinstance(cfg, dict) else None
    names |= set(tags) if isinstance(tags, list) else {tags}
    return {n for n in names if isinstance(n, str)}


def test_bundled_names_are_not_lm_eval_builtins():
    """Fast form: a built-in registers a name only through a `task:`, `group:` or `tag:` in a YAML file
    (or a `_template_yaml` one includes), so only files that mention one of ours need parsing."""
    root = Path(lm_eval.tasks.__file__).parent
    mention = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, ds.BUNDLED_TASKS)) + r")(?![\w-])")
    loader = type("Loader", (yaml.SafeLoader,), {})
    loader.add_multi_constructor("!", lambda lo, suffix, node: None)
    clashes = []
    for path in root.rglob("*yaml"):
        text = path.read_text(errors="replace")
        if mention.search(text):
            cfg = yaml.load(text, Loader=loader)
            clashes += [(str(path), n) for n in _registered_names(cfg) & set(ds.BUNDLED_TASKS)]
    assert not clashes


@pytest.mark.slow
def test_bundled_names_are_not_lm_eval_builtins_by_its_own_index():
    """Exact form: lm-eval's own index of its built-ins (~25 s to build on the dev machine)."""
    assert not set(ds.BUNDLED_TASKS) & set(lm_eval.tasks.TaskManager().all_tasks)
