"""Downstream-utility tasks for lm-evaluation-harness, built offline from data the gensim wheel ships.

Two published sets, read from `gensim/test/test_data/` at run time (never copied into this repo):
- `questions-words.txt`: the Mikolov et al. (2013) word analogies, asked as 4-way multiple choice
  ("Athens is to Greece as Baghdad is to" -> Iraq), one lm-eval task per group of sections;
- `pang_lee_polarity.cor`: 200 Pang & Lee movie-review sentences, few-shot sentiment classification.

`data_pipelines/tasks/` holds the lm-eval YAMLs; their `custom_dataset` calls `task_dataset` here.
Every build is a pure function of the seed: no network, no cache, no dependence on build order.
"""
from __future__ import annotations

import hashlib
import json
import random
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from data_pipelines.bundled import package_dir
from memorize_core import fail

if TYPE_CHECKING:
    import datasets

TASK_DIR = Path(__file__).resolve().parent / "tasks"
ANALOGY_FILE = "questions-words.txt"
POLARITY_FILE = "pang_lee_polarity.cor"
DEFAULT_SEED = 1234  # the seed the YAMLs record in dataset_kwargs
SHOTS_POOL = 20  # polarity sentences per label held out as the few-shot pool

# group -> the source sections it asks about, in file order
ANALOGY_GROUPS: dict[str, tuple[str, ...]] = {
    "capitals": ("capital-common-countries", "capital-world"),
    "currency": ("currency",),
    "city_in_state": ("city-in-state",),
    "family": ("family",),
    "grammar": ("gram1-adjective-to-adverb", "gram2-opposite", "gram3-comparative", "gram4-superlative",
                "gram5-present-participle", "gram6-nationality-adjective", "gram7-past-tense",
                "gram8-plural", "gram9-plural-verbs"),
}
ANALOGY_TASKS = tuple(f"analogies_{g}" for g in ANALOGY_GROUPS)
POLARITY_LABELS = {"__label__neg": 0, "__label__pos": 1}
BUNDLED_TASKS: tuple[str, ...] = ("analogies", *ANALOGY_TASKS, "polarity")

# (line index within its section, a, b, c, d)
Analogy = tuple[int, str, str, str, str]


def _data_file(name: str) -> Path:
    path = package_dir("gensim") / "test" / "test_data" / name
    if not path.is_file():
        raise fail("task data", name, "this gensim wheel lacks its test data; reinstall gensim>=4.3")
    return path


