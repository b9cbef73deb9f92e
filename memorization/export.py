"""`memorize export CKPT DIR`: a training checkpoint as a serial Hugging Face model folder.

The checkpoint's shards are consolidated (every shard's sha256 verified), loaded into the model its
config names, and written with `save_pretrained` plus the checkpoint's tokenizer. DIR may hold other
files: `--overwrite` replaces the names this export writes and removes what an earlier export
recorded in DIR's ledger (memorization/outputs.py), never a file that only looks like an export's.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from memorization.outputs import (
    check_inputs,
    check_writable,
    record_entries,
    recorded_entries,
    remove_entries,
)
from memorize_core import fail


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, overwrite: bool = False) -> dict[str, Any]:
    """Consolidate `checkpoint` into a Hugging Face folder at `out`; return what was written."""
    from axonn.checkpoint import consolidate, read_meta  # deferred: torch, only once the inputs are checked

    read_meta(checkpoint, verify=False)  # a clear error before anything else
    dest = Path(out)
    check_inputs("out", out, {"checkpoint": checkpoint})  # it would write over what it reads
    check_writable("out", out)
    if dest.exists() and any(dest.iterdir()) and not overwrite:
        raise fail("out", str(out), "exists and is not empty; choose a new folder or pass --overwrite "
                   "(which replaces only the files export writes)")
    meta, state = consolidate(checkpoint)  # verifies every shard's sha256
    if not meta.get("model_config"):
        raise fail("checkpoint", str(checkpoint), "holds no model config; it was not written by memorize")
    model = _model_from(meta["model_config"], state, checkpoint)
    _write(model, Path(checkpoint) / "tokenizer", dest)
    return {"checkpoint": str(checkpoint), "step": meta["step"], "out": str(dest)}


def _model_from(model_config: dict, state: dict, checkpoint: str | Path):
    from transformers import AutoConfig, AutoModelForCausalLM  # deferred: the slow import, after the checks

    cfg_dict = dict(model_config)
    config = AutoConfig.for_model(cfg_dict.pop("model_type"), **cfg_dict)
    model = AutoModelForCausalLM.from_config(config)
    tied = getattr(config, "tie_word_embeddings", False)
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not (tied and k.endswith("lm_head.weight"))]
    if missing or result.unexpected_keys:
        raise fail("checkpoint", str(checkpoint), f"does not match its model config (missing "
                   f"{missing[:2]}, unexpected {result.unexpected_keys[:2]}); it is damaged")
    if tied:
        model.tie_weights()
    return model


def _write(model, tokenizer: Path, out: Path) -> None:
    """save_pretrained + the tokenizer into a scratch folder in OUT, then moved in by name."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".export-", dir=out))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer.is_dir():
            for f in tokenizer.iterdir():
                if f.is_file():
                    shutil.copy2(f, tmp / f.name)
        names = sorted(p.name for p in tmp.iterdir())
        # an earlier export's files this one does not write again (its weight shards): stale, removed
        stale = [n for n in recorded_entries(out) if n not in names]
        remove_entries(out, dict.fromkeys(names + stale))
        for name in names:
            (tmp / name).replace(out / name)
        record_entries(out, "export", names)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


__all__ = ["export_checkpoint"]
