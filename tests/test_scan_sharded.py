"""`memorize scan --grid` on 4 gloo ranks (1,2,1,2: heads and vocab over Y, batch over data; 2,1,2,1:
X split, batch over Z in lockstep and data) writes the rows a serial scan writes, row for row (and,
marked slow, with --generate decoding the non-exact rows on the grid); only the main rank writes."""
from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
from helpers import tiny_scan_folder

from axonn.spawn import run_distributed
from memorization.cli import main

pytestmark = pytest.mark.distributed
EXACT = ("row", "sequence", "offset", "doc", "doc_id", "doc_offset", "exact_match", "lead",
         "continuation_ids", "prefix_ids", "suffix_ids")
CLOSE = ("token_accuracy", "suffix_loss", "zlib_ratio", "min_k", "memorization_score", "rougeL")


def _argv(root, out, *extra) -> list[str]:
    # 7 rows per batch: no batch-shard count divides it, so shards hold 3 and 4 rows (Z fillers run)
    return ["scan", "--model", str(root / "model"), "--data", str(root / "corpus.idx"), "--prefix", "6",
            "--suffix", "6", "--offsets", "stride:20", "--batch-size", "7", "--part-rows", "20",
            "--no-progress", *extra, "--out", str(out)]


def _rank(rank, world, runs):
    return [main(argv) for argv in runs]  # one spawn, both grids: the ranks import and start once


@pytest.mark.parametrize("generate", [
    False,
    # --generate decodes on the grid: ~50 lockstep forwards of 4 gloo ranks per grid, minutes on 2 cores
    pytest.param(True, marks=pytest.mark.slow),
])
def test_sharded_scan_equals_serial(tmp_path_factory, generate):
    root = tiny_scan_folder(tmp_path_factory.mktemp("scan"))
    extra = ["--generate"] if generate else []
    assert main(_argv(root, root / "serial", *extra)) == 0
    grids = ("1,2,1,2", "2,1,2,1")
    runs = [_argv(root, root / dims, "--grid", dims, *extra) for dims in grids]
    assert run_distributed(_rank, 4, runs, init=False, timeout=900) == [[0, 0]] * 4
    serial = pq.read_table(root / "serial" / "parts").to_pydict()
    assert len(serial["row"]) > 30
    for dims in grids:
        grid = pq.read_table(root / dims / "parts").to_pydict()
        for c in EXACT:
            assert grid.get(c) == serial.get(c), (dims, c)
        for c in CLOSE:
            if c in serial:
                np.testing.assert_allclose(grid[c], serial[c], rtol=1e-5, atol=1e-7, err_msg=f"{dims} {c}")
        names = [sorted(p.name for p in (root / name).iterdir()) for name in (dims, "serial")]
        assert names[0] == names[1]
