"""Shared pieces of the benchmarks: the model, alternating A/B timing, machine facts, JSON output."""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without install
import axonn  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"

# FACTS.md's feasibility model: 4 layers, hidden 256, 4 heads, vocab 4096.
SMALL = dict(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
             tie_word_embeddings=True)


def llama(seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A random-init Llama of the SMALL shape (fields overridable)."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**SMALL, **overrides}))


def batch(rows: int, seq: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Random token ids [rows, seq]."""
    return torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(seed))


def alternate(fns: dict[str, Callable[[], Any]], reps: int, warmup: int = 2) -> dict[str, dict]:
    """Time each callable `reps` times, interleaved A, B, B, A, A, B... (load and cache effects hit
    all alike; every other round runs in reverse order); medians."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    wall: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    for rep in range(reps):
        for k, fn in (list(fns.items()) if rep % 2 == 0 else list(fns.items())[::-1]):
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
    return {k: {"median_s": statistics.median(wall[k]), "min_s": min(wall[k]),
                "cpu_median_s": statistics.median(cpu[k]), "wall_s": wall[k], "cpu_s": cpu[k]} for k in fns}


def ratio(res: dict[str, dict], a: str, b: str) -> float:
    """a / b as the median over rounds of the two times taken side by side in that round: slow
    drifts of a shared machine (other tenants, thermal) cancel inside a round, unlike in the ratio
    of the two overall medians, which the JSON keeps too (`res[k]["median_s"]`)."""
    return statistics.median(x / y for x, y in zip(res[a]["wall_s"], res[b]["wall_s"]))


def machine() -> dict[str, Any]:
    """Where and when: host facts, torch version, load average (the machine is shared)."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "loadavg": os.getloadavg(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}


def single_process_grid() -> Any:
    """A one-rank gloo world and its 1,1,1,1 grid (no port needed)."""
    return axonn.init(1, 1, 1, 1)


def report(name: str, value: float) -> None:
    """One `name: value` line."""
    print(f"{name}: {value:.4f}", flush=True)


def write(out: str | None, default: str, payload: dict[str, Any]) -> Path:
    """Write the JSON result (default under benchmarks/results/)."""
    path = Path(out) if out else RESULTS / default
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine(), **payload}
    path.write_text(json.dumps(payload, indent=2, default=str))
    print(f"wrote {path}", flush=True)
    return path


# Runs the command given after it (`-m module` or a script) and, at exit, writes the process's own
# peak resident set (VmHWM, kB) to $BENCH_HWM. wait4's ru_maxrss would not do: Linux carries the
# parent's high-water mark over fork + exec, so every child would report the benchmark's own peak.
_HWM = """import atexit, os, runpy, sys
def _hwm():
    with open('/proc/self/status') as f:
        kb = next(line.split()[1] for line in f if line.startswith('VmHWM:'))
    with open(os.environ['BENCH_HWM'], 'w') as f:
        f.write(kb)
atexit.register(_hwm)
if sys.argv[1] == '-m':
    sys.argv = sys.argv[2:]
    runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)
else:
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(sys.argv[0]))
    runpy.run_path(sys.argv[0], run_name='__main__')
"""


def peak_rss(cmd: list[str], threads: int) -> dict[str, Any]:
    """Run `cmd` (python arguments); its own peak resident set (VmHWM, MiB), exit code, wall time."""
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)  # also for `memorize train`, which has no thread flag
    with tempfile.TemporaryDirectory() as tmp:
        hwm = Path(tmp) / "hwm"
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", _HWM, *cmd], cwd=ROOT, capture_output=True, text=True,
                              check=False, env={**env, "BENCH_HWM": str(hwm)})
        out = {"cmd": "python " + " ".join(cmd), "rc": proc.returncode, "wall_s": time.perf_counter() - t0,
               "peak_rss_mib": int(hwm.read_text()) / 1024 if hwm.is_file() else float("nan")}
    if proc.returncode:
        out["log_tail"] = (proc.stdout + proc.stderr)[-2000:]
        print(f"  FAILED (rc {proc.returncode}): {out['cmd']}\n{out['log_tail']}", file=sys.stderr,
              flush=True)
    return out


class TokenRows:
    """A RowDataset of token rows trained on themselves (labels = input_ids)."""

    def __init__(self, ids: Any) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, idx: Any) -> dict[str, Any]:
        return {"input_ids": self.ids[idx], "labels": self.ids[idx]}
