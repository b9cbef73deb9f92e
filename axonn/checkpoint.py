"""Atomic, checksummed, grid-independent training checkpoints (safetensors + JSON, never pickle).

Layout of one checkpoint, `ROOT/step-00000120/`:
    rank-00000.safetensors ...  each rank's pieces: every parameter piece this rank counts (one copy
                                of each replica set), its AdamW exp_avg/exp_avg_sq, its RNG state
    meta.json                   step, grid, model config, trainer state, the piece index
                                (key -> file, serial-layout slice) and a sha256 per file
    COMPLETE                    written last
Pieces are stored in the *serial* layout (GPT-2 Conv1D pieces transposed back) with the slice of the
full tensor they cover, so a checkpoint written at one grid loads at any other: the loader rebuilds
each full tensor from its pieces (one tensor at a time) and cuts this rank's piece with its ParamSpec.

Atomicity: ranks write into `ROOT/.tmp-step-00000120/` (each file written as *.part, fsynced, renamed),
meet at a barrier, then rank 0 writes meta.json and COMPLETE, fsyncs, and renames the folder to its
final name. A crash at any point leaves either no step folder or a complete one; `latest_complete`
only ever returns folders holding COMPLETE whose meta.json parses.

A caller's own state rides along: `meta` (JSON, rank 0's) and `rank_tensors` (each rank's, e.g. RNG
states). The Trainer passes its loop position, schedule and label-transform state there
(axonn/loop_state.py); this module never learns what a trainer is.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from axonn.engine import named_layouts
from axonn.grid import ProcessGrid
from axonn.layers.layout import ParamSpec
from memorize_core import fail

FORMAT = "axonn-checkpoint-v1"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


class NonFiniteCheckpointError(RuntimeError):
    """The model or optimizer holds NaN/Inf: such a checkpoint is never written."""


def step_dir_name(step: int) -> str:
    """Folder name of the checkpoint taken after `step` optimizer steps."""
    return f"step-{step:08d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """Write via `path.part`, fsync, rename: readers never see a half-written file."""
    part = path.with_name(path.name + ".part")
    write(part)
    with open(part, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(part, path)


def sha256(path: Path) -> str:
    """Hex sha256 of a file (streamed)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _all_ok(ok: bool, grid: ProcessGrid) -> bool:
    """True when `ok` holds on every rank (a barrier that also carries a verdict)."""
    if grid.world_size == 1:
        return ok

    flag = torch.tensor([0.0 if ok else 1.0], device=grid.device)
    dist.all_reduce(flag)
    return float(flag) == 0.0


def _serial_piece(t: torch.Tensor, grid: ProcessGrid, spec: ParamSpec | None = None
                  ) -> tuple[torch.Tensor, list[list[int]], list[int]] | None:
    """This rank's piece in serial layout, its slice of the full tensor, and the full shape.

    `spec` is the owning parameter's (optimizer state has the layout of its parameter). None when
    another rank holds the counted copy of the same values."""
    t = t.detach()
    if spec is None:
        if grid.rank != 0:
            return None
        return t.cpu().contiguous(), [[0, s] for s in t.shape], list(t.shape)
    if not spec.counted_here():
        return None
    (r0, r1), (c0, c1) = spec.row_range(), spec.col_range()
    piece = t[: r1 - r0]
    if spec.cols is None:
        return piece.cpu().contiguous(), [[r0, r1]], [spec.rows]
    if spec.transposed:
        return piece.t().cpu().contiguous(), [[c0, c1], [r0, r1]], [spec.cols, spec.rows]
    return piece.cpu().contiguous(), [[r0, r1], [c0, c1]], [spec.rows, spec.cols]


def _local_from_full(spec: ParamSpec | None, full: torch.Tensor) -> torch.Tensor:
    """This rank's piece of the full serial tensor, cut with the parameter's spec."""
    return full if spec is None else spec.local_from_full(full)


