"""Lost-rank detection on any backend: heartbeats through the rendezvous TCPStore.

Why not rely on the process-group timeout alone: a SIGSTOPped peer keeps its sockets open, so a
gloo collective only fails when its timeout fires, and the error never says *which* rank is gone;
a killed peer makes collectives fail at once, again without naming it. Here every rank bumps its own
counter in the store every `interval` seconds from a daemon thread (through a store client of its
own, so it never contends with the process group) and reads everyone else's (past WATCH_ALL_UP_TO
ranks: its two ring neighbours'). A peer whose counter has not moved for `timeout_s` is declared
lost: the finder posts the verdict in the store for the others, prints one line naming the peer and
exits with EXIT_LOST, never hangs. `guard()` turns a collective that failed at once (a killed peer) into
the same message after a short diagnosis. A rank that finished cleanly says goodbye first.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator

import torch.distributed as dist

from axonn.grid import ProcessGrid
from axonn.launch import launch_env

EXIT_LOST = 3
_PREFIX = "axonn/watchdog"
# Up to this many ranks every rank watches every other one. Past it each rank watches its two ring
# neighbours and the first to find one silent posts the verdict for all: the store then serves
# O(world) requests per interval instead of O(world^2) (6,144 ranks x 6,143 peers would swamp it).
WATCH_ALL_UP_TO = 32


def _short(e: BaseException) -> str:
    """First line of an error without the C++ source location, capped: fits the one-line message."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", (str(e).splitlines() or [""])[0])
    text = text.split(". This is typically")[0]
    return f"{type(e).__name__}: {text[:100]}"


