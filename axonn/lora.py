"""Adapters on a parallelized model: `add_lora` freezes it and wraps named layers in `LoraLinear`
(axonn/layers/lora.py), and the streaming views that export it.

`add_lora(model, names, r, alpha)` runs after `parallelize` (and after `load_pretrained`: the base's
state-dict names are still the serial model's then).  It freezes every parameter, wraps each named
ParallelLinear, refreshes the model's EngineHandle layouts (the base weights become
`<name>.base_layer.weight`, the factors `<name>.lora_A.weight` / `<name>.lora_B.weight`) and rebuilds
the gradient buckets over what now trains -- the factors only, reduced over the data ranks after
their layers reduce-scattered them over Z.  Checkpoints (axonn/checkpoint.py) then save and reshard
the model like any other, optimizer state included.

`merged_layouts(model)` yields what `axonn.state.save_pretrained` streams for a plain Hugging Face
folder with the adapters folded in (each base piece + scale * B A, computed on its own shard);
`adapter_layouts(model)` the factors alone under peft's adapter-file names.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace

import torch
from torch import nn

from axonn.engine import engine_of, module_layouts, named_layouts, set_engine
from axonn.layers.layout import ParamSpec
from axonn.layers.lora import LoraLinear
from axonn.layers.modules import ParallelLinear
from axonn.swap import _swap, enrol_buckets

Layouts = Iterator[tuple[str, torch.Tensor, ParamSpec | None]]


def lora_modules(model: nn.Module) -> dict[str, LoraLinear]:
    """The model's adapted layers by module name, in registration order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}


def add_lora(model: nn.Module, names: Sequence[str], r: int, alpha: float, *, dropout: float = 0.0,
             seed: int | None = None) -> nn.Module:
    """Freeze the parallelized `model` and put a rank-`r` adapter on each named ParallelLinear; returns it.

    With `seed`, the factors are drawn in the model's module order from a forked RNG seeded with it,
    as peft draws them (a serial peft model with the same seed starts from the same adapters); the
    global RNG is left untouched.  Without one they come from the current RNG state.  Call on every
    rank: each draws the full factors and keeps its piece."""
    handle = engine_of(model)
    if handle is None:
        raise ValueError("add_lora takes a model axonn.parallelize has sharded; use peft on a plain model")
    modules = dict(model.named_modules())
    wanted = set(names)
    bad = [n for n in names if not isinstance(modules.get(n), ParallelLinear)]
    if bad:
        raise ValueError(f"{bad[:3]} are not parallel linear layers of this model")
    model.requires_grad_(False)
    order = [n for n in modules if n in wanted]  # the model's order: the RNG draws follow it
    with torch.random.fork_rng(devices=[], enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        for name in order:
            _swap(model, name, LoraLinear(modules[name], r, alpha, dropout=dropout))
    set_engine(model, replace(handle, layouts=module_layouts(model)))
    enrol_buckets(model, handle.scheduler, handle.grid, handle.options)
    return model


def merged_layouts(model: nn.Module) -> Layouts:
    """(serial name, local piece, layout) of the model with every adapter merged into its base weight,
    the adapters left out: what `save_pretrained(model, out, tensors=...)` writes as a plain HF folder.
    A collective (each adapter's A is gathered over Z): iterate it on every rank."""
    merged = {f"{name}.base_layer.weight": m for name, m in lora_modules(model).items()}
    for key, t, spec in named_layouts(model):
        if ".lora_A." in key or ".lora_B." in key:
            continue
        m = merged.get(key)
        if m is not None:
            yield key.replace(".base_layer.", "."), m.merged_weight(), spec
        else:
            yield key.replace(".base_layer.", "."), t.detach(), spec


def adapter_layouts(model: nn.Module, prefix: str = "base_model.model.") -> Layouts:
    """(peft adapter-file name, local piece, layout) of every adapter factor: peft writes
    `base_model.model.<module>.lora_A.weight` (no adapter name) in adapter_model.safetensors."""
    for key, t, spec in named_layouts(model):
        if ".lora_A." in key or ".lora_B." in key:
            yield prefix + key, t.detach(), spec


__all__ = ["add_lora", "adapter_layouts", "lora_modules", "merged_layouts"]