@lru_cache(maxsize=1)
def _analogy_sections() -> dict[str, tuple[Analogy, ...]]:
    """Every section of questions-words.txt, its lines in file order."""
    sections: dict[str, list[Analogy]] = {}
    current: list[Analogy] | None = None
    for n, line in enumerate(_data_file(ANALOGY_FILE).read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith(":"):
            current = sections.setdefault(line[1:].strip(), [])
        elif line.strip():
            words = line.split()
            if current is None or len(words) != 4:
                raise fail("task data", f"{ANALOGY_FILE}:{n}", "expected `A B C D` under a `: name` header")
            current.append((len(current), *words))
    expected = {s for group in ANALOGY_GROUPS.values() for s in group}
    if set(sections) != expected:  # a different file would silently drop or mislabel a section
        raise fail("task data", ANALOGY_FILE, f"sections {sorted(sections)} differ from {sorted(expected)}")
    return {s: tuple(lines) for s, lines in sections.items()}


def analogy_items(group: str, seed: int = DEFAULT_SEED, choices: int = 4) -> list[dict[str, Any]]:
    """One multiple-choice item per source line of `group`'s sections, in seeded shuffled order."""
    if group not in ANALOGY_GROUPS:
        raise fail("group", group, f"choose one of {', '.join(ANALOGY_GROUPS)}")
    if isinstance(choices, bool) or not isinstance(choices, int) or choices < 2:
        raise fail("choices", choices, "an integer >= 2 (the answer plus at least one distractor)")
    sections = _analogy_sections()
    items = []
    for section in ANALOGY_GROUPS[group]:
        # answer words of the section: distractors of the same type (capitals for capitals, ...)
        pool = sorted({w for _, _, b, _, d in sections[section] for w in (b, d)})
        for i, a, b, c, d in sections[section]:
            # a per-line RNG (string seeds hash deterministically) keeps an item independent of
            # which other items, groups or choice counts are built
            rng = random.Random(f"{seed}:{section}:{i}")
            banned = {a.lower(), b.lower(), c.lower(), d.lower()}
            candidates = list({w.lower(): w for w in pool if w.lower() not in banned}.values())
            if len(candidates) < choices - 1:
                raise fail("choices", choices, f"section {section} has only {len(candidates)} distractors "
                           f"for line {i}; ask for fewer choices")
            options = rng.sample(candidates, choices - 1)
            gold = rng.randrange(choices)
            options.insert(gold, d)
            items.append({"id": f"{section}:{i}", "category": section, "a": a, "b": b, "c": c, "d": d,
                          "question": f"{a} is to {b} as {c} is to", "choices": options, "gold": gold})
    # lm-eval's --limit N takes the first N docs: a shuffled order spreads them over the sections
    random.Random(seed).shuffle(items)
    return items


@lru_cache(maxsize=1)
def _polarity_lines() -> tuple[tuple[int, int, str], ...]:
    """(line number, label, sentence) of every line of the polarity file."""
    raw = _data_file(POLARITY_FILE).read_bytes()
    try:
        text = raw.decode("cp1252")  # the file is cp1252 (em dashes as 0x97), not UTF-8
    except UnicodeDecodeError as e:
        raise fail("task data", POLARITY_FILE, f"not decodable as cp1252 ({e}); reinstall gensim") from e
    out = []
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        tag, _, sentence = line.strip().partition(" ")
        if tag not in POLARITY_LABELS or not sentence.strip():
            raise fail("task data", f"{POLARITY_FILE}:{n}", f"expected one of {sorted(POLARITY_LABELS)} "
                       "then a sentence")
        out.append((n, POLARITY_LABELS[tag], sentence.strip()))
    return tuple(out)


def polarity_items(seed: int = DEFAULT_SEED, shots_pool: int = SHOTS_POOL) -> dict[str, list[dict[str, Any]]]:
    """Balanced train (few-shot pool, `shots_pool` per label) and test splits of the polarity sentences."""
    by_label: dict[int, list[dict[str, Any]]] = {label: [] for label in POLARITY_LABELS.values()}
    for n, label, sentence in _polarity_lines():
        by_label[label].append({"id": n, "sentence": sentence, "label": label})
    smallest = min(len(rows) for rows in by_label.values())
    if isinstance(shots_pool, bool) or not isinstance(shots_pool, int) or not 0 <= shots_pool < smallest:
        raise fail("shots_pool", shots_pool, f"an integer in [0, {smallest}) (sentences per label)")
    for label, rows in by_label.items():
        random.Random(f"{seed}:{label}").shuffle(rows)
    # labels alternate in the pool, so the first k shots (the YAML's first_n sampler) are balanced for
    # even k rather than all negative
    train = [rows[k] for k in range(shots_pool) for rows in by_label.values()]
    test = [row for rows in by_label.values() for row in rows[shots_pool:]]
    random.Random(seed).shuffle(test)
    return {"train": train, "test": test}


def _splits(task: str, seed: int) -> dict[str, list[dict[str, Any]]]:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise fail("seed", seed, "an integer")
    if task in ANALOGY_TASKS:
        return {"test": analogy_items(task.removeprefix("analogies_"), seed)}
    if task == "polarity":
        return polarity_items(seed)
    raise fail("task", task, f"choose one of {', '.join((*ANALOGY_TASKS, 'polarity'))}")


def task_dataset(task: str, seed: int = DEFAULT_SEED, **_ignored: Any) -> datasets.DatasetDict:
    """The DatasetDict of a bundled task: lm-eval's `custom_dataset` (it also passes the task metadata)."""
    import datasets  # deferred: +1.1 s import (pyarrow, pandas), only when lm-eval builds a task

    return datasets.DatasetDict({split: datasets.Dataset.from_list(rows)
                                 for split, rows in _splits(task, seed).items()})


def dataset_fingerprint(task: str, seed: int = DEFAULT_SEED) -> str:
    """sha256 of a task's items (every split) as canonical JSON."""
    blob = json.dumps(_splits(task, seed), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def describe_tasks() -> list[dict[str, Any]]:
    """Every bundled task and group: name, kind, source file, evaluated items and few-shot pool size."""
    sections = _analogy_sections()
    sizes = {g: sum(len(sections[s]) for s in ss) for g, ss in ANALOGY_GROUPS.items()}
    polarity = polarity_items()
    rows = [{"name": "analogies", "kind": "group", "source": ANALOGY_FILE, "items": sum(sizes.values()),
             "fewshot_pool": 0}]
    rows += [{"name": f"analogies_{g}", "kind": "task", "source": ANALOGY_FILE, "items": n, "fewshot_pool": 0}
             for g, n in sizes.items()]
    rows.append({"name": "polarity", "kind": "task", "source": POLARITY_FILE, "items": len(polarity["test"]),
                 "fewshot_pool": len(polarity["train"])})
    return rows


__all__ = [
    "ANALOGY_GROUPS", "BUNDLED_TASKS", "DEFAULT_SEED", "TASK_DIR", "analogy_items", "dataset_fingerprint",
    "describe_tasks", "polarity_items", "task_dataset",
]
