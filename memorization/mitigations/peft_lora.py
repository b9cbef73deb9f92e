"""LoRA through peft: low-rank adapters on a frozen base model, as a memorization mitigation.

`model.lora.enabled` wraps the built model with peft's `get_peft_model` right after it is built:
every base weight is frozen and only the adapters (A: [r, in], B: [out, r], delta W = B A * alpha/r)
train; the Trainer's optimizer takes only `requires_grad` parameters, so the base stays bit-identical.

Grids: every grid.  Serial and data-parallel (1,1,1,D) runs keep peft's model: it is not handed to
`axonn.parallelize` (nothing is split); the Trainer shards the batch over the data ranks and
`axonn.sync_gradients` sums the gradients of the trainable parameters -- only the adapters -- so the
run equals the serial one.  On a grid that splits weights over X, Y or Z the base model is
parallelized (pretrained weights streamed into the shards) and `axonn.lora.add_lora` puts the
adapters on the engine's sharded layers (axonn/layers/lora.py: A split like its base's input, B like
its output); the modules adapted are exactly the ones peft would adapt (`lora_targets`, peft's own
matching on a meta copy) and the adapters start from peft's numbers for the same seed, so the run
equals the serial peft run.  Its checkpoints use the engine's names (`q_proj.lora_A.weight`), peft's
use peft's: a LoRA checkpoint resumes at any grid of the same kind (tensor-split or not; the engine
reshards it) and is refused in one line across kinds (`check_lora_resume`).  Adapter dropout on a
tensor-split grid is refused: its mask would be drawn per shard, not once for the full activation.

Export (`model.lora.export`): `merged` (default) folds the adapters into the base weights
(`merge_and_unload` on a copy) and writes a plain Hugging Face folder, which every evaluator loads
with AutoModelForCausalLM; `adapter` writes peft's adapter folder (adapter_config.json naming the
base model folder, adapter_model.safetensors), which AutoModelForCausalLM (or PeftModel) loads on
top of that base -- so it needs a base that exists on disk: a pretrained model without overrides.
A sharded model exports from its shards (a collective): merged weights streamed one tensor at a
time (`axonn.lora.merged_layouts`), adapters gathered into peft's adapter file.
"""
from __future__ import annotations

import contextlib
import copy
import json
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from axonn import checkpoint
from axonn.engine import is_parallel, model_grid
from axonn.grid import ProcessGrid
from axonn.lora import adapter_layouts, add_lora, lora_modules, merged_layouts
from axonn.plan.memory import Adapters
from axonn.state import save_pretrained
from memorization.models import is_pretrained, trainable_params
from memorize_core import fail

EXPORTS = ("merged", "adapter")
ALL_LINEAR = "all-linear"
NOTE = "lora.json"  # what the adapter was trained on, next to the exported model
PEFT_PREFIX = "base_model.model."  # peft's wrapper modules, in front of every name of a peft model


# peft's usual choice for Llama-family attention: every projection of every attention block
DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


@dataclass
class LoraSettings:
    """LoRA adapters (peft): rank, scale alpha/r, dropout, which modules, and what to export."""

    enabled: bool = False
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    # module names (peft matches a name or a dotted suffix), one regex string, or "all-linear"
    # (every linear layer but the LM head)
    target_modules: list[str] | str = field(default_factory=DEFAULT_TARGETS.copy)
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


def tensor_split(dims: Sequence[int] | ProcessGrid) -> bool:
    """True when the grid splits weights (X, Y or Z > 1): LoRA runs on the engine's sharded layers."""
    x, y, z, _ = tuple(dims.dims if isinstance(dims, ProcessGrid) else dims)
    return x * y * z > 1


def check_lora_grid(lora: Any, dims: Sequence[int] | None) -> None:
    """ConfigError when LoRA cannot run on grid `dims` (None: not known yet): adapter dropout on a
    tensor split (its mask would be drawn per shard)."""
    if lora.enabled and dims and tensor_split(dims) and lora.dropout > 0:
        raise fail("model.lora.dropout", lora.dropout, f"adapter dropout runs on serial or 1,1,1,D grids "
                   f"only (on grid {','.join(map(str, dims))} its mask would be drawn per shard); set "
                   "model.lora.dropout=0 or use a grid without a tensor split")


