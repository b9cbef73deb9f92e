"""The `local` hardware profile (a few seconds of measurement on this machine, cached as JSON), and
`get_hardware`, which resolves any `--hardware` name: a preset from hardware.py or `local`.

One "GPU" is one single-threaded CPU process (how the gloo tests run): we time fp32 matmuls of a
large and a thin shape on one thread (their ratio fits the GEMM shape curve's half dimension,
which on a CPU is far smaller than on tensor cores), a tensor copy, and a 2-rank gloo
all-reduce. The cache lives in $MEMORIZE_CACHE/plan/local.json (default
~/.cache/memorize/plan/local.json).
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from axonn.plan.compute import shape_factor
from axonn.plan.hardware import PRESETS, Hardware, hardware_choices
from memorize_core import ConfigError

CACHE_VERSION = 2


def cache_path() -> Path:
    """Where the local calibration is stored."""
    root = os.environ.get("MEMORIZE_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "memorize"
    return base / "plan" / "local.json"


def _timed(fn, min_s: float) -> float:
    """Seconds per call of fn, repeated for at least min_s after one warm-up call."""
    fn()
    n, start = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_s:
            return elapsed / n


def _allreduce_worker(rank: int, init_file: str) -> dict:
    """One rank of the 2-rank gloo measurement: seconds per all-reduce by element count."""
    import torch  # deferred: torch +1.45 s; axonn.plan imports torch-free in 0.05 s (axonn-plan, dry runs)
    import torch.distributed as dist  # deferred: with torch above

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        out = {}
        # fixed call counts: a time-based loop would let the ranks disagree on how many to run
        for n, calls in ((SMALL, 50), (LARGE, 8)):
            t = torch.ones(n)
            dist.all_reduce(t)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                dist.all_reduce(t)
            out[str(n)] = (time.perf_counter() - start) / calls
        return out
    finally:
        dist.destroy_process_group()


SMALL, LARGE = 256, 4 * 2**20  # fp32 elements
GEMM_N, GEMM_THIN = 256, 16  # [n, n] x [n, n] and [thin, n] x [n, n]


def fit_half_dim(ratio: float, n: int, thin: int) -> float:
    """The half dimension h for which shape_factor(thin, n, n) / shape_factor(n, n, n) = ratio.

    The ratio falls monotonically as h grows, so bisection finds it; a thin GEMM as fast as the
    large one (ratio >= 1: no measurable shape penalty) gives the smallest h tried.
    """
    def model(h: float) -> float:
        return shape_factor(thin, n, n, h) / shape_factor(n, n, n, h)

    lo, hi = 1e-3, 4096.0
    if ratio >= model(lo):
        return lo
    if ratio <= model(hi):
        return hi
    for _ in range(100):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if model(mid) > ratio else (lo, mid)
    return (lo * hi) ** 0.5


def _measure_allreduce() -> dict:
    """Run two worker processes (`python -m axonn.plan.calibrate RANK FILE`); rank 0's timings.

    Plain subprocesses rather than multiprocessing, so the caller's __main__ is never re-imported.
    """
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory() as d:
        init = os.path.join(d, "store")
        procs = [subprocess.Popen([sys.executable, "-m", "axonn.plan.calibrate", str(r), init],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                 for r in range(2)]
        outs = [p.communicate(timeout=300) for p in procs]
    if any(p.returncode for p in procs):
        err = next(e for (_, e), p in zip(outs, procs) if p.returncode)
        raise RuntimeError(f"local calibration worker failed: {err.strip().splitlines()[-1:]}")
    return json.loads(outs[0][0].strip().splitlines()[-1])


def measure() -> dict:
    """Measure matmul flop/s, copy bandwidth and 2-rank gloo all-reduce cost (a few seconds)."""
    import torch  # deferred: torch +1.45 s; axonn.plan imports torch-free in 0.05 s (axonn-plan, dry runs)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n, thin = GEMM_N, GEMM_THIN
        a, b, c = torch.randn(n, n), torch.randn(n, n), torch.randn(thin, n)
        big_flops = 2.0 * n**3 / _timed(lambda: a @ b, 0.5)
        thin_flops = 2.0 * thin * n * n / _timed(lambda: c @ b, 0.5)
        half = fit_half_dim(thin_flops / big_flops, n, thin)
        flops = big_flops / shape_factor(n, n, n, half)  # the curve's ceiling
        big = torch.empty(8 * 2**20)
        copy_bw = 2.0 * big.numel() * 4 / _timed(lambda: big.clone(), 0.3)
    finally:
        torch.set_num_threads(threads)
    times = _measure_allreduce()
    # ring on p = 2: t = 2*(1/2)*n/bw + 2*lat
    lat = max(times[str(SMALL)] / 2, 1e-7)
    bw = (4.0 * LARGE) / max(times[str(LARGE)] - 2 * lat, 1e-9)
    return {"version": CACHE_VERSION, "host": platform.node(), "cpus": os.cpu_count() or 1,
            "matmul_flops": flops, "gemm_half_dim": half, "copy_bw": copy_bw, "allreduce_bw": bw,
            "allreduce_lat": lat, "memory_bytes": _total_memory(),
            "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}


def _total_memory() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8.0 * 2**30


def hardware_from_calibration(cal: dict) -> Hardware:
    """Turn a calibration record into a Hardware profile (one node; one rank per CPU core)."""
    cpus = max(1, int(cal["cpus"]))
    return Hardware(
        name="local", peak_flops=cal["matmul_flops"], gemm_eff=1.0, attn_eff=0.5,
        gemm_half_dim=cal["gemm_half_dim"], hides_comm=False,
        hbm_bw=cal["copy_bw"], memory_bytes=cal["memory_bytes"] / cpus, gpus_per_node=cpus,
        intra_bw=cal["allreduce_bw"], node_bw=cal["allreduce_bw"],
        intra_lat=cal["allreduce_lat"], inter_lat=cal["allreduce_lat"],
        note=f"measured on {cal.get('host', '?')} at {cal.get('measured_at', '?')}")


def local_hardware(recalibrate: bool = False) -> Hardware:
    """The cached calibration of this machine, measuring it first if missing or stale."""
    path = cache_path()
    cal = None
    if path.is_file() and not recalibrate:
        try:
            cal = json.loads(path.read_text())
            if cal.get("version") != CACHE_VERSION:
                cal = None
        except (OSError, json.JSONDecodeError):
            cal = None
    if cal is None:
        cal = measure()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cal, indent=2))
        os.replace(tmp, path)  # atomic: ranks calibrating at once never see half a file
    return hardware_from_calibration(cal)


def get_hardware(hw: Any, *, recalibrate: bool = False) -> Hardware:
    """A preset by name, `local` (measured on this machine, cached), or a Hardware as is."""
    if isinstance(hw, Hardware):
        return hw
    if hw == "local":
        return local_hardware(recalibrate=recalibrate)
    if isinstance(hw, str) and hw in PRESETS:
        return PRESETS[hw]
    raise ConfigError(f"hardware={hw!r}: unknown hardware; choose one of "
                      f"{', '.join(hardware_choices())}")


if __name__ == "__main__":  # a calibration worker: python -m axonn.plan.calibrate RANK INIT_FILE
    print(json.dumps(_allreduce_worker(int(sys.argv[1]), sys.argv[2])))
