"""Experiment configs: a `base:` RunConfig plus typed experiment keys, loaded and checked in one place.

An experiment YAML looks like

    kind: goldfish-sweep          # which experiment (see memorization.experiments.KINDS)
    name: goldfish-sweep          # default output folder runs/<name> and the W&B run name
    base: {...}                   # a RunConfig, same schema as configs/train/*.yaml
    ks: [2, 4, 8]                 # experiment keys, typed by that experiment's dataclass

and `key=value` overrides reach both parts (`base.trainer.epochs=2`, `ks=[2,4]`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from axonn.config import apply_overrides, build, load_yaml, to_dict
from memorization.config import RunConfig
from memorization.mitigations.goldfish import STRATEGIES
from memorization.outputs import check_name
from memorize_core import fail

LOSSES = ("standard", "goldfish")


@dataclass
class Replicate:
    """The experiment repeated once per seed (OUT/seed-S, each with base.seed = base.trainer.seed = S),
    then every table averaged over the seeds with a Student-t interval and paired differences against
    one row (memorization.experiments.replicates)."""

    seeds: list[int] = field(default_factory=list)  # empty: one run at base.seed, into OUT itself
    # the row label (a table's first index value) differences are taken against; "": the experiment's own
    # REFERENCE (mitigations: none, unlearning: retrain) where its tables have it, else the first row of the
    # first table that other rows pair with
    reference: str = ""
    confidence: float = 0.95  # of every interval

    def validate(self, prefix: str = "") -> None:
        """Two or more distinct 64-bit seeds (or none), a confidence in (0, 1)."""
        where = f"{prefix}.seeds" if prefix else "seeds"
        if self.seeds:
            int_list(where, self.seeds, minimum=0)
            if len(self.seeds) < 2:
                raise fail(where, self.seeds, "give two or more seeds to average over, or none (one run at "
                           "base.seed)")
            if max(self.seeds) >= 2**63:
                raise fail(where, self.seeds, "seeds must be within [0, 2**63)")
        if not 0 < self.confidence < 1:
            raise fail(f"{prefix}.confidence" if prefix else "confidence", self.confidence,
                       "pass a level in (0, 1), e.g. 0.95")


@dataclass
class ExperimentConfig:
    """Keys every experiment has; subclasses add their own (all with defaults)."""

    kind: str = ""
    name: str = ""
    base: RunConfig = field(default_factory=RunConfig)
    samples: int = 8  # sample generations per run in the W&B samples table
    per_run_wandb: bool = False  # also log every sub-run as its own W&B run (grouped by name)
    replicate: Replicate = field(default_factory=Replicate)  # repeat over seeds and average

    def validate(self, prefix: str = "") -> None:
        """Checks shared by every experiment (subclasses call super().validate())."""
        check_name("name", self.name)  # the default OUT is runs/NAME
        if self.samples < 0:
            raise fail("samples", self.samples, "must be >= 0")


def refuse_data_dedup(base: RunConfig, instead: str) -> None:
    """An experiment that injects copies and counts them prepares its corpus itself: base.data.dedup
    would remove the copies behind its back (ConfigError naming what to use `instead`)."""
    if base.data.dedup.enabled:
        raise fail("base.data.dedup.enabled", True,
                   f"this experiment injects copies and counts them; {instead}")


@dataclass
class Arm:
    """One mitigation: a name, what it is, the run-config overrides that switch it on, dedup or not."""

    name: str = ""
    mitigation: str = ""
    overrides: list[str] = field(default_factory=list)  # key=value on the base RunConfig
    dedup: bool = False  # train on the deduplicated corpus (the mitigations experiment)


def with_overrides(rc: RunConfig, overrides: Sequence[str], where: str) -> RunConfig:
    """`rc` with an arm's `key=value` overrides applied and checked; an error names `where`."""
    try:
        return build(RunConfig, apply_overrides(to_dict(rc), list(overrides)))
    except ValueError as e:  # ConfigError: say which arm it came from
        raise fail(where, list(overrides), f"{e}".rstrip(".")) from None


def int_list(field_name: str, values: Sequence[int], *, minimum: int, unique: bool = True) -> list[int]:
    """Check a non-empty list of integers >= minimum (without repeats); return it."""
    if not values:
        raise fail(field_name, list(values), f"give at least one integer >= {minimum}")
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise fail(f"{field_name}[{i}]", v, f"must be an integer >= {minimum}")
    if unique and len(set(values)) != len(values):
        raise fail(field_name, list(values), "remove the repeated values")
    return list(values)


def choice_list(field_name: str, values: Sequence[str], choices: Sequence[str]) -> list[str]:
    """Check a non-empty list of distinct names from `choices`; return it."""
    if not values:
        raise fail(field_name, list(values), f"choose at least one of {', '.join(choices)}")
    for i, v in enumerate(values):
        if v not in choices:
            raise fail(f"{field_name}[{i}]", v, f"choose one of {', '.join(choices)}")
    if len(set(values)) != len(values):
        raise fail(field_name, list(values), "remove the repeated values")
    return list(values)


def check_losses(field_name: str, values: Sequence[str]) -> list[str]:
    """Loss names: standard, or goldfish (with the base goldfish settings)."""
    return choice_list(field_name, values, LOSSES)


def check_variants(field_name: str, values: Sequence[str]) -> list[str]:
    """Variant names: standard, or a goldfish strategy."""
    return choice_list(field_name, values, ("standard",) + STRATEGIES)


def load_experiment_dict(path: str | Path, overrides: Sequence[str] | None = None) -> dict[str, Any]:
    """The experiment YAML as a mapping with overrides applied (types are checked by `build`)."""
    data = apply_overrides(load_yaml(path), list(overrides or []))
    return data


def build_experiment(cls: type, data: dict[str, Any]) -> Any:
    """Build and validate the experiment dataclass; an absent name defaults to the kind."""
    data = dict(data)
    data.setdefault("name", data.get("kind", ""))
    return build(cls, data)
