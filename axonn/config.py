"""Typed dataclass configs from YAML, dotted overrides, and the trainer's own section (TrainerConfig):
pure Python, no torch, so configs load and fail fast.

Every user-facing validation error in the project is a `ConfigError` whose message names the
field, the bad value and the fix; CLIs print it as one line on stderr and exit with code 2.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from memorize_core import ConfigError, fail

T = TypeVar("T")


def load_yaml(path: str | Path) -> dict:
    """Read a YAML mapping, turning missing or malformed files into ConfigError."""
    p = Path(path)
    if not p.is_file():
        raise fail("config", str(path), "no such file; pass the path of an existing YAML config")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise fail("config", str(path), "is not a text file (not UTF-8); pass a YAML config") from None
    except yaml.YAMLError as e:
        line = getattr(getattr(e, "problem_mark", None), "line", None)
        where = f" (line {line + 1})" if line is not None else ""
        raise fail("config", str(path), f"not valid YAML{where}; fix the syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise fail("config", str(path), "the top level must be a mapping of keys to values")
    return data


def _parse_scalar(text: str) -> Any:
    """Parse an override value the way YAML would ("3" -> 3, "true" -> True, "[1,2]" -> list); an
    empty one is the empty string (YAML's None would refuse `key=`, which is what a shell makes of
    `key=''`; write key=null for None)."""
    if not text.strip():
        return ""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b=c` overrides to a nested mapping (returns a new dict)."""
    out = _deepcopy_dict(data)
    for item in overrides:
        if "=" not in item:
            raise fail("override", item, "write overrides as key=value, e.g. trainer.lr=3e-4")
        key, _, raw = item.partition("=")
        parts = key.strip().split(".")
        if not all(parts):
            raise fail("override", item, "the key must be dotted names, e.g. trainer.lr=3e-4")
        node = out
        for p in parts[:-1]:
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                raise fail(key, raw, f"'{p}' is a value, not a section; override a leaf key")
            node = nxt
        node[parts[-1]] = _parse_scalar(raw)
    return out


def _deepcopy_dict(d: dict) -> dict:
    return {k: _deepcopy_dict(v) if isinstance(v, dict) else v for k, v in d.items()}


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, field: str) -> Any:
    """Check (and gently coerce) `value` against annotation `tp`."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, field)
            except ConfigError:
                pass  # the union's next type; none fitting is one error naming them all
        names = " or ".join(_type_name(a) for a in args)
        raise fail(field, value, f"expected {names}")
    if origin is typing.Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise fail(field, value, f"choose one of {', '.join(map(str, choices))}")
        return value
    if origin in (list, tuple):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise fail(field, value, "expected a list, e.g. [1, 2]")
        (inner, *_) = typing.get_args(tp) or (Any,)
        items = [_coerce(v, inner, f"{field}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise fail(field, value, "expected a mapping")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise fail(field, value, f"expected a section of {_type_name(tp)} keys")
        return build(tp, value, prefix=field)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise fail(field, value, "expected true or false")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise fail(field, value, "expected an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            if isinstance(value, str):
                try:
                    return float(value)  # YAML reads "1e-3" as a string
                except ValueError:
                    pass
            raise fail(field, value, "expected a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return str(value)
            raise fail(field, value, "expected a string")
        return value
    return value


def build(cls: type[T], data: dict | None, prefix: str = "") -> T:
    """Build dataclass `cls` from a mapping, rejecting unknown keys and wrong types."""
    data = data or {}
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            close = sorted(names)
            raise fail(full, value, f"unknown key; known keys here: {', '.join(close)}")
        kwargs[key] = _coerce(value, hints[key], full)
    obj = cls(**kwargs)
    check = getattr(obj, "validate", None)
    if callable(check):
        check(prefix)
    return obj


def to_dict(obj: Any) -> Any:
    """A dataclass (nested) as plain dicts/lists, for JSON/YAML dumps and W&B configs."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def check_loss_chunk(value: Any, field: str = "trainer.loss_chunk") -> None:
    """Refuse anything but 'auto', 'off' or a chunk of >= 1 tokens, in one line."""
    if isinstance(value, bool) or not (value in ("auto", "off") or (isinstance(value, int) and value >= 1)):
        raise fail(field, value, "tokens per chunk of the LM head's cross-entropy: an integer >= 1 "
                   "(e.g. 1024), 'auto' (chunk when the logits are large) or 'off' (full logits)")


