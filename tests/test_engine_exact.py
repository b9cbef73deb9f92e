"""Serial-vs-grid exactness of the 4D engine for every power-of-two grid with x*y*z*data <= 8.

For each grid: a tiny Llama (attention with bias, MLP without; GQA where the mode allows) in easy and
paired mode, tied and untied embeddings, labels with ignored (-100) targets.  Checked on every rank:
logits (its rows and vocab slice), the global loss, every parameter shard (bitwise equal to the slice
of the serial weights), every gradient shard and the global grad norm (fp32: relative error <= 1e-5,
fp64: <= 1e-12; see engine_cases); on some grids also full_state_dict / full_grad_dict.
"""
from __future__ import annotations

import engine_cases as ec
import pytest

from axonn.spawn import run_distributed

# grids where the (collective) full_state_dict / full_grad_dict are checked too
GATHER = {(1, 1, 1, 1), (2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2), (2, 2, 1, 1),
          (1, 2, 2, 1), (2, 1, 2, 1), (2, 2, 2, 1)}


def _sweep(rank: int, world: int, dtype_name: str = "float32") -> list[dict]:
    import torch

    import axonn

    dtype = getattr(torch, dtype_name)
    ids, labels = ec.batch()
    refs: dict = {}
    out = []
    for i, dims in enumerate(ec.grids(world)):
        grid = axonn.ProcessGrid(*dims)
        for mode, tied in ec.variants(world, i):
            kv = ec.kv_heads(mode, grid.y)
            if (tied, kv) not in refs:
                serial = ec.llama(tied=tied, kv_heads=kv, pad=not tied).to(dtype)
                refs[(tied, kv)] = (serial, ec.serial_reference(serial, ids, labels))
            serial, ref = refs[(tied, kv)]
            r = ec.check_grid(serial, ref, ids, labels, grid, mode, gather=dims in GATHER)
            out.append(dict(r, dims=dims, mode=mode, tied=tied, kv=kv))
    return out


def _check(world: int, dtype_name: str = "float32") -> None:
    per_rank = run_distributed(_sweep, world, dtype_name, timeout=400)
    rows = [r for ranks in per_rank for r in ranks]
    tol = ec.TOL if dtype_name == "float32" else ec.TOL64
    assert rows
    for r in rows:
        what = f"grid {r['dims']} {r['mode']} tied={r['tied']} kv={r['kv']}"
        assert r["params_exact"], f"{what}: parameter shards differ from the serial slices"
        assert r["logits"] <= tol, f"{what}: logits rel err {r['logits']:.2e}"
        assert r["loss"] <= tol, f"{what}: loss rel err {r['loss']:.2e}"
        assert r["grad"] <= tol, f"{what}: grad rel err {r['grad']:.2e} ({r['grad_name']})"
        assert r["norm"] <= tol, f"{what}: grad-norm rel err {r['norm']:.2e}"
        if "state_exact" in r:
            assert r["state_exact"], f"{what}: full_state_dict differs from the serial state dict"
            assert r["full_grad"] <= tol, f"{what}: full_grad_dict rel err {r['full_grad']:.2e}"
    worst = {k: max(r[k] for r in rows) for k in ("logits", "loss", "grad", "norm")}
    grids = sorted({r["dims"] for r in rows})
    print(f"\nworld {world} {dtype_name}: {len(grids)} grids, {len(rows) // world} runs, "
          f"worst rel err {worst}")


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_every_grid_matches_serial(world: int) -> None:
    _check(world)


@pytest.mark.distributed
def test_every_grid_matches_serial_in_float64() -> None:
    """fp64 removes rounding noise: any algorithmic slip would show far above 1e-12."""
    _check(4, "float64")
