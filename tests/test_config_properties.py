"""Property tests over configs and `a.b=c` overrides: valid values round-trip, anything else is a
ConfigError naming the field -- never another exception."""
from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from axonn.config import apply_overrides, build
from memorization.config import RunConfig, RunTrainerConfig
from memorize_core import ConfigError

INT_FIELDS = {"warmup_steps": 0, "max_steps": 1, "eval_every": 0, "seed": 0, "checkpoint_every": 0,
              "keep_last": 0, "max_bad_steps": 1}
LEAVES = [f"trainer.{f.name}" for f in dataclasses.fields(RunTrainerConfig)] + [
    "data.block_len", "data.vocab_size", "data.packing", "data.held_out_fraction", "goldfish.k",
    "goldfish.h", "goldfish.strategy", "goldfish.enabled", "eval.prefix", "eval.suffix", "wandb.mode",
    "grid", "seed", "name", "parallel_mode"]
FEW = settings(max_examples=50, deadline=None)
text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12)


def _build(overrides):
    return build(RunConfig, apply_overrides({}, overrides))


@FEW
@given(name=st.sampled_from(sorted(INT_FIELDS)), data=st.data())
def test_valid_int_overrides_round_trip(name, data):
    value = data.draw(st.integers(min_value=INT_FIELDS[name], max_value=10**6))
    cfg = _build([f"trainer.{name}={value}"])
    assert getattr(cfg.trainer, name) == value


@FEW
@given(lr=st.floats(min_value=1e-8, max_value=10.0), timeout=st.floats(min_value=0.01, max_value=1e5))
def test_valid_float_overrides_round_trip(lr, timeout):
    cfg = _build([f"trainer.lr={lr!r}", f"trainer.collective_timeout_s={timeout!r}"])
    assert cfg.trainer.lr == lr and cfg.trainer.collective_timeout_s == timeout


@FEW
@given(key=st.sampled_from(LEAVES), raw=text)
def test_any_value_gives_config_or_config_error(key, raw):
    try:
        _build([f"{key}={raw}"])
    except ConfigError as e:
        assert key.split(".")[-1] in str(e) or "override" in str(e) or "goldfish" in str(e) \
            or "eval." in str(e), str(e)


@FEW
@given(section=st.sampled_from(["trainer", "data", "goldfish", "eval", "wandb", "model"]),
       key=st.from_regex(r"[a-z_]{1,10}", fullmatch=True), raw=text)
def test_unknown_keys_are_config_errors(section, key, raw):
    known = {f.name for f in dataclasses.fields(type(getattr(RunConfig(), section)))}
    try:
        _build([f"{section}.{key}={raw}"])
        assert key in known
    except ConfigError as e:
        assert f"{section}." in str(e) or "override" in str(e), str(e)


@FEW
@given(items=st.lists(st.tuples(st.sampled_from(LEAVES + ["x", "trainer", "a.b.c"]), text), max_size=4),
       junk=st.lists(text, max_size=2))
def test_override_lists_never_crash(items, junk):
    try:
        _build([f"{k}={v}" for k, v in items] + junk)
    except ConfigError:
        pass
