"""The experiments' optional corpus scan: after a scored pass, the fraction of the training set
extractable, beside the per-document extraction figures.

With `scan_corpus: true` in an experiment (catastrophic-memorization, catastrophic-llama,
pretrained-memorization), every training document as trained on is cut into (prefix, suffix) windows
at `scan_stride` tokens (0: prefix + suffix, windows side by side) and each is scored from one
teacher-forced forward on the run's grid (evals/scan.py, the same scoring as `memorize scan`). The
pass record gains `scan_windows`, `scan_exact_match_rate` (greedy decoding reproduces the suffix), its
95% Wilson interval and `scan_lead_mean` (leading suffix tokens reproduced). The per-document figure
asks about each document's first window; the scan asks about every window of the training data.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import islice
from typing import Any

import numpy as np
import torch

from axonn.grid import ProcessGrid
from data_pipelines.scan_windows import Selection, windows
from data_pipelines.token_sources import in_memory
from evals.scan import score_windows
from evals.scoring import Scorer
from memorization.scan.summary import wilson
from memorize_core import fail


@dataclass
class ScanSettings:
    """Experiment keys of the optional training-set scan."""

    scan_corpus: bool = False  # after each scored pass, scan every window of the training documents
    scan_stride: int = 0  # tokens between window starts (0 = prefix + suffix)

    def check_scan(self) -> None:
        """scan_stride >= 0."""
        stride = self.scan_stride
        if isinstance(stride, bool) or not isinstance(stride, int) or stride < 0:
            raise fail("scan_stride", self.scan_stride, "must be an integer >= 0 (0 = prefix + suffix)")


def scan_training_set(model: torch.nn.Module, docs: list[list[int]], *, prefix: int, suffix: int,
                      stride: int = 0, batch_size: int = 32,
                      grid: ProcessGrid | None = None) -> dict[str, Any]:
    """Exact match of every (prefix, suffix) window of `docs` (on every rank; a collective on a grid)."""
    sel = Selection(prefix, suffix, offsets=f"stride:{stride or prefix + suffix}")
    it = windows(in_memory("train", docs), sel)
    sc = Scorer(model, grid)
    leads: list[np.ndarray] = []
    while batch := list(islice(it, batch_size)):
        ids = torch.from_numpy(np.stack([w.tokens for w in batch]))
        leads.append(score_windows(model, ids, prefix, scorer=sc)["lead"])
    lead = np.concatenate(leads) if leads else np.zeros(0, np.int64)
    n, k = len(lead), int((lead == suffix).sum())
    nan = float("nan")
    return {"scan_windows": n, "scan_exact_match_rate": k / n if n else nan,
            "scan_exact_match_ci95": wilson(k, n), "scan_lead_mean": float(lead.mean()) if n else nan}


__all__ = ["ScanSettings", "scan_training_set"]
