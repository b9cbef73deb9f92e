"""Full serial state dicts out of a parallel model, and sharded loading straight from safetensors.

`full_state_dict` gathers one parameter at a time (so the transient cost is one full tensor), with
exactly the keys and layouts of the serial Hugging Face model (GPT-2 Conv1D weights transposed back).
`load_pretrained` reads each rank's piece -- a contiguous row range and column range of the stored
tensor -- with positioned reads from the safetensors files: no mmap of the whole file, and never the
full tensor on one rank (a column slice is read a bounded chunk of rows at a time).
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from axonn.engine import layouts_of, model_grid, named_layouts
from axonn.layers.layout import ParamSpec
from memorize_core import fail

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_CHUNK_BYTES = 8 * 2**20  # bound on the staging buffer for column-sliced reads


def _gather_all(model: nn.Module, pick: Callable[[torch.Tensor], torch.Tensor | None],
                rank0_only: bool, offload: bool) -> dict[str, torch.Tensor]:
    keep = not rank0_only or model_grid(model).rank == 0
    layouts = layouts_of(model)
    done: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for key, t in model.state_dict(keep_vars=True).items():
        if id(t) not in done:
            src = pick(t)
            if src is None:
                continue
            spec = layouts.get(key)
            full = spec.full_from_local(src.detach()) if spec is not None else src.detach()
            full = full.cpu() if offload else full
            if full.untyped_storage().data_ptr() == src.untyped_storage().data_ptr():
                full = full.clone()  # nothing was gathered: never hand out the live parameter
            done[id(t)] = full
        if keep:
            out[key] = done[id(t)]
    return out


def full_state_dict(model: nn.Module, *, rank0_only: bool = False, offload_to_cpu: bool = True
                    ) -> dict[str, torch.Tensor]:
    """The serial model's state dict (same keys, full tensors); a collective: call on every rank.

    With `rank0_only` the other ranks return {} (they still take part in the gathers)."""
    return _gather_all(model, lambda t: t, rank0_only, offload_to_cpu)


def full_grad_dict(model: nn.Module, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """Full serial-layout gradients of every parameter that has one (after `sync_gradients`)."""
    return _gather_all(model, lambda t: t.grad if isinstance(t, nn.Parameter) else None, rank0_only, True)


class SafetensorsSlices:
    """Positioned reads of row/column ranges of tensors in one or more .safetensors files."""

    def __init__(self, hf_dir: str | os.PathLike) -> None:
        root = self.folder = Path(hf_dir)
        files = [root] if root.is_file() else sorted(root.glob("*.safetensors"))
        if not files:
            raise fail("load_pretrained", str(hf_dir), "no .safetensors files there; save the model with "
                       "save_pretrained(..., safe_serialization=True)")
        self.entries: dict[str, tuple[Path, str, list[int], int]] = {}
        for f in files:
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(n))
            base = 8 + n
            for name, info in header.items():
                if name != "__metadata__":
                    self.entries[name] = (f, info["dtype"], info["shape"], base + info["data_offsets"][0])

    def shape(self, name: str) -> list[int]:
        """Stored shape of a tensor."""
        return self.entries[name][2]

    def read(self, name: str, r0: int, r1: int, c0: int = 0, c1: int | None = None) -> torch.Tensor:
        """Rows [r0, r1) (and for 2-D, columns [c0, c1)) of a stored tensor, in its stored dtype."""
        path, dtype_name, shape, offset = self.entries[name]
        dtype = _DTYPES[dtype_name]
        esize = torch.empty((), dtype=dtype).element_size()
        row_elems = 1
        for s in shape[1:]:
            row_elems *= s
        width = row_elems if c1 is None or len(shape) < 2 else (c1 - c0) * (row_elems // shape[1])
        out = torch.empty((r1 - r0) * width * esize, dtype=torch.uint8)
        with open(path, "rb", buffering=0) as fh:
            fd = fh.fileno()
            if width == row_elems:  # whole rows: one contiguous read straight into the result
                _pread_into(fd, out, offset + r0 * row_elems * esize)
            else:  # a column range: stage a bounded number of full rows at a time
                step = max(1, _CHUNK_BYTES // (row_elems * esize))
                inner = row_elems // shape[1]
                dst = out.view(r1 - r0, width * esize)
                for a in range(r0, r1, step):
                    b = min(a + step, r1)
                    buf = torch.empty((b - a) * row_elems * esize, dtype=torch.uint8)
                    _pread_into(fd, buf, offset + a * row_elems * esize)
                    rows = buf.view(b - a, row_elems * esize)
                    dst[a - r0:b - r0] = rows[:, c0 * inner * esize:c1 * inner * esize]
        new_shape = [r1 - r0] + ([] if len(shape) < 2 else [width // (row_elems // shape[1])] + shape[2:])
        return out.view(dtype).view(new_shape) if shape else out.view(dtype).reshape(())


def _pread_into(fd: int, buf: torch.Tensor, offset: int) -> None:
    view = memoryview(buf.numpy()).cast("B")
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            raise fail("load_pretrained", offset, "the safetensors file is truncated; re-save it")
        got += n


def _reader_for(files: SafetensorsSlices, key: str, spec: ParamSpec) -> Callable:
    if spec.transposed:  # Conv1D stored [in, out]: our rows are its columns
        return lambda r0, r1, c0, c1: files.read(key, c0, c1, r0, r1).t()
    if spec.cols is None:
        return lambda r0, r1, c0, c1: files.read(key, r0, r1)
    return lambda r0, r1, c0, c1: files.read(key, r0, r1, c0, c1)


def _stored(model: nn.Module, files: SafetensorsSlices, field: str) -> Iterable[tuple[str, torch.Tensor,
                                                                                   ParamSpec | None]]:
    """(stored key, tensor, spec) for each distinct tensor of `model` (tied ones once); a tensor the
    folder lacks is refused in one line naming `field`."""
    layouts = layouts_of(model)
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for key, t in model.state_dict(keep_vars=True).items():
        names.setdefault(id(t), []).append(key)
        tensors[id(t)] = t
    for tid, keys in names.items():
        key = next((k for k in keys if k in files.entries), None)
        if key is None:
            raise fail(field, str(files.folder), f"{keys[0]} is not in its safetensors files; the weights "
                       "do not match this model's architecture (config.json)")
        yield key, tensors[tid], layouts.get(keys[0])


def check_pretrained(model: nn.Module, hf_dir: str | os.PathLike, *, field: str = "model.name"
                     ) -> dict[str, object]:
    """Without reading a tensor: every tensor `model` (a sharded or meta model) will load is in the
    folder's safetensors with its serial shape; returns what the folder holds."""
    files = SafetensorsSlices(hf_dir)
    checked = 0
    for key, t, spec in _stored(model, files, field):
        want = list(t.shape) if spec is None else spec.serial_shape
        if list(files.shape(key)) != want:
            raise fail(field, str(hf_dir), f"{key} is stored as {files.shape(key)} but the model "
                       f"expects {want}; was it saved from this config?")
        checked += 1
    dtypes = sorted({d for _, d, _, _ in files.entries.values()})
    return {"folder": str(hf_dir), "tensors": len(files.entries), "files": len({f for f, *_ in
            files.entries.values()}), "dtypes": dtypes, "checked": checked}


