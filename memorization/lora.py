"""LoRA through peft: low-rank adapters on a frozen base model, as a memorization mitigation.

`model.lora.enabled` wraps the built model with peft's `get_peft_model` right after it is built:
every base weight is frozen and only the adapters (A: [r, in], B: [out, r], delta W = B A * alpha/r)
train; the Trainer's optimizer takes only `requires_grad` parameters, so the base stays bit-identical.

Grids: serial and data-parallel (1,1,1,D). At 1,1,1,D the model is not handed to
`axonn.parallelize` (nothing is split, and its swapped layers would not keep the base frozen); the
Trainer still shards the batch over the data ranks and `axonn.sync_gradients` sums the gradients of
the trainable parameters -- only the adapters -- so the run equals the serial one. Grids that split
weights over X, Y or Z are refused: peft's layers are not sharded by the engine.

Export (`model.lora.export`): `merged` (default) folds the adapters into the base weights
(`merge_and_unload` on a copy) and writes a plain Hugging Face folder, which every evaluator loads
with AutoModelForCausalLM; `adapter` writes peft's adapter folder (adapter_config.json naming the
base model folder, adapter_model.safetensors), which AutoModelForCausalLM (or PeftModel) loads on
top of that base -- so it needs a base that exists on disk: a pretrained model without overrides.
"""
from __future__ import annotations

import copy
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from axonn.grid import ProcessGrid
from memorization.models import is_pretrained
from memorize_core import fail

EXPORTS = ("merged", "adapter")
ALL_LINEAR = "all-linear"
NOTE = "lora.json"  # what the adapter was trained on, next to the exported model


@dataclass
class LoraSettings:
    """LoRA adapters (peft): rank, scale alpha/r, dropout, which modules, and what to export."""

    enabled: bool = False
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    # module names (peft matches a name or a dotted suffix), one regex string, or "all-linear"
    # (every linear layer but the LM head)
    target_modules: list[str] | str = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    export: str = "merged"  # merged: a plain HF folder; adapter: peft's adapter folder

    def validate(self, prefix: str = "model.lora") -> None:
        """Range checks."""
        if self.r < 1:
            raise fail(f"{prefix}.r", self.r, "must be >= 1 (the adapter rank)")
        if not self.alpha > 0:
            raise fail(f"{prefix}.alpha", self.alpha, "must be > 0 (the update is scaled by alpha/r)")
        if not 0.0 <= self.dropout < 1.0:
            raise fail(f"{prefix}.dropout", self.dropout, "must be within [0, 1)")
        if self.export not in EXPORTS:
            raise fail(f"{prefix}.export", self.export, f"choose one of {', '.join(EXPORTS)}")
        if not self.target_modules or (isinstance(self.target_modules, list)
                                       and not all(isinstance(t, str) and t for t in self.target_modules)):
            raise fail(f"{prefix}.target_modules", self.target_modules,
                       f"name modules, e.g. [q_proj, v_proj], or write {ALL_LINEAR}")
        if isinstance(self.target_modules, str) and self.target_modules != ALL_LINEAR:
            try:  # peft matches a string as one regular expression over the module names
                re.compile(self.target_modules)
            except re.error as e:
                raise fail(f"{prefix}.target_modules", self.target_modules, f"is not a valid regular "
                           f"expression ({e}); list module names instead, e.g. [q_proj, v_proj]") from None

    @property
    def scale(self) -> float:
        """The factor peft multiplies B A by (alpha / r)."""
        return self.alpha / self.r


def check_lora_run(cfg: Any, dims: Sequence[int] | None) -> None:
    """ConfigError before any work when LoRA cannot run as configured (grid, adapter export).

    `dims` is the requested X,Y,Z,D (memorization.parallel.requested_grid), None for `auto`: that
    grid is checked once resolved (check_lora_grid).
    """
    lora = cfg.model.lora
    if not lora.enabled:
        return
    if dims:
        check_lora_grid(dims)
    if lora.export == "adapter":
        m = cfg.model
        why = ("model.random_init builds fresh weights that are not on disk" if m.random_init
               else "model.overrides change the base that the folder on disk holds" if m.overrides
               else None if is_pretrained(m.name)
               else f"{m.name} is a random-init shape with no weights on disk")
        if why:
            raise fail("model.lora.export", "adapter", f"an adapter folder applies to its base model folder, "
                       f"but {why}; use model.lora.export=merged")