def save(root: str | os.PathLike, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None,
         *, grid: ProcessGrid | None = None, meta: dict | None = None,
         rank_tensors: dict[str, torch.Tensor] | None = None,
         main_files: Callable[[Path], None] | None = None, keep_last: int = 0) -> Path:
    """Write checkpoint `root/step-NNNNNNNN` atomically (a collective: call on every rank).

    `meta` (JSON-able, taken from rank 0) and `rank_tensors` (per rank, e.g. RNG states) ride along;
    `main_files(dir)` lets rank 0 add files (a tokenizer) before the folder is sealed; no `grid`:
    a serial model."""
    grid = grid or ProcessGrid.serial()
    rank, world = grid.rank, grid.world_size
    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{step_dir_name(step)}"
    unique = list(named_layouts(model))
    names = {id(t): n for n, t, _ in unique}
    tensors: dict[str, torch.Tensor] = {}
    index: dict[str, dict] = {}
    finite = True
    for name, t, spec in unique:
        got = _serial_piece(t, grid, spec)
        states = optimizer.state.get(t, {}) if optimizer is not None and isinstance(t, nn.Parameter) else {}
        for kind in ("param", "exp_avg", "exp_avg_sq"):
            src = t if kind == "param" else states.get(kind)
            if src is None:
                continue
            finite = finite and bool(torch.isfinite(src).all())
            if got is None:
                continue
            piece, sl, shape = _serial_piece(src, grid, spec) if kind != "param" else got
            key = f"{kind}/{name}"
            tensors[key] = piece
            index[key] = {"shape": shape, "slice": sl}
    steps = {names[id(p)]: float(s["step"]) for p, s in (optimizer.state.items() if optimizer else [])
             if "step" in s and id(p) in names}
    if not _all_ok(finite, grid):
        raise NonFiniteCheckpointError(f"checkpoint at step {step} not written: the model or optimizer "
                                       "state holds NaN/Inf; the previous checkpoint stays the latest")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a stale attempt from a killed run
        tmp.mkdir(parents=True)
    _all_ok(True, grid)  # the folder exists before anyone writes into it
    for k, v in (rank_tensors or {}).items():
        tensors[f"rank/{k}"] = v.detach().cpu().contiguous()
    fname = f"rank-{rank:05d}.safetensors"
    ok = True
    try:
        _write_atomic(tmp / fname, lambda p: save_file(tensors, str(p), metadata={"format": FORMAT}))
        digest = {"file": fname, "sha256": sha256(tmp / fname), "index": index}
        _write_atomic(tmp / f"rank-{rank:05d}.json",
                      lambda p: p.write_text(json.dumps(digest), encoding="utf-8"))
    except OSError as e:
        ok = False
        err = e
    if not _all_ok(ok, grid):
        raise OSError(f"checkpoint at step {step} not written: "
                      f"{err if not ok else 'another rank failed to write its shard'}")
    if rank == 0:
        _seal(tmp, final, step, world, grid, meta or {}, steps, main_files)
        if keep_last > 0:
            rotate(root, keep_last)
    _all_ok(True, grid)
    return final


def _seal(tmp: Path, final: Path, step: int, world: int, grid: ProcessGrid, meta: dict,
          steps: dict[str, float], main_files: Callable[[Path], None] | None) -> None:
    """Rank 0: merge the rank digests into meta.json, write COMPLETE, rename into place."""
    files, index = {}, {}
    for r in range(world):
        d = json.loads((tmp / f"rank-{r:05d}.json").read_text(encoding="utf-8"))
        files[d["file"]] = d["sha256"]
        for key, info in d["index"].items():
            entry = index.setdefault(key, {"shape": info["shape"], "pieces": []})
            entry["pieces"].append({"file": d["file"], "slice": info["slice"]})
        (tmp / f"rank-{r:05d}.json").unlink()
    if main_files is not None:
        main_files(tmp)
    body = {"format": FORMAT, "step": step, "world_size": world,
            "grid": list(grid.dims),
            "files": files, "tensors": index, "optimizer_steps": steps, **meta}
    _write_atomic(tmp / "meta.json", lambda p: p.write_text(json.dumps(body, indent=1), encoding="utf-8"))
    _write_atomic(tmp / "COMPLETE", lambda p: p.write_text(f"{step}\n", encoding="utf-8"))
    _fsync_dir(tmp)
    if final.exists():  # re-saving the same step (a resumed run): replace it whole
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(final.parent)


def is_complete(path: Path) -> bool:
    """True for a sealed checkpoint folder (COMPLETE present and meta.json parses)."""
    try:
        return ((path / "COMPLETE").is_file()
                and json.loads((path / "meta.json").read_text())["format"] == FORMAT)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def complete_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Sealed checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and p.is_dir() and is_complete(p)]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def latest_complete(root: str | os.PathLike) -> Path | None:
    """The newest sealed checkpoint under `root` (None when there is none)."""
    found = complete_checkpoints(root)
    return found[-1] if found else None


def rotate(root: str | os.PathLike, keep_last: int) -> None:
    """Delete all but the newest `keep_last` sealed checkpoints (and stale temporary folders)."""
    found = complete_checkpoints(root)
    for old in found[: max(0, len(found) - keep_last)]:
        shutil.rmtree(old, ignore_errors=True)


def read_meta(path: str | os.PathLike, *, verify: bool = True) -> dict:
    """meta.json of a sealed checkpoint; ConfigError for a missing, unsealed or corrupt one."""
    p = Path(path)
    if not p.is_dir():
        raise fail("checkpoint", str(path), "no such checkpoint folder; pass OUT/checkpoints/step-NNNNNNNN "
                   "or --resume auto")
    if not (p / "COMPLETE").is_file() and (p / "config.json").is_file() and not (p / "meta.json").exists():
        raise fail("checkpoint", str(path), "is a Hugging Face model folder (config.json, no meta.json), not "
                   "a training checkpoint; use it as it is (e.g. model.name or memorize eval --model), or "
                   "pass OUT/checkpoints/step-NNNNNNNN")
    if not (p / "COMPLETE").is_file():
        raise fail("checkpoint", str(path), "incomplete checkpoint (no COMPLETE marker: the save was "
                   "interrupted); use an earlier one or --resume auto")
    try:
        meta = json.loads((p / "meta.json").read_text(encoding="utf-8"))
        if meta.get("format") != FORMAT:
            raise ValueError("format")
        meta["files"], meta["tensors"], meta["step"]  # noqa: B018 - presence check
    except (OSError, ValueError, KeyError, TypeError):
        raise fail("checkpoint", str(path), "meta.json is missing or corrupt; use an earlier "
                   "checkpoint") from None
    if verify:
        for fname, digest in meta["files"].items():
            f = p / fname
            if not f.is_file():
                raise fail("checkpoint", str(path), f"shard {fname} is missing; use an earlier checkpoint")
            if sha256(f) != digest:
                raise fail("checkpoint", str(path), f"shard {fname} fails its sha256 check (corrupt or "
                           "truncated); use an earlier checkpoint")
    return meta


