"""Weights & Biases tracking that never kills a run: offline by default, falls back on trouble."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from memorization.config import WandbConfig


def _say(msg: str) -> None:
    print(f"[wandb] {msg}", file=sys.stderr)


def uniform_columns(rows: list[list[Any]]) -> list[list[Any]]:
    """The rows with every column of one type (W&B refuses a table mixing numbers, text and booleans in a
    column, e.g. a '-' among pass numbers): a mixed column is written as text; None stays empty. Text of a
    str subclass (a report's Shown cell) becomes plain str: W&B types a column by the cells' classes."""
    rows = [[str(v) if isinstance(v, str) and type(v) is not str else v for v in r] for r in rows]
    for j in range(len(rows[0]) if rows else 0):
        kinds = {"text" if isinstance(r[j], str) else "bool" if isinstance(r[j], bool) else "number"
                 for r in rows if r[j] is not None}
        if len(kinds) > 1:
            for r in rows:
                r[j] = None if r[j] is None else str(r[j])
    return rows


class WandbSink:
    """An axonn.sinks.MetricSink writing to a W&B run (offline unless the user asked for online)."""

    def __init__(self, cfg: WandbConfig, *, name: str, out_dir: str | Path, config: dict[str, Any]):
        self.run = None
        if cfg.mode == "disabled":
            return
        # An explicit WANDB_MODE from the user wins over the config (e.g. WANDB_MODE=disabled in CI).
        mode = os.environ.get("WANDB_MODE") or cfg.mode
        os.environ.setdefault("WANDB_SILENT", "true")
        try:
            import wandb  # deferred: wandb +0.6 s, may be off
        except ImportError:
            _say("wandb is not installed; metrics stay in metrics.jsonl")
            return
        kwargs = dict(project=cfg.project, name=name, dir=str(out_dir), config=config,
                      group=cfg.group or None, tags=cfg.tags or None, entity=cfg.entity or None,
                      reinit="create_new")
        try:
            self.run = wandb.init(mode=mode, **kwargs)
        except Exception as e:  # noqa: BLE001 - any W&B failure must fall back, never abort
            if mode == "offline":
                _say(f"could not start an offline run ({type(e).__name__}: {e}); tracking disabled")
                return
            _say(f"online run failed ({type(e).__name__}: {e}); falling back to offline")
            try:
                self.run = wandb.init(mode="offline", **kwargs)
            except Exception as e2:  # noqa: BLE001
                _say(f"offline fallback failed too ({e2}); tracking disabled")

    @property
    def run_dir(self) -> str | None:
        """The local run folder (what `wandb sync` takes)."""
        return None if self.run is None else str(Path(self.run.dir).parent)

    def log(self, metrics: dict[str, Any]) -> None:
        """Log one step's metrics."""
        if self.run is not None:
            self.run.log(metrics, step=int(metrics.get("step", 0)))

    def log_table(self, key: str, columns: list[str], rows: list[list[Any]]) -> None:
        """Log a table (e.g. sample generations)."""
        if self.run is None:
            return
        import wandb  # deferred: wandb +0.6 s, may be off

        self.run.log({key: wandb.Table(columns=columns, data=uniform_columns(rows))})

    def log_image(self, key: str, path: str | Path) -> None:
        """Log a PNG plot."""
        if self.run is None:
            return
        import wandb  # deferred: wandb +0.6 s, may be off

        self.run.log({key: wandb.Image(str(path))})

    def summary(self, values: dict[str, Any]) -> None:
        """Set run summary values."""
        if self.run is not None:
            self.run.summary.update(values)

    @property
    def closed(self) -> bool:
        """True when no W&B run is open (finished by close(), or never started)."""
        return self.run is None

    def close(self) -> None:
        """Finish the run."""
        if self.run is not None:
            self.run.finish()
            self.run = None
