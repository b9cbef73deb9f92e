"""Experiment configs: the shipped ones load, and bad input is a ConfigError naming the field."""
from __future__ import annotations

from pathlib import Path

import pytest

from memorization.cli import main
from memorization.experiments import KINDS, load_experiment
from memorize_core import ConfigError

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "experiments"


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_shipped_configs_load(kind):
    module, cfg = load_experiment(CONFIGS / f"{kind}.yaml")
    assert cfg.kind == kind and cfg.name == kind and module.__name__ == KINDS[kind]


@pytest.mark.parametrize("config, overrides, field", [
    ("goldfish-extreme", ["kind=goldfish-xtreme"], "kind"),
    ("goldfish-extreme", ["variants=[standard, hashh]"], "variants[1]"),
    ("goldfish-extreme", ["variants=[]"], "variants"),
    ("goldfish-extreme", ["base.trainer.lr=-1"], "base.trainer.lr"),
    ("goldfish-extreme", ["base.goldfish.k=1"], "base.goldfish.k"),
    ("goldfish-extreme", ["colour=red"], "colour"),
    ("goldfish-sweep", ["ks=[1, 4]"], "ks[0]"),
    ("goldfish-sweep", ["ks=[]"], "ks"),
    ("goldfish-sweep", ["ks=[4, 4]"], "ks"),
    ("goldfish-sweep", ["ks=four"], "ks"),
    ("goldfish-sweep", ["hs=[0]"], "hs[0]"),
    ("goldfish-sweep", ["token_budget=[]"], "token_budget"),
    ("catastrophic-memorization", ["passes=0"], "passes"),
    ("catastrophic-memorization", ["sizes=[]"], "sizes"),
    ("catastrophic-memorization", ["sizes=[{name: a}, {name: a}]"], "sizes"),
    ("catastrophic-memorization", ["sizes=[{name: ''}]"], "sizes[0].name"),
    ("catastrophic-memorization", ["plot_passes=[99]"], "plot_passes"),
    ("catastrophic-memorization", ["losses=[standard, dp]"], "losses[1]"),
    ("canary-exposure", ["counts=[0, 2]"], "counts[0]"),
    ("canary-exposure", ["canaries.template=no placeholder"], "canaries.template"),
    ("canary-exposure", ["canaries.space.kind=letters"], "canaries.space.kind"),
    ("canary-exposure", ["canaries.space.colour=1"], "canaries.space.colour"),
    ("canary-exposure", ["canaries.per_count=0"], "canaries.per_count"),
    ("canary-exposure", ["duplicates.per_count=-1"], "duplicates.per_count"),
    ("canary-exposure", ["canaries.candidates=-5"], "canaries.candidates"),
    ("goldfish-extreme", ["replicate.seeds=[3]"], "replicate.seeds"),
    ("goldfish-extreme", ["replicate.seeds=[1, 1]"], "replicate.seeds"),
    ("goldfish-extreme", ["replicate.seeds=[0, -2]"], "replicate.seeds[1]"),
    ("mitigations", ["replicate.confidence=1"], "replicate.confidence"),
])
def test_bad_input_names_the_field(config, overrides, field):
    with pytest.raises(ConfigError) as info:
        load_experiment(CONFIGS / f"{config}.yaml", overrides)
    assert str(info.value).startswith(f"{field}="), str(info.value)


def test_missing_kind_and_missing_file(tmp_path):
    bare = tmp_path / "bare.yaml"
    bare.write_text("name: x\n")
    with pytest.raises(ConfigError, match=r"^kind=None"):
        load_experiment(bare)
    with pytest.raises(ConfigError, match=r"^config="):
        load_experiment(tmp_path / "nope.yaml")


def test_cli_reports_one_line_and_exit_code_2(capsys):
    assert main(["run", str(CONFIGS / "goldfish-sweep.yaml"), "ks=[1]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ks[0]=1")
