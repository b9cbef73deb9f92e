"""GEMM layout tuning: time the NN / NT / TN formulations of a matmul once per shape, keep the winner.

`C[m, n] = A[m, k] @ B[k, n]` can be handed to the BLAS with each operand row-major ("N") or as a
transposed view of a row-major buffer ("T").  The layers' operands arrive in one layout (the forward
weight is a transposed view, the dW GEMM reads dy transposed); a formulation that needs the other
layout pays a copy, which is part of what is timed.  The paper found that on some GPUs the library's
choice for a given shape is far from the best; on a CPU the differences are usually small.

Winners are cached in memory and on disk per device (`$MEMORIZE_CACHE/gemm/<device>.json`, default
`~/.cache/memorize`), keyed by shape, dtype, input layouts and the torch version.  Every formulation
computes the same product; the bits may differ (another BLAS blocking), never the math.  Each rank
decides alone: every engine GEMM's output is either this rank's own shard or goes through a
collective before it is shared, so replicas stay identical whatever each picked.
"""
from __future__ import annotations

import json
import os
import platform
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

VARIANTS = ("NN", "NT", "TN")


def cache_root() -> Path:
    """Root of the project's caches ($MEMORIZE_CACHE, default ~/.cache/memorize)."""
    return Path(os.environ.get("MEMORIZE_CACHE") or Path.home() / ".cache" / "memorize")


def device_name(device: torch.device) -> str:
    """A file-name-safe name of the device (GPU model, or the CPU's architecture and core count)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"cpu-{platform.machine()}-{os.cpu_count()}c"
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def _layout(t: torch.Tensor) -> str:
    if t.is_contiguous():
        return "N"
    if t.t().is_contiguous():
        return "T"
    return "X"


def _run(variant: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # Materialise each operand in the layout the variant names (free when it already is).
    if variant[0] == "N":
        a = a.contiguous()
    else:
        a = a.t().contiguous().t()
    if variant[1] == "N":
        b = b.contiguous()
    else:
        b = b.t().contiguous().t()
    return a.matmul(b)


class GemmTuner:
    """Picks and remembers the fastest formulation per GEMM shape; `enabled=False` is the plain path."""

    def __init__(self, enabled: bool = True, reps: int = 3, persist: bool = True) -> None:
        self.enabled, self.reps, self.persist = enabled, reps, persist
        self._memory: dict[str, str] = {}
        self._loaded: set[str] = set()
        self.timings: dict[str, dict[str, float]] = {}  # what this process measured (seconds)

    def mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a @ b for 2-D operands, with the cached fastest formulation when tuning is on."""
        if not self.enabled or a.dim() != 2 or b.dim() != 2 or a.device.type == "meta":
            return a.matmul(b)
        key = self.key(a, b)
        winner = self._memory.get(key)
        if winner is None:
            winner = self._lookup_disk(a.device, key) or self._tune(key, a, b)
        return _run(winner, a, b)

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x @ w.T over the last dim of x (any leading dims), as nn.functional.linear without bias."""
        y = self.mm(x.reshape(-1, x.shape[-1]), w.t())
        return y.reshape(tuple(x.shape[:-1]) + (w.shape[0],))

    def matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x @ w over the last dim of x (any leading dims)."""
        y = self.mm(x.reshape(-1, x.shape[-1]), w)
        return y.reshape(tuple(x.shape[:-1]) + (w.shape[1],))

    @staticmethod
    def key(a: torch.Tensor, b: torch.Tensor) -> str:
        """Cache key: shape, dtype, input layouts, torch version (the device picks the file)."""
        m, k = a.shape
        n = b.shape[1]
        return (f"{m}x{n}x{k}:{str(a.dtype).replace('torch.', '')}:"
                f"{_layout(a)}{_layout(b)}:{torch.__version__}")

    def path(self, device: torch.device) -> Path:
        """The on-disk cache file of one device."""
        return cache_root() / "gemm" / f"{device_name(device)}.json"

    def _lookup_disk(self, device: torch.device, key: str) -> str | None:
        name = device_name(device)
        if self.persist and name not in self._loaded:
            self._loaded.add(name)
            for k, v in self._read(self.path(device)).items():
                self._memory.setdefault(k, v)
        return self._memory.get(key)

    @staticmethod
    def _read(path: Path) -> dict[str, str]:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        return {k: v for k, v in data.items() if v in VARIANTS} if isinstance(data, dict) else {}

    def _tune(self, key: str, a: torch.Tensor, b: torch.Tensor) -> str:
        sync: Callable[[], None] = torch.cuda.synchronize if a.device.type == "cuda" else (lambda: None)
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        with torch.no_grad():
            for v in VARIANTS:  # warm-up: first calls pay allocation and library set-up
                _run(v, a, b)
            for _ in range(self.reps):  # alternate variants so load changes hit all alike
                for v in VARIANTS:
                    sync()
                    t0 = time.perf_counter()
                    _run(v, a, b)
                    sync()
                    times[v].append(time.perf_counter() - t0)
        med = {v: statistics.median(ts) for v, ts in times.items()}
        winner = min(VARIANTS, key=lambda v: med[v])
        self.timings[key] = med
        self._memory[key] = winner
        if self.persist:
            self._write(a.device, key, winner)
        return winner

    def _write(self, device: torch.device, key: str, winner: str) -> None:
        path = self.path(device)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            data = self._read(path)
            data[key] = winner
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data, indent=0, sort_keys=True))
            os.replace(tmp, path)  # atomic: ranks sharing a disk never see a half-written file
        except OSError:
            pass  # a read-only cache only costs re-tuning in the next process


def default_enabled(device: torch.device, setting: bool | str) -> bool:
    """Resolve EngineOptions.gemm_tuning: "auto" tunes on CUDA only (CPU BLAS gains little)."""
    if setting == "auto":
        return device.type == "cuda"
    return bool(setting)
