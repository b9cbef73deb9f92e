"""Metrics experiments add to a finished run: membership inference and sample generations."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from evals import membership_inference

SAMPLE_COLUMNS = ["run", "doc", "prefix", "target", "generated", "exact_match"]


def mia_metrics(model: torch.nn.Module, members: list[list[int]], nonmembers: list[list[int]],
                tokenizer: Any) -> dict[str, Any]:
    """ROC AUC of loss / zlib / min-k% membership scores, training documents vs held-out ones."""
    if len(members) < 2 or len(nonmembers) < 2:
        return {"mia_auc": None, "mia": None}
    res = membership_inference(model, members, nonmembers, tokenizer=tokenizer, batch_size=32)
    return {"mia_auc": res["loss"]["auc"], "mia_tpr_at_1pct_fpr": res["loss"]["tpr_at_1pct_fpr"],
            "mia": res, "mia_members": len(members), "mia_nonmembers": len(nonmembers)}


def extraction_samples(run: str, run_dir: Path, tokenizer: Any, n: int) -> list[list[Any]]:
    """The first n rows of a run's extraction.jsonl, decoded, for the W&B samples table."""
    path = run_dir / "extraction.jsonl"
    if n <= 0 or not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines()[:n]:
        r = json.loads(line)
        rows.append([run, str(r["doc"]), tokenizer.decode(r["prefix_ids"]), tokenizer.decode(r["target_ids"]),
                     tokenizer.decode(r["generated_ids"]), bool(r["exact_match"])])
    return rows