def check_lora_run(cfg: Any, dims: Sequence[int] | None) -> None:
    """ConfigError before any work when LoRA cannot run as configured (dropout on a tensor split,
    adapter export without a base on disk).

    `dims` is the requested X,Y,Z,D (memorization.train.parallel.requested_grid), None for `auto`."""
    lora = cfg.model.lora
    if not lora.enabled:
        return
    check_lora_grid(lora, dims)
    if lora.export == "adapter":
        m = cfg.model
        why = ("model.random_init builds fresh weights that are not on disk" if m.random_init
               else "model.overrides change the base that the folder on disk holds" if m.overrides
               else None if is_pretrained(m.name)
               else f"{m.name} is a random-init shape with no weights on disk")
        if why:
            raise fail("model.lora.export", "adapter", f"an adapter folder applies to its base model folder, "
                       f"but {why}; use model.lora.export=merged")


def _engine_name(peft_name: str) -> str:
    """A peft state-dict name as the engine's adapted model spells it."""
    return peft_name.removeprefix(PEFT_PREFIX).replace(".default.", ".")


def check_lora_resume(path: Path, meta: dict, peft_model: torch.nn.Module, dims: Sequence[int]) -> None:
    """ConfigError unless a LoRA checkpoint fits this run: saved at a grid of the same kind (peft's
    names without a tensor split, the engine's with one; the engine reshards within a kind) and
    holding every tensor of `peft_model` (a meta peft copy of this run's model) with its shape."""
    saved = tuple(meta.get("grid") or (1, 1, 1, 1))
    if tensor_split(saved) != tensor_split(dims):
        kind = "a tensor-split grid" if tensor_split(saved) else "a grid without a tensor split"
        raise fail("--resume", str(path), f"is a LoRA checkpoint saved at grid {','.join(map(str, saved))}, "
                   f"{kind}; this run's grid {','.join(map(str, dims))} keeps its adapters in the other "
                   f"form: resume at {kind} (e.g. --grid {','.join(map(str, saved))})")
    if not tensor_split(dims):
        checkpoint.check_fits(path, meta, peft_model)
        return
    seen: set[int] = set()
    for name, t in peft_model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        info = meta["tensors"].get(f"param/{_engine_name(name)}")
        if info is None or list(info["shape"]) != list(t.shape):
            raise fail("--resume", str(path), f"has no tensor {_engine_name(name)} of shape "
                       f"{tuple(t.shape)}; it was saved from another model or LoRA config: resume with the "
                       "same config")


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


def lora_targets(model: torch.nn.Module, settings: LoraSettings) -> list[str]:
    """Names of the modules peft adapts in `model` (a serial model, e.g. a meta copy: peft wraps it),
    in module order: the layers `axonn.lora.add_lora` adapts on a grid."""
    # on a meta model, peft's adapters go to the meta device too: drawn on the CPU, a 405B model's
    # adapters took a minute of random init for a list of names
    meta = next(model.parameters()).is_meta
    config = getattr(model, "config", None)
    key = (config.to_json_string(), repr(settings)) if meta and hasattr(config, "to_json_string") else None
    if key is not None and key in _TARGETS:  # a plan asks it of every arm of one model
        return list(_TARGETS[key])
    with warnings.catch_warnings(), torch.device("meta") if meta else contextlib.nullcontext():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' would precede our lines
        peft_model = apply_lora(model, settings)
    names = [name.removeprefix(PEFT_PREFIX) for name, m in peft_model.named_modules()
             if name.startswith(PEFT_PREFIX) and hasattr(m, "lora_A")]
    if key is not None:
        _TARGETS.clear()
        _TARGETS[key] = tuple(names)
    return names


_TARGETS: dict[tuple[str, str], tuple[str, ...]] = {}


def apply_sharded_lora(model: torch.nn.Module, settings: LoraSettings, targets: Sequence[str], *,
                       seed: int = 0) -> torch.nn.Module:
    """Freeze a parallelized `model` and adapt `targets` (lora_targets) on its sharded layers, starting
    from the adapters peft would draw for `seed`."""
    return add_lora(model, targets, settings.r, settings.alpha, dropout=settings.dropout, seed=seed)