# -- the trainer's section (axonn.trainer.Trainer reads it; memorization's RunConfig nests a subclass) --


# The most optimizer steps (or epochs, each at least one step) any run may ask for: a step of even the
# smallest model takes >= ~1 ms, so 1e9 steps is > 11 days nonstop; larger values are typos or junk.
MAX_STEPS = 10**9
# The most rows one batch may ask for: 2^31 rows of even 2 tokens are 4e9 tokens of activations at once.
MAX_ROWS = 2**31


@dataclasses.dataclass
class TrainerConfig:
    """Optimisation and loop settings (global batch = rows per optimizer step over all ranks)."""

    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    batch_size: int = 8
    grad_accum: int = 1
    micro_batch: int = 0  # rows per rank per micro-batch (the planner's unit); 0 = batch_size/grad_accum
    activation_checkpointing: bool = False  # recompute each decoder block's forward in backward
    # LM head + CE a chunk of tokens at a time, never the full logits (axonn/lm_head.py): tokens per
    # chunk, "auto" (when a micro-batch's logits are large) or "off"
    loss_chunk: int | str = "auto"
    compile: bool | str = "auto"  # torch.compile each transformer block; auto: on CUDA (axonn/compile.py)
    epochs: int = 1
    max_steps: int = 0  # > 0 overrides epochs
    eval_every: int = 0  # optimizer steps; 0 = only at the end
    eval_batch_size: int = 32
    seed: int = 0
    precision: str = "auto"  # auto = bf16 autocast on CUDA, fp32 on CPU
    device: str = "auto"
    progress: bool = True
    checkpoint_every: int = 0  # optimizer steps between checkpoints; 0 = none
    keep_last: int = 2  # sealed checkpoints kept (0 = all)
    max_bad_steps: int = 5  # consecutive non-finite steps before the run aborts
    collective_timeout_s: float = 60.0  # a silent rank is declared lost after this long

    def accumulation(self, shards: int = 1) -> tuple[int, int]:
        """(micro-batches per step, rows per rank per micro-batch) when the batch is cut into `shards`
        (z*data) slices; ConfigError when it does not split evenly."""
        if self.micro_batch:
            per_step = self.micro_batch * shards
            if self.batch_size % per_step:
                raise fail("trainer.micro_batch", self.micro_batch,
                           f"micro_batch x the {shards} batch shards of the grid (z*data) = {per_step} "
                           f"must divide batch_size={self.batch_size}; change either")
            return self.batch_size // per_step, self.micro_batch
        micro = self.batch_size // self.grad_accum
        if micro % shards:
            raise fail("trainer.batch_size", self.batch_size,
                       f"batch_size/grad_accum={micro} must be divisible by the {shards} batch shards of "
                       "the grid (z*data in the engine); raise batch_size")
        return self.grad_accum, micro // shards

    def validate(self, prefix: str = "trainer") -> None:
        """Raise ConfigError on out-of-range values."""
        self._validate_bounds(prefix)
        positive = {"lr": self.lr, "batch_size": self.batch_size, "grad_accum": self.grad_accum,
                    "eval_batch_size": self.eval_batch_size}
        for name, value in positive.items():
            if value <= 0:
                raise fail(f"{prefix}.{name}", value, "must be > 0")
        for name in ("warmup_steps", "max_steps", "eval_every", "epochs", "seed", "checkpoint_every",
                     "keep_last"):
            if getattr(self, name) < 0:
                raise fail(f"{prefix}.{name}", getattr(self, name), "must be >= 0")
        if self.epochs == 0 and self.max_steps == 0:
            raise fail(f"{prefix}.epochs", 0, "set epochs >= 1 or max_steps >= 1")
        if self.micro_batch < 0:
            raise fail(f"{prefix}.micro_batch", self.micro_batch, "must be >= 0 (0: batch_size/grad_accum)")
        if self.micro_batch and self.grad_accum != 1:
            raise fail(f"{prefix}.micro_batch", self.micro_batch, f"set either micro_batch (rows per rank) "
                       f"or grad_accum (={self.grad_accum}), not both")
        if self.batch_size % self.grad_accum:
            raise fail(f"{prefix}.grad_accum", self.grad_accum,
                       f"must divide batch_size={self.batch_size} (micro-batch = batch_size/grad_accum)")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise fail(f"{prefix}.min_lr_ratio", self.min_lr_ratio, "must be within [0, 1]")
        if self.grad_clip < 0:
            raise fail(f"{prefix}.grad_clip", self.grad_clip, "must be >= 0 (0 disables clipping)")
        if self.max_bad_steps < 1:
            raise fail(f"{prefix}.max_bad_steps", self.max_bad_steps, "must be >= 1")
        if not self.collective_timeout_s > 0:
            raise fail(f"{prefix}.collective_timeout_s", self.collective_timeout_s, "must be > 0 seconds")
        check_loss_chunk(self.loss_chunk, f"{prefix}.loss_chunk")
        if not (isinstance(self.compile, bool) or self.compile == "auto"):
            raise fail(f"{prefix}.compile", self.compile, "choose true (compile each transformer block), "
                       "false, or auto (compile on CUDA, not on CPU)")
        if self.precision not in ("auto", "fp32", "bf16"):
            raise fail(f"{prefix}.precision", self.precision, "choose auto, fp32 or bf16")

    def _validate_bounds(self, prefix: str) -> None:
        """Non-finite floats, betas outside [0, 1), and step counts no run could ever reach."""
        for name in ("lr", "min_lr_ratio", "weight_decay", "beta1", "beta2", "grad_clip",
                     "collective_timeout_s"):
            value = getattr(self, name)
            if not math.isfinite(value):
                raise fail(f"{prefix}.{name}", value, "must be a finite number")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise fail(f"{prefix}.{name}", getattr(self, name), "must be within [0, 1), e.g. 0.9")
        if self.weight_decay < 0:
            raise fail(f"{prefix}.weight_decay", self.weight_decay, "must be >= 0 (0: no decay), e.g. 0.1")
        if self.seed >= 2**63:
            raise fail(f"{prefix}.seed", self.seed, "must be within [0, 2**63) (a 64-bit seed); pass e.g. 0")
        for name in ("batch_size", "eval_batch_size", "micro_batch"):
            if getattr(self, name) > MAX_ROWS:
                raise fail(f"{prefix}.{name}", getattr(self, name), f"must be <= {MAX_ROWS}: no memory holds "
                           "the activations of that many rows at once; pass e.g. 8")
        for name in ("epochs", "max_steps", "warmup_steps", "eval_every", "checkpoint_every"):
            if getattr(self, name) > MAX_STEPS:
                raise fail(f"{prefix}.{name}", getattr(self, name), f"must be <= {MAX_STEPS:.0e}: even at "
                           "1 ms a step that many steps take over 11 days; no run here could finish")

    def check_gradient_hook(self, hook: Any) -> None:
        """Refuse to train with `hook` (the Trainer's gradient_hook, None for none) when these settings
        need another; the engine's own settings train with any. A caller's subclass that adds settings
        which only a particular hook carries out overrides it, so that the Trainer never trains
        without them silently."""

    def planned_steps(self, rows: int) -> tuple[int, int]:
        """(steps per epoch, total optimizer steps) of a run over `rows` training rows."""
        per_epoch = max(1, rows // self.batch_size)
        return per_epoch, self.max_steps or self.epochs * per_epoch
