"""Typed dataclass configs from YAML, dotted overrides, and the house error type.

Every user-facing validation error in the project is a `ConfigError` whose message names the
field, the bad value and the fix; CLIs print it as one line on stderr and exit with code 2.
"""
from __future__ import annotations

import dataclasses
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
        data = yaml.safe_load(p.read_text())
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
    """Parse an override value the way YAML would ("3" -> 3, "true" -> True, "[1,2]" -> list)."""
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
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, field)
            except ConfigError as e:
                errors.append(e)
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