def frozen_dtype(precision: str) -> torch.dtype | None:
    """The dtype a LoRA run loads its frozen base in, given the run's resolved precision (the plan's):
    bf16 where the run computes in bf16, else None (as built: fp32)."""
    return torch.bfloat16 if precision == "bf16" else None


def planner_adapters(settings: LoraSettings, serial: torch.nn.Module, precision: str) -> Adapters:
    """The planner's view of a LoRA run (axonn.plan.memory.Adapters) on `serial` (a meta model):
    rank, the block Linears adapted (all of them when a name is not one the planner knows) and the
    frozen base's bytes per weight (`precision` is the run's activation precision, bf16 or fp32)."""
    leaves = tuple(sorted({t.rpartition(".")[2] for t in lora_targets(serial, settings)}))
    known = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    return Adapters(rank=settings.r, targets=leaves if set(leaves) <= known else (),
                    frozen_bytes=2 if precision == "bf16" else 4)


def _peft_config(settings: LoraSettings, targets: list[str], base_dir: str | Path) -> Any:
    """peft's LoraConfig of an adapter trained on the engine's layers (what peft would have saved)."""
    from peft import LoraConfig  # deferred: peft +2.7 s, LoRA runs only

    return LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                      target_modules=targets, bias="none", task_type="CAUSAL_LM",
                      base_model_name_or_path=str(Path(base_dir).resolve()))


def _export_sharded(model: torch.nn.Module, out: Path, settings: LoraSettings,
                    base_dir: str | Path | None) -> list[str]:
    """A sharded LoRA model's export from its shards (a collective; rank 0 writes); the target leaves."""
    targets = sorted({name.rpartition(".")[2] for name in lora_modules(model)})  # leaves, as peft records
    if settings.export == "merged":
        save_pretrained(model, out, tensors=merged_layouts(model))
        return targets
    if base_dir is None:
        raise fail("model.lora.export", "adapter", "the base model has no folder on disk; use merged")
    main = model_grid(model).rank == 0
    tensors = {key: spec.full_from_local(t).cpu().contiguous() if spec is not None else t.cpu().contiguous()
               for key, t, spec in adapter_layouts(model, PEFT_PREFIX)}
    if main:
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        _peft_config(settings, targets, base_dir).save_pretrained(str(out))
    return targets


def export_lora(model: torch.nn.Module, out: str | Path, settings: LoraSettings, *, tokenizer: Any = None,
                base_dir: str | Path | None = None, base_name: str = "") -> Path:
    """Write the merged model (plain HF folder) or peft's adapter folder to `out`, with the tokenizer.

    The training model is left as it is (merging happens on a copy), so evaluation after export
    still sees the adapters unmerged and the base weights bit-identical.
    """
    out = Path(out)
    if is_parallel(model):  # on a tensor-split grid: from the shards, every rank taking part
        targets = _export_sharded(model, out, settings, base_dir)
        if model_grid(model).rank == 0:
            _write_note(model, out, settings, tokenizer, base_dir, base_name, targets)
        return out
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
    _write_note(model, out, settings, tokenizer, base_dir, base_name,
                model.peft_config["default"].target_modules)
    return out


def _write_note(model: torch.nn.Module, out: Path, settings: LoraSettings, tokenizer: Any,
                base_dir: str | Path | None, base_name: str, targets: Any) -> None:
    """The tokenizer and lora.json (what the adapter was trained on) next to the exported model."""
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    note = {"base_model": base_name, "base_model_dir": str(Path(base_dir).resolve()) if base_dir else None,
            "export": settings.export, "r": settings.r, "alpha": settings.alpha, "dropout": settings.dropout,
            "target_modules": sorted(targets) if isinstance(targets, (set, list)) else targets,
            "trainable_params": trainable_params(model)}
    (out / NOTE).write_text(json.dumps(note, indent=1))


__all__ = ["LoraSettings", "apply_lora", "apply_sharded_lora", "check_lora_resume", "check_lora_run",
           "export_lora", "frozen_dtype", "linear_names", "lora_targets", "planner_adapters", "tensor_split"]