def _default_abort(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    os._exit(EXIT_LOST)  # from any thread, even while the main thread sits in a collective


class Watchdog:
    """Heartbeat thread that exits the process when another rank goes silent."""

    def __init__(self, rank: int, world_size: int, timeout_s: float, *, host: str, port: int,
                 interval_s: float | None = None, on_lost: Callable[[str], None] | None = None) -> None:
        self.rank, self.world, self.timeout_s = rank, world_size, float(timeout_s)
        self.interval = interval_s or max(0.05, min(1.0, self.timeout_s / 10))
        self.where = f"{host}:{port}"
        self.on_lost = on_lost or _default_abort
        # detect within timeout_s: the last beat may be up to one interval old when we look
        self.stale_after = max(self.interval, self.timeout_s - 2 * self.interval)
        self.store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=self.stale_after))
        # a fresh key space per watchdog: a process may train several runs on one process group
        gen = self.store.add(f"{_PREFIX}/generation/{rank}", 1)
        self.keys = f"{_PREFIX}/{gen}"
        self._stop = threading.Event()
        self.watch_all = world_size <= WATCH_ALL_UP_TO
        peers = (range(world_size) if self.watch_all
                 else {(rank - 1) % world_size, (rank + 1) % world_size})
        self._seen = {r: (-1, time.monotonic()) for r in peers if r != rank}
        self._last_ok = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="axonn-watchdog", daemon=True)
        # A stopped store host accepts our bytes and never answers (store timeouts do not cover
        # every op), so a second thread judges how long the poller has been stuck.
        self._judge = threading.Thread(target=self._watch_poller, name="axonn-watchdog-judge", daemon=True)

    def start(self) -> Watchdog:
        """Begin heartbeating and watching."""
        self.store.add(f"{self.keys}/hb/{self.rank}", 1)
        self._thread.start()
        self._judge.start()
        return self

    def stop(self) -> None:
        """Say goodbye (peers stop watching this rank) and end the thread."""
        self._stop.set()
        with contextlib.suppress(Exception):
            self.store.set(f"{self.keys}/bye/{self.rank}", "1")
        for t in (self._thread, self._judge):
            if t.is_alive() and t is not threading.current_thread():
                t.join(timeout=1)

    def _verdict(self) -> list[int]:
        """Ranks a peer has already declared lost (empty: none)."""
        key = f"{self.keys}/lost"
        return [int(r) for r in self.store.get(key).decode().split(",")] if self.store.check([key]) else []

    def _announce(self, ranks: list[int]) -> None:
        """Tell the other ranks who is lost, and give them time to read it before this rank exits.

        Under srun rank 0 hosts the store: if it left at once, the others would lose the store
        before they saw the silent rank and blame rank 0 instead.
        """
        with contextlib.suppress(Exception):
            self.store.set(f"{self.keys}/lost", ",".join(map(str, ranks)))
            time.sleep(2 * self.interval + 0.2)

    def _poll(self) -> list[int]:
        """Beat once, read the peers; return the ranks silent for longer than stale_after."""
        self.store.add(f"{self.keys}/hb/{self.rank}", 1)
        told = self._verdict()
        if told:
            return told
        now, silent = time.monotonic(), []
        for r, (count, since) in list(self._seen.items()):
            if self.store.check([f"{self.keys}/bye/{r}"]):
                del self._seen[r]
                continue
            value = self.store.add(f"{self.keys}/hb/{r}", 0)
            if value != count:
                self._seen[r] = (value, now)
            elif now - since > self.stale_after:
                silent.append(r)
        return silent

    def _store_lost(self, e: Exception) -> str:
        return (f"rank 0 is lost: the rendezvous store at {self.where} (hosted by rank 0 or the launcher) "
                f"stopped answering ({_short(e)}); rank {self.rank} exits. Resume with --resume auto")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                silent = self._poll()
                self._last_ok = time.monotonic()
            except Exception as e:  # noqa: BLE001 - any store failure means its host is gone
                if not self._stop.is_set():
                    self.on_lost(self._store_lost(e))
                return
            if silent and not self._stop.is_set():
                self._announce(silent)
                self.on_lost(self.lost_message(silent, f"no heartbeat for {self.timeout_s:g} s: killed, "
                                               "stopped or hung"))
                return

    def _watch_poller(self) -> None:
        while not self._stop.wait(self.interval):
            stuck = time.monotonic() - self._last_ok
            if stuck > self.stale_after and not self._stop.is_set():
                self.on_lost(self._store_lost(TimeoutError(f"no answer for {stuck:.0f} s")))
                return

    def lost_message(self, ranks: list[int], why: str) -> str:
        """The one line printed when peers are lost."""
        names = ", ".join(map(str, ranks))
        return (f"rank {names} {'is' if len(ranks) == 1 else 'are'} lost ({why}); rank {self.rank} exits "
                f"instead of waiting (trainer.collective_timeout_s={self.timeout_s:g}). "
                "Resume with --resume auto")

    def diagnose(self, window_s: float | None = None) -> list[int] | None:
        """After a failed collective: the peers whose heartbeat does not move (None: store gone)."""
        window = window_s if window_s is not None else min(self.stale_after, 4 * self.interval + 1.0)
        try:
            told = self._verdict()
            if told:
                return told
            start = {r: self.store.add(f"{self.keys}/hb/{r}", 0) for r in self._seen}
            time.sleep(window)
            silent = [r for r in start if r in self._seen and not self.store.check([f"{self.keys}/bye/{r}"])
                      and self.store.add(f"{self.keys}/hb/{r}", 0) == start[r]]
            if silent or self.watch_all:
                return silent
            # the lost peer is not one we watch: its neighbours post the verdict within the timeout
            deadline = time.monotonic() + self.timeout_s
            while time.monotonic() < deadline:
                told = self._verdict()
                if told:
                    return told
                time.sleep(self.interval)
            return []
        except Exception:  # noqa: BLE001
            return None

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Turn a collective failure caused by a lost peer into the one-line lost-rank exit."""
        try:
            yield
        except RuntimeError as e:
            lost = self.diagnose()
            if lost is None:
                self.on_lost(self._store_lost(e))
            elif lost:
                self.on_lost(self.lost_message(lost, f"a collective failed: {_short(e)}"))
            raise


def start_watchdog(grid: ProcessGrid, timeout_s: float, **kw: object) -> Watchdog | None:
    """A started Watchdog for a multi-rank grid launched with a TCP rendezvous (else None)."""
    env = launch_env()
    world = grid.world_size
    if world <= 1 or env.master_addr is None:
        return None
    return Watchdog(grid.rank, world, timeout_s, host=env.master_addr, port=env.master_port,
                    **kw).start()