def check_lora_grid(grid: ProcessGrid | Sequence[int]) -> None:
    """Refuse grids that split weights (X, Y or Z > 1): LoRA runs serial or data-parallel only."""
    dims = tuple(grid.dims if isinstance(grid, ProcessGrid) else grid)
    x, y, z, data = dims
    if x * y * z > 1:
        spec = ",".join(map(str, dims))
        raise fail("--grid", spec, f"LoRA (model.lora.enabled) runs serial or data-parallel only, its "
                   "adapters are not sharded over X/Y/Z; "
                   f"use --grid 1,1,1,{x * y * z * data} or turn LoRA off")


def linear_names(model: torch.nn.Module) -> list[str]:
    """Distinct leaf names of the model's linear layers (what target_modules usually names)."""
    names: list[str] = []
    for name, m in model.named_modules():
        leaf = name.rpartition(".")[2]
        is_linear = isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"
        if is_linear and leaf not in names:
            names.append(leaf)
    return names


def _unmatched(targets: list[str] | str, model: torch.nn.Module) -> list[str] | str | None:
    """The targets that match no module name, by peft's rules (exact, dotted suffix, or a full regex)."""
    if targets == ALL_LINEAR:
        return None
    names = [n for n, _ in model.named_modules() if n]
    if isinstance(targets, str):
        return None if any(re.fullmatch(targets, n) for n in names) else targets
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    return missing or None


def apply_lora(model: torch.nn.Module, settings: LoraSettings, *, seed: int = 0) -> torch.nn.Module:
    """Freeze `model` and wrap it with peft LoRA adapters (seeded init; the global RNG is untouched)."""
    from peft import LoraConfig, get_peft_model  # deferred: peft +2.7 s, LoRA runs only

    field_name = "model.lora.target_modules"
    missing = _unmatched(settings.target_modules, model)
    if missing is not None:
        raise fail(field_name, settings.target_modules, f"{missing!r} matches no module of "
                   f"{type(model).__name__}; its linear layers are {', '.join(linear_names(model))} "
                   f"(or write {ALL_LINEAR})")
    config = LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=settings.target_modules, bias="none", task_type="CAUSAL_LM")
    # A forked RNG: the adapters' init is a function of the run seed alone, and everything drawn
    # later (dropout, data order) is the same stream as without LoRA.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            return get_peft_model(model, config)
        except (ValueError, TypeError) as e:  # e.g. a matched module of a type peft cannot adapt
            lines = [s.strip() for s in str(e).strip().splitlines() if s.strip()]
            why = (lines or ["?"])[-1][:200]
            raise fail(field_name, settings.target_modules, f"peft cannot adapt it ({why}); "
                       f"target linear layers: {', '.join(linear_names(model))}") from None


def trainable_params(model: torch.nn.Module) -> int:
    """Number of distinct parameters the optimizer updates (requires_grad)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters() if p.requires_grad}.values())


def export_lora(model: torch.nn.Module, out: str | Path, settings: LoraSettings, *, tokenizer: Any = None,
                base_dir: str | Path | None = None, base_name: str = "") -> Path:
    """Write the merged model (plain HF folder) or peft's adapter folder to `out`, with the tokenizer.

    The training model is left as it is (merging happens on a copy), so evaluation after export
    still sees the adapters unmerged and the base weights bit-identical.
    """
    out = Path(out)
    if settings.export == "merged":
        merged = copy.deepcopy(model).merge_and_unload(safe_merge=True)
        merged.save_pretrained(out, safe_serialization=True)
    else:
        if base_dir is None:
            raise fail("model.lora.export", "adapter", "the base model has no folder on disk; use merged")
        config = model.peft_config["default"]
        saved = config.base_model_name_or_path
        config.base_model_name_or_path = str(Path(base_dir).resolve())  # loaders find the base here
        try:
            model.save_pretrained(out, safe_serialization=True)
        finally:
            config.base_model_name_or_path = saved
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    targets = model.peft_config["default"].target_modules
    note = {"base_model": base_name, "base_model_dir": str(Path(base_dir).resolve()) if base_dir else None,
            "export": settings.export, "r": settings.r, "alpha": settings.alpha, "dropout": settings.dropout,
            "target_modules": sorted(targets) if isinstance(targets, (set, list)) else targets,
            "trainable_params": trainable_params(model)}
    (out / NOTE).write_text(json.dumps(note, indent=1))
    return out


__all__ = ["LoraSettings", "apply_lora", "check_lora_grid", "check_lora_run", "export_lora", "linear_names",
           "trainable_params"]
