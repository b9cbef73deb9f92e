"""GPU-only: the single-GPU benchmark runs end to end on a small shape and reports sane numbers."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.gpu
def test_bench_gpu_runs_and_reports(tmp_path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_gpu

    out = tmp_path / "gpu.json"
    rc = bench_gpu.main(["--model", "tiny", "--seq", "128", "--batch", "2", "--steps", "2",
                         "--warmup", "1", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert 0 < data["mfu"] < 1 and data["tokens_per_s"] > 0
    assert data["peak_memory_gib"] > 0 and data["predicted_memory_gib"] > 0
    assert data["machine"]["device"] != "cpu"
