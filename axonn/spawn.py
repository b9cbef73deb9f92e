"""Run a function on N spawned local gloo ranks on CPU (1 thread each) and never hang:
tests, benchmarks, notebooks.

    results = run_ranks(fn, world_size, *args)           # one RankResult per rank, errors captured
    values = run_distributed(fn, world_size, *args)      # per-rank return values; raises on any error

`fn(rank, world_size, *args)` must be a module-level function (it is pickled into the children).
With `init=True` (default) the helper initialises a gloo process group first; with `init=False`
the child only gets the torchrun-style environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT, LOCAL_RANK),
so `axonn.init()` can be exercised.  Every run has a deadline: on expiry all ranks are killed and
the test fails with the ranks that did not report.

Start-up: ranks are forked from a forkserver that has imported torch, transformers and axonn once per
pytest session (importing them takes seconds per process on a small machine); the forkserver never
runs torch work itself, so forking it is safe.  Each child sets its own environment and threads.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class RankResult:
    """What one rank reported: its return value, or the exception it raised."""

    rank: int
    ok: bool
    value: Any = None
    error_type: str | None = None
    error: str | None = None
    traceback: str | None = None


def free_port() -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PRELOAD = ["torch", "torch.distributed", "transformers", "axonn",
           "transformers.models.llama.modeling_llama"]


def _context() -> Any:
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # only takes effect before the server first starts
        return ctx
    return mp.get_context("spawn")


def _child(fn: Callable, rank: int, world: int, port: int, init: bool, timeout: float,
           env: dict, args: tuple, out: Any) -> None:
    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # already fixed in this process
    try:
        if init:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=world, timeout=datetime.timedelta(seconds=timeout))
        value = fn(rank, world, *args)
        out.put(RankResult(rank, True, value))
    except BaseException as e:  # report everything, including assertion failures
        out.put(RankResult(rank, False, None, type(e).__name__, str(e), traceback.format_exc()))
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 240.0,
              init: bool = True) -> list[RankResult]:
    """Run `fn` on `world_size` spawned gloo ranks; one RankResult per rank (errors included)."""
    ctx = _context()
    port = free_port()
    results: Any = ctx.Queue()
    threads = dict(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    saved = {k: os.environ.get(k) for k in threads}
    os.environ.update(threads)  # inherited by the forkserver if this call starts it
    procs = []
    try:
        for rank in range(world_size):
            env = dict(threads, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            p = ctx.Process(target=_child, daemon=True,
                            args=(fn, rank, world_size, port, init, timeout, env, args, results))
            p.start()
            procs.append(p)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    got: dict[int, RankResult] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                r = results.get(timeout=min(left, 1.0))
                got[r.rank] = r
            except queue.Empty:
                dead = [p for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
                if dead and all(not p.is_alive() for p in procs):
                    break  # everyone exited; no more results can come
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    for rank in range(world_size):
        if rank not in got:
            code = procs[rank].exitcode
            got[rank] = RankResult(rank, False, None, "Timeout",
                                   f"rank {rank} reported nothing within {timeout:.0f}s (exit code {code})")
    return [got[r] for r in range(world_size)]


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 240.0,
                    init: bool = True) -> list[Any]:
    """Run `fn` on `world_size` gloo ranks and return each rank's value; raise if any rank failed."""
    results = run_ranks(fn, world_size, *args, timeout=timeout, init=init)
    bad = [r for r in results if not r.ok]
    if bad:
        lines = [f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback or ''}" for r in bad]
        raise AssertionError(f"{len(bad)}/{world_size} ranks failed:\n" + "\n".join(lines))
    return [r.value for r in results]
