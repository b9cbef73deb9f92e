"""Overlap on vs off is bit-identical: prefetched Z gathers, background reduce-scatters, bucketed
gradient all-reduces launched from hooks, with and without activation checkpointing, with gradient
accumulation, tied and untied embeddings.  Also checks that the overlapped schedule really ran
(prefetches hit, reductions were deferred) and that the byte counts do not change."""
from __future__ import annotations

import pytest
import torch

from axonn.spawn import run_distributed

STEPS = 3


def _model(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=tied, attention_bias=True)
    return LlamaForCausalLM(cfg)


def _train(grid, options, mode: str, tied: bool, ckpt: bool, accum: int) -> dict:
    import axonn
    from axonn.engine import no_sync

    model = axonn.parallelize(_model(tied), grid, mode=mode, options=options)
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses, stats, views = [], [], []
    for step in range(STEPS):
        ids = torch.randint(0, 64, (8, 12), generator=g)
        grid.stats.reset()
        rows = axonn.shard_batch(ids, grid)
        micro = rows.shape[0] // accum
        for m in range(accum):
            part = rows[m * micro:(m + 1) * micro]
            logits = model(input_ids=part).logits[:, :-1]
            loss, count = axonn.cross_entropy(logits, part[:, 1:], grid)
            ctx = no_sync(model) if m < accum - 1 else _Null()
            with ctx:
                (loss / 88.0).backward()
            losses.append(loss.detach().clone())
        axonn.sync_gradients(model, grid)
        bucketer = axonn.engine_of(model).scheduler.bucketer
        if bucketer is not None:  # the reduced gradients are views into one buffer per bucket
            views.append(all(
                len({p.grad.untyped_storage().data_ptr() for p in b.params}) == 1
                and b.params[0].grad.untyped_storage().nbytes()
                == sum(p.numel() * p.element_size() for p in b.params)
                for b in bucketer.buckets) and any(len(b.params) > 1 for b in bucketer.buckets))
        norm = axonn.clip_grad_norm_(model, 0.5, grid)
        opt.step()
        # gradients dropped (autograd allocates, the bucket copies in) or kept (accumulated in place)
        opt.zero_grad(set_to_none=step % 2 == 0)
        losses.append(torch.tensor(norm))
        stats.append(grid.stats.snapshot())
    sched = axonn.engine_of(model).scheduler
    return {"params": [p.detach().clone() for p in model.parameters()], "losses": losses,
            "stats": stats, "hits": sched.prefetch_hits, "misses": sched.prefetch_misses,
            "views": views}


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


CASES = {  # world -> [(dims, mode, tied, checkpointing, micro-batches)]
    2: [((1, 1, 2, 1), "easy", True, False, 2)],
    4: [((1, 1, 2, 2), "easy", True, True, 1), ((2, 1, 2, 1), "paired", False, True, 2)],
    8: [((2, 2, 2, 1), "paired", True, False, 1)],
}


def _compare(rank: int, world: int) -> list[dict]:
    import axonn
    from axonn.schedule import EngineOptions

    out = []
    for dims, mode, tied, ckpt, accum in CASES[world]:
        grid = axonn.ProcessGrid(*dims)
        off = _train(grid, EngineOptions.no_overlap(bucket_mb=0.002), mode, tied, ckpt, accum)
        on = _train(grid, EngineOptions(bucket_grads=True, bucket_mb=0.002), mode, tied, ckpt, accum)
        same_params = all(torch.equal(a, b) for a, b in zip(off["params"], on["params"]))
        same_losses = all(torch.equal(a, b) for a, b in zip(off["losses"], on["losses"]))
        # prefetch adds no bytes once the chain is learned; every other count is unchanged
        out.append(dict(dims=dims, params=same_params, losses=same_losses, hits=on["hits"],
                        misses=on["misses"], off_hits=off["hits"], views=on["views"],
                        same_bytes=off["stats"][-1] == on["stats"][-1]))
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4, 8])
def test_overlap_is_bit_identical(world: int) -> None:
    for per_rank in run_distributed(_compare, world, timeout=300):
        for r in per_rank:
            assert r["params"], f"grid {r['dims']}: parameters differ with overlap on"
            assert r["losses"], f"grid {r['dims']}: losses / grad norms differ with overlap on"
            assert r["off_hits"] == 0
            assert r["hits"] > 0, f"grid {r['dims']}: no prefetch was used"
            assert r["same_bytes"], f"grid {r['dims']}: overlap changed the bytes of a step"
            assert r["views"] == [True] * STEPS, f"grid {r['dims']}: gradients are not bucket views"


def _bucket_misuse(rank: int, world: int) -> str:
    import axonn

    grid = axonn.ProcessGrid(1, 1, 1, 2)
    model = axonn.parallelize(_model(True), grid)  # bucketed gradient all-reduces: the default
    assert axonn.engine_of(model).options.bucket_grads
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # two backwards without no_sync: the second must refuse
        try:
            model(input_ids=ids, labels=ids).loss.backward()
        except RuntimeError as e:
            return str(e)
    return ""


@pytest.mark.distributed
def test_bucketed_accumulation_without_no_sync_fails_loudly() -> None:
    for msg in run_distributed(_bucket_misuse, 2, timeout=120):
        assert "no_sync" in msg
