"""The chunked LM head + cross-entropy (axonn/layers/chunked_ce.py, axonn/lm_head.py) equals the
unchunked head and CE: per-token losses and every gradient, serial (fp64: <= 1e-10 relative) and on
gloo grids against serial (fp64: <= 1e-9), ignored (-100) targets honoured; and it never builds the
full logits (peak memory at vocab 128,256)."""
from __future__ import annotations

import copy
import json
import tempfile

import engine_cases as ec
import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from axonn.config import check_loss_chunk
from axonn.grid import ProcessGrid
from axonn.layers.chunked_ce import chunked_cross_entropy, chunked_cross_entropy_sum
from axonn.lm_head import LossHead, token_cross_entropy_of
from axonn.plan.memory import auto_chunk
from axonn.spawn import run_distributed
from memorize_core import ConfigError

TOL64 = 1e-10


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("chunk", [1, 7, 40, 1000])
def test_function_equals_unchunked_ce_in_fp64(chunk: int) -> None:
    """Loss per token and dh, dW under a non-uniform upstream gradient (a DP-style per-row weight)."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(4, 10, 16, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, 50, (4, 10), generator=g)
    t[torch.rand(4, 10, generator=g) < 0.3] = -100
    weights = torch.rand(40, dtype=torch.float64, generator=g)
    ref = F.cross_entropy((h @ w.t()).reshape(-1, 50), t.reshape(-1), reduction="none")
    (ref * weights).sum().backward()
    want = (h.grad.clone(), w.grad.clone())
    h.grad = w.grad = None
    got = chunked_cross_entropy(h, w, t, ProcessGrid.serial(), chunk)
    assert _rel(got, ref) <= TOL64
    assert torch.all(got[t.reshape(-1) == -100] == 0)
    (got * weights).sum().backward()
    assert _rel(h.grad, want[0]) <= TOL64 and _rel(w.grad, want[1]) <= TOL64


@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_sum_op_equals_weighted_unchunked_ce_in_fp64_without_recompute(chunk: int, monkeypatch) -> None:
    """The sum op (the trainer's loss through the chunked head): the weighted sum and every gradient
    equal the unchunked CE's in fp64, its per-token CE too, and the head's logits GEMM runs once per
    chunk in all (forward + backward: the gradient was formed in forward, nothing is recomputed)."""
    import axonn.layers.chunked_ce as cc

    g = torch.Generator().manual_seed(0)
    h = torch.randn(4, 10, 16, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, 50, (4, 10), generator=g)
    t[torch.rand(4, 10, generator=g) < 0.3] = -100
    keep = torch.rand(4, 10, generator=g) < 0.7  # a goldfish-style mask: the tokens the sum keeps
    ref = F.cross_entropy((h @ w.t()).reshape(-1, 50), t.reshape(-1), reduction="none")
    (ref * keep.reshape(-1)).sum().mul(0.37).backward()  # a scalar upstream gradient (1 / tokens)
    want = (h.grad.clone(), w.grad.clone())
    h.grad = w.grad = None
    calls = []
    real = cc._logits
    monkeypatch.setattr(cc, "_logits", lambda *a: calls.append(1) or real(*a))
    total, ce = chunked_cross_entropy_sum(h, w, t, ProcessGrid.serial(), chunk, weights=keep)
    assert _rel(ce, ref) <= TOL64 and not ce.requires_grad
    assert _rel(total, (ref * keep.reshape(-1)).sum()) <= TOL64
    total.mul(0.37).backward()
    assert _rel(h.grad, want[0]) <= TOL64 and _rel(w.grad, want[1]) <= TOL64
    assert len(calls) == -(-40 // chunk)
    grads_formed = []
    monkeypatch.setattr(cc, "_accumulate", lambda *a: grads_formed.append(1))
    with torch.no_grad():  # evaluation: the loss only, no gradient formed in forward
        assert _rel(chunked_cross_entropy_sum(h, w, t, ProcessGrid.serial(), chunk)[1], ref) <= TOL64
    assert not grads_formed
    monkeypatch.undo()
    w.requires_grad_(False)  # a frozen head (LoRA): dh alone
    h.grad = None
    chunked_cross_entropy_sum(h, w, t, ProcessGrid.serial(), chunk, weights=keep)[0].mul(0.37).backward()
    assert _rel(h.grad, want[0]) <= TOL64


def test_bf16_gemm_fp32_accumulation() -> None:
    """Under bf16 autocast the loss is fp32 and follows the unchunked bf16 head within bf16 noise."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(64, 32, generator=g, requires_grad=True)
    w = torch.randn(300, 32, generator=g) * 0.1
    t = torch.randint(0, 300, (64,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy((h @ w.t()).float(), t, reduction="none")
        got = chunked_cross_entropy(h, w, t, ProcessGrid.serial(), 16)
    assert got.dtype == torch.float32
    assert _rel(got, ref) <= 1e-6  # same bf16 logits, same fp32 softmax: only the chunking differs
    got.sum().backward()
    assert h.grad.dtype == torch.float32 and torch.isfinite(h.grad).all()


def _model_losses(model: torch.nn.Module, ids, labels, grid, setting) -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    head = LossHead(model, grid, setting)
    out = head.forward(ids)
    tgt = labels[:, 1:]
    ce = token_cross_entropy_of(out, tgt, grid)
    (ce.sum() / (tgt != -100).sum()).backward()
    return float(ce.sum().detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [True, False])
def test_lm_head_chunked_equals_full_logits_serial(tied: bool) -> None:
    """A tiny Llama (fp64): the trainer's chunked path gives the full-logit loss and every gradient."""
    model = ec.llama(tied=tied).double()
    ids, labels = ec.batch()
    ref_loss, ref_grads = _model_losses(model, ids, labels, ProcessGrid.serial(), "off")
    loss, grads = _model_losses(model, ids, labels, ProcessGrid.serial(), 5)
    assert abs(loss - ref_loss) / abs(ref_loss) <= TOL64
    for name, want in ref_grads.items():
        assert _rel(grads[name], want) <= TOL64, name


def test_setting_refusals() -> None:
    for bad in (0, -4, "fast", True, 2.5):
        with pytest.raises(ConfigError, match="trainer.loss_chunk"):
            check_loss_chunk(bad)
    check_loss_chunk("auto")
    check_loss_chunk(128)
    from axonn.config import TrainerConfig, build

    with pytest.raises(ConfigError, match=r"trainer.loss_chunk=0: tokens per chunk .* >= 1"):
        build(TrainerConfig, {"loss_chunk": 0}, "trainer")
    assert build(TrainerConfig, {"loss_chunk": 2048}, "trainer").loss_chunk == 2048
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ConfigError, match="does not apply"):
        LossHead(plain, ProcessGrid.serial(), 64)
    assert LossHead(plain, ProcessGrid.serial(), "auto").head is None  # auto: full logits, no error
    with pytest.raises(ConfigError, match="gradient hook"):
        LossHead(ec.llama(tied=True), ProcessGrid.serial(), 64, hook_ok=False)


def test_auto_chunks_only_large_logits() -> None:
    model = ec.llama(tied=True)
    head = LossHead(model, ProcessGrid.serial(), "auto")
    assert head.chunk_for(8 * 7) == 0  # vocab 128: never worth it
    assert auto_chunk(128_256) == 512 and auto_chunk(128_256 // 4) == 2048


def _peak_bytes(fn) -> int:
    """Peak CPU bytes torch allocated while `fn` ran, over what was live when it started (the
    profiler's memory events: "Total Allocated" after each allocation and free)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/t.json")
        with open(f"{tmp}/t.json") as f:
            events = [e["args"] for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"]
    before = events[0]["Total Allocated"] - events[0]["Bytes"]
    return max(e["Total Allocated"] for e in events) - before


def test_peak_memory_at_llama3_vocab() -> None:
    """Vocab 128,256, 256 tokens, fp32, forward + backward: the chunked path's peak <= 0.3x the
    unchunked one's (which holds the logits and their gradient)."""
    g = torch.Generator().manual_seed(0)
    vocab, hidden, n = 128_256, 32, 256
    w = (torch.randn(vocab, hidden, generator=g) * 0.02).requires_grad_()
    t = torch.randint(0, vocab, (n,), generator=g)
    h = torch.randn(n, hidden, generator=g, requires_grad=True)
    full = _peak_bytes(lambda: F.cross_entropy(h @ w.t(), t, reduction="none").sum().backward())
    w.grad = h.grad = None
    chunked = _peak_bytes(lambda: chunked_cross_entropy(h, w, t, ProcessGrid.serial(), 32).sum().backward())
    print(f"\npeak full {full / 2**20:.1f} MiB, chunked {chunked / 2**20:.1f} MiB "
          f"(ratio {chunked / full:.3f}; dW alone {vocab * hidden * 4 / 2**20:.1f} MiB)")
    assert chunked <= 0.3 * full


GRIDS = [((1, 2, 1, 1), "paired"), ((2, 1, 1, 1), "paired"), ((1, 1, 2, 1), "easy"),
         ((1, 1, 1, 2), "easy"), ((2, 2, 1, 1), "paired"), ((2, 1, 2, 1), "paired"),
         ((1, 2, 2, 1), "easy")]


def _grid_rank(rank: int, world: int, dims: tuple, mode: str, tied: bool) -> dict:
    import axonn

    torch.manual_seed(0)
    serial = ec.llama(tied=tied, kv_heads=ec.kv_heads(mode, dims[1])).double()
    ids, labels = ec.batch()
    ref_loss, ref_grads = _model_losses(copy.deepcopy(serial), ids, labels, ProcessGrid.serial(), "off")
    grid = axonn.ProcessGrid(*dims)
    model = axonn.parallelize(copy.deepcopy(serial), grid, mode=mode)
    local_ids, local_labels = axonn.shard_batch(ids, grid), axonn.shard_batch(labels, grid)
    head = LossHead(model, grid, 3)
    assert head.head is not None, head.reason
    tgt = local_labels[:, 1:]
    out = {}
    for op in ("per-token", "sum"):  # the per-token op, then the sum op (gradient formed in forward)
        model.zero_grad(set_to_none=True)
        hidden = head.forward(local_ids)
        if op == "per-token":
            total = token_cross_entropy_of(hidden, tgt, grid).sum()
        else:
            total = hidden.ce_sum(tgt)[0]
        (total / (labels[:, 1:] != -100).sum()).backward()
        axonn.sync_gradients(model, grid)
        loss = float(axonn.all_reduce_sum(total.detach().clone(), grid))
        grads = axonn.full_grad_dict(model)
        out[op] = {"loss": abs(loss - ref_loss) / abs(ref_loss),
                   "grad": max(_rel(grads[k], g) for k, g in ref_grads.items())}
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("dims,mode", GRIDS, ids=["".join(map(str, d)) + m for d, m in GRIDS])
def test_chunked_head_on_grids_equals_serial_fp64(dims: tuple, mode: str) -> None:
    world = dims[0] * dims[1] * dims[2] * dims[3]
    for tied in (True, False):
        per_rank = run_distributed(_grid_rank, world, dims, mode, tied, timeout=300)
        for r in per_rank:
            for op, e in r.items():
                assert e["loss"] <= 1e-9 and e["grad"] <= 1e-9, (dims, mode, tied, op, e)


def _history(loss_chunk, transform=None, grid=None) -> tuple[list[dict], float]:
    from helpers import rows, tiny_model

    from axonn.config import TrainerConfig
    from axonn.trainer import Trainer

    model = tiny_model()
    if grid is not None and grid.distributed:
        import axonn

        model = axonn.parallelize(model, grid, mode="paired")
    cfg = TrainerConfig(lr=1e-2, warmup_steps=1, batch_size=4, max_steps=4, progress=False, seed=3,
                        device="cpu", loss_chunk=loss_chunk)
    trainer = Trainer(model, cfg, rows(n=12), eval_data=rows(n=6, seed=1), label_transform=transform,
                      grid=grid)
    assert (trainer.loss_head.head is not None) == (loss_chunk != "off")
    return trainer.fit(), trainer.evaluate()


def _same_run(a: tuple[list[dict], float], b: tuple[list[dict], float], tol: float) -> None:
    (ha, ea), (hb, eb) = a, b
    assert len(ha) == len(hb)
    for x, y in zip(ha, hb):
        for key in ("loss", "dropped_loss"):
            if key in y:
                assert abs(x[key] - y[key]) <= tol * abs(y[key]), (key, x, y)
    assert abs(ea - eb) <= tol * abs(eb)


def test_trainer_chunked_run_equals_full_logits_run() -> None:
    """4 AdamW steps of a tiny Llama (fp32), standard loss and goldfish (the per-token split with the
    dropped-token metric): every step's loss, the dropped loss and the held-out loss agree with the
    full-logit run to float noise (1e-5 relative: after 4 steps of lr 1e-2 the weights differ by
    rounding only)."""
    from memorization.mitigations.goldfish import GoldfishConfig, GoldfishTransform

    _same_run(_history(7), _history("off"), 1e-5)
    fish = GoldfishConfig(enabled=True, k=3, h=2)
    _same_run(_history(7, GoldfishTransform(fish, seed=1)), _history("off", GoldfishTransform(fish, seed=1)),
              1e-5)


def _trainer_rank(rank: int, world: int, dims: tuple) -> list:
    import axonn

    grid = axonn.ProcessGrid(*dims)
    return [_history(c, grid=grid) for c in (5, "off")]


@pytest.mark.distributed
@pytest.mark.parametrize("dims", [(1, 2, 1, 1), (2, 1, 1, 1)], ids=["1211", "2111"])
def test_trainer_chunked_run_on_grid(dims: tuple) -> None:
    """The same on gloo ranks (paired mode, vocab split over Y at 1,2,1,1): the chunked run's figures
    equal the full-logit run's on the same grid, on every rank."""
    world = dims[0] * dims[1] * dims[2] * dims[3]
    for chunked, full in run_distributed(_trainer_rank, world, dims, timeout=300):
        _same_run(chunked, full, 1e-5)


def test_fused_chunk_kernels_trace_whole_and_match_eager() -> None:
    """The per-chunk element-wise functions compiled on CUDA (`_fused`) trace as one graph each
    (fullgraph, CPU aot_eager here) and give the eager results."""
    from axonn.layers.chunked_ce import _chunk_stats, _softmax_grad

    g = torch.Generator().manual_seed(2)
    y = torch.randn(16, 300, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, 300, (16,), generator=g)
    own = torch.rand(16, generator=g) < 0.8
    eager = _chunk_stats(y, idx, own)
    compiled = torch.compile(_chunk_stats, backend="aot_eager", fullgraph=True)(y, idx, own)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
    lse = eager[0].log() + eager[2]
    w = torch.rand(16, generator=g)
    grad = _softmax_grad(y, lse, w, idx, own, torch.bfloat16)
    assert torch.equal(grad, torch.compile(_softmax_grad, backend="aot_eager", fullgraph=True)(
        y, lse, w, idx, own, torch.bfloat16))
    assert grad.dtype == torch.bfloat16