class _Pieces:
    """Rebuilds full serial tensors from the pieces of a checkpoint (safetensors, one tensor at a time)."""

    def __init__(self, path: Path, meta: dict) -> None:
        self.meta = meta
        self.handles = {f: safe_open(str(path / f), framework="pt") for f in meta["files"]}

    def has(self, key: str) -> bool:
        """True when the checkpoint stored `key`."""
        return key in self.meta["tensors"]

    def full(self, key: str) -> torch.Tensor:
        """The full serial tensor `key` assembled from its pieces (coverage checked)."""
        info = self.meta["tensors"][key]
        out, covered = None, 0
        for piece in info["pieces"]:
            t = self.handles[piece["file"]].get_tensor(key)
            if out is None:
                out = torch.empty(info["shape"], dtype=t.dtype)
            out[tuple(slice(a, b) for a, b in piece["slice"])] = t
            covered += t.numel()
        if out is None or covered != out.numel():
            raise fail("checkpoint", key, "its pieces do not cover the tensor; the checkpoint is damaged")
        return out

    def rank_tensor(self, rank: int, name: str) -> torch.Tensor | None:
        """A per-rank extra (e.g. an RNG state) from rank `rank`'s file, else rank 0's."""
        for f in (f"rank-{rank:05d}.safetensors", "rank-00000.safetensors"):
            h = self.handles.get(f)
            if h is not None and f"rank/{name}" in h.keys():
                return h.get_tensor(f"rank/{name}")
        return None


def check_fits(path: str | os.PathLike, meta: dict, model: nn.Module) -> None:
    """The refusals `load` would make, from meta.json alone (no tensor read): every tensor of `model`
    (a serial or meta model, or a sharded one) is in the checkpoint with its serial shape."""
    for name, t, spec in named_layouts(model):
        info = meta["tensors"].get(f"param/{name}")
        if info is None:
            raise fail("checkpoint", str(path), f"has no tensor {name}; it was saved from another model")
        if list(info["shape"]) != (list(t.shape) if spec is None else spec.serial_shape):
            raise fail("checkpoint", str(path), f"tensor {name} has shape {tuple(info['shape'])}, which does "
                       "not fit this model; resume with the same model config")


@torch.no_grad()
def load(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
         *, grid: ProcessGrid | None = None) -> tuple[dict, Callable[[str], torch.Tensor | None]]:
    """Fill `model` (and the optimizer's AdamW state) from a checkpoint saved at any grid.

    Returns (meta, rank_tensor): rank_tensor(name) gives this rank's saved extra (or rank 0's)."""
    path = Path(path)
    meta = read_meta(path)
    pieces = _Pieces(path, meta)
    rank = (grid or ProcessGrid.serial()).rank  # no grid: a serial model
    for name, t, spec in named_layouts(model):
        key = f"param/{name}"
        if not pieces.has(key):
            raise fail("checkpoint", str(path), f"has no tensor {name}; it was saved from another model")
        full = pieces.full(key)
        if list(full.shape) != (list(t.shape) if spec is None else spec.serial_shape):
            raise fail("checkpoint", str(path), f"tensor {name} has shape {tuple(full.shape)}, which does "
                       "not fit this model; resume with the same model config")
        t.copy_(_local_from_full(spec, full).to(t.dtype))
        if optimizer is None or not isinstance(t, nn.Parameter):
            continue
        state = {}
        for kind in ("exp_avg", "exp_avg_sq"):
            if pieces.has(f"{kind}/{name}"):
                state[kind] = _local_from_full(spec, pieces.full(f"{kind}/{name}")).to(t.device, t.dtype)
        if state:
            state["step"] = torch.tensor(float(meta["optimizer_steps"].get(name, 0.0)))
            optimizer.state[t] = state
        else:
            optimizer.state.pop(t, None)
    return meta, lambda name: pieces.rank_tensor(rank, name)


def consolidate(path: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """(meta, full serial state dict of the model) from a checkpoint: what `export` writes."""
    path = Path(path)
    meta = read_meta(path)
    pieces = _Pieces(path, meta)
    state = {k[len("param/"):]: pieces.full(k) for k in meta["tensors"] if k.startswith("param/")}
    return meta, state
