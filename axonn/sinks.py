"""Where the trainer's metrics go: the `MetricSink` protocol and the JSONL file sink (metrics.jsonl).

The trainer emits one metrics dict per optimizer step (and callbacks' results through
`Trainer.log`) to every sink on the main rank; memorization.tracking.WandbSink is another sink.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol


class MetricSink(Protocol):
    """Receives one metrics dict per optimizer step (and eval results)."""

    def log(self, metrics: dict[str, Any]) -> None: ...

    @property
    def closed(self) -> bool: ...

    def close(self) -> None: ...


class JsonlSink:
    """Append one JSON object per metrics dict to a file (flushed every line)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", encoding="utf-8")

    def log(self, metrics: dict[str, Any]) -> None:
        """Write one line."""
        self._fh.write(json.dumps(metrics) + "\n")
        self._fh.flush()

    @property
    def closed(self) -> bool:
        """True once close() has run."""
        return self._fh.closed

    def close(self) -> None:
        """Close the file."""
        self._fh.close()
