"""GPU-only checks of issue 32's speed paths (benchmarks/gpu_session.sh runs them): the chunked head
with its compiled per-chunk kernels follows the full-logit loss under bf16 autocast, a compiled
Trainer step matches the eager one, the compiled static-cache decode (CUDA graphs) gives
greedy_generate's tokens, and extraction on CUDA decodes through it with every row checked (issue 41)."""
from __future__ import annotations

import copy

import engine_cases as ec
import pytest
import torch
from helpers import memorized_model, rows, tiny_model

from axonn.config import TrainerConfig
from axonn.grid import ProcessGrid
from axonn.lm_head import LossHead, token_cross_entropy_of
from axonn.trainer import Trainer
from evals.decoding import greedy_generate
from evals.static_decode import static_decoder, static_greedy_generate

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _loss_grads(model: torch.nn.Module, setting) -> tuple[float, dict]:
    ids, labels = (t.cuda() for t in ec.batch())
    model.zero_grad(set_to_none=True)
    head = LossHead(model, ProcessGrid.serial(device="cuda"), setting)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = head.forward(ids)
    ce = token_cross_entropy_of(out, labels[:, 1:], ProcessGrid.serial(device="cuda"))
    (ce.sum() / (labels[:, 1:] != -100).sum()).backward()
    return float(ce.sum().detach()), {n: p.grad.float().clone() for n, p in model.named_parameters()}


@needs_cuda
def test_chunked_head_bf16_follows_full_logits_on_cuda() -> None:
    model = ec.llama(tied=True).cuda()
    ref_loss, ref = _loss_grads(model, "off")
    loss, got = _loss_grads(model, 5)  # 56 tokens in 12 chunks: the compiled kernels, a ragged tail
    assert abs(loss - ref_loss) <= 1e-3 * abs(ref_loss)
    for name, g in ref.items():
        assert (got[name] - g).abs().max() <= 2e-2 * g.abs().max() + 1e-6, name


@needs_cuda
def test_compiled_trainer_matches_eager_on_cuda() -> None:
    def run(compile_: bool) -> list[float]:
        cfg = TrainerConfig(lr=1e-3, warmup_steps=0, batch_size=4, max_steps=3, progress=False, seed=3,
                            device="cuda", compile=compile_, precision="fp32")
        t = Trainer(tiny_model(), cfg, rows(n=12))
        assert t.compiled_blocks == (2 if compile_ else 0)
        return [m["loss"] for m in t.fit()]

    eager, compiled = run(False), run(True)
    assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(compiled, eager)), (compiled, eager)


@needs_cuda
def test_compiled_static_decode_tokens_on_cuda() -> None:
    model = tiny_model().cuda().eval()
    pre = torch.randint(0, 64, (8, 12), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    ref = greedy_generate(model, pre, 10)
    assert torch.equal(static_greedy_generate(model, pre, 10), ref)
    dec = static_decoder(model, 8, 22)
    first = dec.compile_s
    assert torch.equal(static_greedy_generate(model, pre, 10), ref) and dec.compile_s == first


@needs_cuda
def test_extraction_on_cuda_takes_the_verified_static_path() -> None:
    """What `memorize eval` and the experiments run on a GPU: decode=auto is the compiled static decode
    (CUDA graphs) with every row checked, its rows equal the KV-cache decoder's on a trained model,
    the engine at 1,1,1,1 with and without compiled blocks (a GPU run's model) included."""
    import axonn
    from axonn.compile import compile_blocks
    from evals import extract
    from evals.static_decode import DecodeLog

    model, docs = memorized_model()
    engine = axonn.parallelize(copy.deepcopy(model).cuda(), ProcessGrid.serial(device="cuda"))
    compiled = axonn.parallelize(copy.deepcopy(model).cuda(), ProcessGrid.serial(device="cuda"))
    compile_blocks(compiled, True)  # a GPU run's model: its blocks compiled for training (inductor)
    for m in (model.cuda(), engine, compiled):
        log = DecodeLog()
        got = extract(m, docs, prefix_len=8, suffix_len=12, batch_size=4, decode_log=log)
        kv = extract(m, docs, prefix_len=8, suffix_len=12, batch_size=4, decode="kv")
        assert [r.generated_ids for r in got] == [r.generated_ids for r in kv]
        assert log.to_dict()["path"] == "static" and log.rows == len(docs), log.to_dict()


@needs_cuda
def test_chunked_head_sum_op_bf16_follows_full_logits_on_cuda() -> None:
    """The trainer's default head (the summed loss, gradient formed in forward) under bf16 autocast,
    with its compiled per-chunk kernels, against the full-logit loss."""
    model = ec.llama(tied=True).cuda()
    ids, labels = (t.cuda() for t in ec.batch())
    grid = ProcessGrid.serial(device="cuda")
    ref_loss, ref = _loss_grads(model, "off")
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = LossHead(model, grid, 5).forward(ids)
    total, _ = out.ce_sum(labels[:, 1:])
    (total / (labels[:, 1:] != -100).sum()).backward()
    assert abs(float(total) - ref_loss) <= 1e-3 * abs(ref_loss)
    for name, p in model.named_parameters():
        g = ref[name]
        assert (p.grad.float() - g).abs().max() <= 2e-2 * g.abs().max() + 1e-6, name
