"""What the trainer does to a model's transformer blocks for speed and memory: per-block
torch.compile (`trainer.compile`) and activation checkpointing (`trainer.activation_checkpointing`).

Compile: each transformer block is compiled on its own.

One block at a time keeps the compile short (every block of a model has the same code, so after the
first the rest hit the cache) and fuses what sits between the GEMMs: RMSNorm, rotary, SwiGLU, the
residual adds and the casts of autocast.  The engine's layers meet the compiler at their boundary:
a `ParallelLinear` that communicates runs its autograd Functions (collectives, the scheduler's
prefetch and deferred reductions, the byte counters) outside the graph (`torch.compiler.disable`,
a clean graph break on either side), and one that does not (a 1,1,1,1 grid, no GEMM tuning) is a
plain F.linear the compiler sees through.

`auto` compiles where it pays: on CUDA with Triton present (Inductor's GPU code generator).  On CPU
it stays off: Inductor's C++ warm-up takes tens of seconds per model shape, more than a tiny CPU run
lasts (docs/engine.md has the figure).  `true` compiles on any device that has a code generator
(Triton on CUDA, a C++ compiler on CPU) and refuses in one line where there is none; `auto` on a GPU
without Triton warns in one line and runs eagerly.
"""
from __future__ import annotations

import os
import shutil
import warnings

import torch
from torch import nn
from torch.utils._triton import has_triton

from memorize_core import fail


def compiler_missing(device: torch.device) -> str:
    """Why torch.compile's default backend cannot generate code for `device` here ("" when it can)."""
    if device.type == "cuda":
        return "" if has_triton() else "Triton is not installed (pip install triton)"
    if device.type == "cpu":
        cxx = os.environ.get("CXX") or "g++"
        return "" if shutil.which(cxx) or shutil.which("c++") else f"no C++ compiler ({cxx}) on PATH"
    return f"no torch.compile code generator for {device.type} is known here"


def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's transformer blocks: modules whose class the model names in `_no_split_modules`
    (transformers' list of the blocks that must stay whole: LlamaDecoderLayer, GPT2Block, ...)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def resolve(setting: bool | str, device: torch.device, field: str = "trainer.compile") -> bool:
    """Whether to compile: `auto` -> on CUDA with a code generator (one warning line if it is missing);
    true -> ConfigError where no code generator exists; false -> no."""
    if not (isinstance(setting, bool) or setting == "auto"):
        raise fail(field, setting, "choose true (compile each transformer block), false, or auto")
    if setting is False:
        return False
    missing = compiler_missing(device)
    if setting is True:
        if missing:
            raise fail(field, True, f"torch.compile cannot run on {device.type} here: {missing}; "
                       "set it to false or auto")
        return True
    if device.type != "cuda":
        return False
    if missing:
        warnings.warn(f"{field}=auto: running eagerly, {missing}", stacklevel=2)
        return False
    return True


def compile_blocks(model: nn.Module, setting: bool | str = "auto", device: torch.device | None = None,
                   *, backend: str = "inductor", field: str = "trainer.compile") -> int:
    """Compile each transformer block of `model` in place when `setting` says so; returns how many
    were compiled (0: the model runs eagerly). `backend` is torch.compile's (tests use aot_eager)."""
    device = device or next(model.parameters()).device
    if not resolve(setting, device, field):
        return 0
    found = blocks(model)
    if not found and setting is True:
        raise fail(field, True, f"{type(model).__name__} names no transformer blocks (_no_split_modules); "
                   "set it to false")
    for block in found:
        block.compile(backend=backend)
    return len(found)


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute every decoder block's forward during backward (Hugging Face models).

    Non-reentrant torch.utils.checkpoint: the recomputed forward runs the same ops on the same
    inputs, so losses and gradients are bit-identical to running without it; only memory changes.
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise fail("trainer.activation_checkpointing", True, f"{type(model).__name__} does not support "
                   "gradient checkpointing; use a Hugging Face causal LM or set it to false")
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.x
    if callable(enable):
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
