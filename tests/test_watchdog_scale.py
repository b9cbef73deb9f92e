"""The watchdog past WATCH_ALL_UP_TO ranks: each rank watches its two ring neighbours, store traffic
grows with the world (not its square), and every rank still ends naming the lost one.

64 watchdogs run as threads of this process over one in-memory store standing in for the
rendezvous TCPStore (a TCPStore server and dozens of its clients in one process do not connect
reliably; across processes they do, as tests/test_slurm.py and tests/test_faults.py show). One
goes silent without saying goodbye, as a hung task does.
"""
from __future__ import annotations

import threading
import time

WORLD, TIMEOUT = 64, 3.0


class MemoryStore:
    """The TCPStore calls the watchdog makes (add, check, get, set), counted."""

    def __init__(self, *args, **kwargs) -> None:
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.ops = 0

    def add(self, key: str, n: int) -> int:
        with self.lock:
            self.ops += 1
            value = int(self.data.get(key, b"0")) + n
            self.data[key] = str(value).encode()
            return value

    def check(self, keys: list[str]) -> bool:
        with self.lock:
            self.ops += 1
            return all(k in self.data for k in keys)

    def get(self, key: str) -> bytes:
        with self.lock:
            self.ops += 1
            return self.data[key]

    def set(self, key: str, value: str) -> None:
        with self.lock:
            self.ops += 1
            self.data[key] = value.encode() if isinstance(value, str) else value


def test_ring_watchers_post_the_verdict_for_everyone(monkeypatch):
    import torch.distributed as dist

    from axonn import watchdog

    assert WORLD > watchdog.WATCH_ALL_UP_TO
    store = MemoryStore()
    monkeypatch.setattr(dist, "TCPStore", lambda *a, **k: store)
    messages: dict[int, str] = {}

    def on_lost(rank):
        return lambda message: messages.setdefault(rank, message)

    dogs = [watchdog.Watchdog(r, WORLD, TIMEOUT, host="h", port=1, on_lost=on_lost(r)) for r in range(WORLD)]
    assert sorted(dogs[0]._seen) == [1, WORLD - 1] and sorted(dogs[17]._seen) == [16, 18]
    for d in dogs:
        d.start()
    try:
        time.sleep(1.0)
        ops0, t_ops = store.ops, time.monotonic()
        time.sleep(1.0)
        per_interval = (store.ops - ops0) / ((time.monotonic() - t_ops) / dogs[0].interval)
        victim = 17
        dogs[victim]._stop.set()  # silent, no goodbye: a hung rank
        t0 = time.monotonic()
        while len(messages) < WORLD - 1 and time.monotonic() - t0 < TIMEOUT + 5:
            time.sleep(0.05)
        took = time.monotonic() - t0
    finally:
        for d in dogs:
            d._stop.set()
    survivors = {r: m for r, m in messages.items() if r != victim}
    assert len(survivors) == WORLD - 1, sorted(messages)
    assert all(m.startswith(f"rank {victim} is lost") for m in survivors.values()), survivors
    assert took <= TIMEOUT + 2 * dogs[0].interval + 1.0, took
    # each rank: its beat, the verdict, and two neighbours (bye + beat): ~6 requests per interval
    assert per_interval <= 8 * WORLD, per_interval
