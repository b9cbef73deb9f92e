"""Whether a model shape can exist here at all, judged from its config before anything is built.

A config.json can ask for anything (10^9 layers, a vocabulary of 0): building even a meta copy of
such a model takes minutes per million layers, and loading one runs the machine out of memory long
after the user should have been told. The planner's ModelShape already knows a shape's parameter
count; these checks turn it into one line naming the size and the machine's memory.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from axonn.plan.shapes import load_shape
from memorize_core import ConfigError, fail

GiB = 2**30
# Deepest decoder any published model uses is ~126 layers (Llama 3.1 405B); 10^4 leaves room for any
# experiment while keeping a meta build (about 1 ms a layer) to seconds.
MAX_LAYERS = 10**4


def machine_memory() -> tuple[float, str]:
    """(bytes, what) one process may fill: its GPU's memory on CUDA, else the machine's RAM."""
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        return float(total), f"{torch.cuda.get_device_name()} memory"
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "RAM"
    except (ValueError, OSError, AttributeError):  # no sysconf: nothing to compare against
        return float("inf"), "RAM"


def check_shape(flag: str, value: Any, config: Any) -> Any:
    """ConfigError for sizes no model can have (< 1, more than MAX_LAYERS layers); the ModelShape,
    or None for a config the planner cannot read (not a Llama- or GPT-2-style decoder)."""
    try:
        shape = load_shape(config)
    except ConfigError:
        return None
    for name, size in (("vocab_size", shape.vocab), ("hidden_size", shape.hidden),
                       ("num_hidden_layers", shape.layers), ("num_attention_heads", shape.heads),
                       ("intermediate_size", shape.ffn)):
        if size < 1:
            raise fail(flag, str(value), f"its config asks for {name}={size}; every size must be >= 1: "
                       "fix config.json or the model overrides")
    if shape.layers > MAX_LAYERS:
        raise fail(flag, str(value), f"its config asks for num_hidden_layers={shape.layers} "
                   f"(> {MAX_LAYERS}); no model that deep could be built: fix config.json or the model "
                   "overrides")
    return shape


def check_fits(flag: str, value: Any, config: Any, *, shards: int = 1, bytes_per_param: int = 2) -> None:
    """ConfigError when the weights alone (at `bytes_per_param`, split over `shards` tensor shards)
    exceed this process's memory (machine_memory): refused before anything is built or loaded."""
    shape = check_shape(flag, value, config)
    if shape is None:
        return
    need = shape.params * bytes_per_param / max(1, shards)
    have, what = machine_memory()
    if need > have:
        raise fail(flag, str(value), f"its {shape.params / 1e9:.3g}B parameters need {need / GiB:.3g} GiB "
                   f"per process for the weights alone ({bytes_per_param} bytes each, {shards} shard(s)); "
                   f"this machine's {what} is {have / GiB:.3g} GiB: use a grid that splits it (--grid) or a "
                   "smaller model")


__all__ = ["MAX_LAYERS", "check_fits", "check_shape", "machine_memory"]