@torch.no_grad()
def load_pretrained(model: nn.Module, hf_dir: str | os.PathLike) -> nn.Module:
    """Fill a parallelized model (e.g. built on the meta device) with its shards from HF safetensors."""
    files = SafetensorsSlices(hf_dir)
    for key, t, spec in _stored(model, files, "load_pretrained"):
        if spec is None:
            stored = files.shape(key)
            piece = files.read(key, 0, stored[0]) if stored else files.read(key, 0, 1)
        else:
            piece = spec.local_from(_reader_for(files, key, spec))
        if tuple(piece.shape) != tuple(t.shape):
            raise fail("load_pretrained", key, f"stored piece {tuple(piece.shape)} does not match the "
                       f"model's {tuple(t.shape)}; was the checkpoint saved from this config?")
        t.copy_(piece.to(dtype=t.dtype))
    return model


def save_pretrained(model: nn.Module, out_dir: str | os.PathLike, *,
                    max_shard_bytes: int = 2 * 2**30,
                    tensors: Iterable[tuple[str, torch.Tensor, ParamSpec | None]] | None = None) -> None:
    """Write a parallelized HF model as a serial safetensors checkpoint (rank 0 writes; a collective).

    Streams: parameters are gathered one at a time and written in shards of at most
    `max_shard_bytes`, so rank 0 never holds more than one shard.  Tied duplicates are written once.
    `tensors` replaces the model's own (name, local piece, layout) stream, e.g. adapters merged
    (axonn.lora.merged_layouts); the config is still the model's."""
    writer = model_grid(model).rank == 0
    out = Path(out_dir)
    shard: dict[str, torch.Tensor] = {}
    size, total, files = 0, 0, []

    def flush() -> None:
        nonlocal shard, size
        if writer and shard:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            files.append((name, list(shard)))
        shard, size = {}, 0

    if writer:
        out.mkdir(parents=True, exist_ok=True)
    for key, t, spec in named_layouts(model) if tensors is None else tensors:  # tied duplicates once
        full = spec.full_from_local(t.detach()) if spec is not None else t.detach()
        if writer:
            shard[key] = full.cpu().contiguous()
            size += full.numel() * full.element_size()
            total += full.numel() * full.element_size()
            if size >= max_shard_bytes:
                flush()
    flush()
    if not writer:
        return
    if len(files) == 1:
        (out / files[0][0]).rename(out / "model.safetensors")
    else:
        weight_map = {k: name for name, keys in files for k in keys}
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    if getattr(model, "config", None) is not None:
        model.config.save_pretrained(out)
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(out)
