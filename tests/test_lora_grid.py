"""LoRA on the engine's sharded layers == serial peft LoRA (tiny Llama, fp64), on every kind of grid.

Per grid, 10 AdamW steps: losses within 1e-6 relative of the serial peft run's, merged and adapter
exports (written from the shards) equal to peft's within 1e-6 and loadable by transformers / peft,
base weights bit-identical to the slices of the untrained model, and exact resume (same grid: same
bits; another tensor-split grid: resharded).
"""
from __future__ import annotations

import math

import pytest
import torch
from helpers import rows, tiny_model
from safetensors.torch import load_file

from axonn.config import TrainerConfig
from axonn.spawn import run_distributed
from axonn.trainer import Trainer
from memorization.mitigations.peft_lora import LoraSettings, apply_lora, export_lora, lora_targets

TOL = 1e-6
STEPS = 10
SETTINGS = LoraSettings(enabled=True, r=4, alpha=8.0, target_modules="all-linear")


def _cfg(**kw) -> TrainerConfig:
    base = dict(lr=1e-2, warmup_steps=2, batch_size=8, max_steps=STEPS, progress=False, seed=3, device="cpu",
                weight_decay=0.1, keep_last=0)
    base.update(kw)
    return TrainerConfig(**base)


def _model() -> torch.nn.Module:
    """The tiny Llama in fp64 with eager attention (CPU SDPA rounds batch-dependently at ~1e-8)."""
    model = tiny_model(seed=0).double()
    model.config._attn_implementation = "eager"
    return model


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _sharded(dims: tuple[int, ...], mode: str, settings: LoraSettings = SETTINGS) -> torch.nn.Module:
    import axonn
    from memorization.mitigations.peft_lora import apply_sharded_lora

    targets = lora_targets(_model(), settings)
    grid = axonn.ProcessGrid(*dims) if math.prod(dims) > 1 else axonn.ProcessGrid.serial()
    model = axonn.parallelize(_model(), grid, mode=mode)
    return apply_sharded_lora(model, settings, targets, seed=5)


def _serial_run(base_dir: str, out: str) -> list[float]:
    """The reference: peft on the plain model, trained serially; both exports written under `out`."""
    model = apply_lora(_model(), SETTINGS, seed=5)
    history = Trainer(model, _cfg(), rows(n=16)).fit()
    export_lora(model, f"{out}/merged", SETTINGS)
    export_lora(model, f"{out}/adapter", LoraSettings(**{**SETTINGS.__dict__, "export": "adapter"}),
                base_dir=base_dir)
    return [h["loss"] for h in history]


def _grid_runs(rank: int, world: int, runs: list, base_dir: str, out: str) -> list[dict]:
    import axonn
    from axonn.engine import named_layouts

    serial = _model().state_dict()
    results = []
    for dims, mode, *ckpt in runs:
        model = _sharded(dims, mode)
        grid = axonn.engine_of(model).grid
        history = Trainer(model, _cfg(activation_checkpointing=bool(ckpt)), rows(n=16), grid=grid).fit()
        frozen = all(torch.equal(t, spec.local_from_full(serial[key.replace(".base_layer.", ".")]))
                     for key, t, spec in named_layouts(model)
                     if spec is not None and "lora_" not in key)
        trains = sorted(n for n, p in model.named_parameters() if p.requires_grad)
        where = f"{out}/{'-'.join(map(str, dims))}-{mode}{'-ckpt' if ckpt else ''}"
        export_lora(model, f"{where}/merged", SETTINGS)
        export_lora(model, f"{where}/adapter", LoraSettings(**{**SETTINGS.__dict__, "export": "adapter"}),
                    base_dir=base_dir)
        results.append({"dims": dims, "mode": mode + (" + activation checkpointing" if ckpt else ""),
                        "losses": [h["loss"] for h in history], "frozen": frozen,
                        "lora_only": all(".lora_" in n for n in trains) and len(trains) == 28, "dir": where})
    return results


def _check(tmp_path, world: int, runs: list) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = tmp_path / "base"
    _model().save_pretrained(base)
    want = _serial_run(str(base), str(tmp_path / "serial"))
    got = run_distributed(_grid_runs, world, runs, str(base), str(tmp_path), timeout=600)[0]
    ref_merged = load_file(str(tmp_path / "serial" / "merged" / "model.safetensors"))
    ref_adapter = load_file(str(tmp_path / "serial" / "adapter" / "adapter_model.safetensors"))
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref_logits = PeftModel.from_pretrained(_model(), tmp_path / "serial" / "adapter")(ids).logits
    for r in got:
        what = f"grid {r['dims']} {r['mode']}"
        assert r["frozen"] and r["lora_only"], what
        assert len(r["losses"]) == STEPS
        merged = load_file(f"{r['dir']}/merged/model.safetensors")
        adapter = load_file(f"{r['dir']}/adapter/adapter_model.safetensors")
        assert merged.keys() == ref_merged.keys() and adapter.keys() == ref_adapter.keys(), what
        with torch.no_grad():  # both folders load where a user loads them
            by_auto = AutoModelForCausalLM.from_pretrained(f"{r['dir']}/merged", dtype=torch.float64,
                                                           attn_implementation="eager")
            by_peft = PeftModel.from_pretrained(_model(), f"{r['dir']}/adapter")
            logits = max(_rel(by_auto(ids).logits, ref_logits), _rel(by_peft(ids).logits, ref_logits))
        err = {"loss": max(abs(a - b) / abs(b) for a, b in zip(r["losses"], want)),
               "merged": max(_rel(merged[k], ref_merged[k]) for k in merged),
               "adapter": max(_rel(adapter[k], ref_adapter[k]) for k in adapter), "logits": logits}
        print(f"\n{what}: worst rel err " + ", ".join(f"{k} {v:.1e}" for k, v in err.items()))
        assert max(err.values()) <= TOL, f"{what}: {err}"


@pytest.mark.distributed
def test_two_rank_grids_equal_serial_peft(tmp_path):
    runs = [((2, 1, 1, 1), "paired"), ((1, 2, 1, 1), "paired"), ((1, 2, 1, 1), "easy"),
            ((1, 1, 2, 1), "paired"), ((1, 1, 2, 1), "paired", "activation checkpointing")]
    _check(tmp_path, 2, runs)


@pytest.mark.distributed
def test_tensor_and_data_split_equals_serial_peft(tmp_path):
    _check(tmp_path, 4, [((1, 2, 1, 2), "paired")])


@pytest.mark.distributed
@pytest.mark.slow
def test_three_d_grid_equals_serial_peft(tmp_path):
    _check(tmp_path, 8, [((2, 2, 2, 1), "paired")])


def _resume(rank: int, world: int, root: str) -> dict:
    """10 steps with a checkpoint at 5; then resumed from it at the same grid and at another grid."""
    import axonn

    def trainer(dims, **kw):
        model = _sharded(dims, "paired")
        return Trainer(model, _cfg(checkpoint_every=5, **kw), rows(n=16), grid=axonn.engine_of(model).grid,
                       checkpoint_dir=f"{root}/{'-'.join(map(str, dims))}")

    full = [h["loss"] for h in trainer((2, 1, 1, 1)).fit()]
    out = {"full": full}
    for dims in ((2, 1, 1, 1), (1, 2, 1, 1)):
        t = trainer(dims)
        t.load_checkpoint(f"{root}/2-1-1-1/step-00000005")
        out[dims] = [h["loss"] for h in t.fit()]
    return out


@pytest.mark.distributed
def test_resume_is_exact_and_reshards(tmp_path):
    got = run_distributed(_resume, 2, str(tmp_path), timeout=400)[0]
    full = got["full"]
    assert got[(2, 1, 1, 1)] == full[5:]  # same grid: the same bits
    err = max(abs(a - b) / abs(b) for a, b in zip(got[(1, 2, 1, 1)], full[5:]))
    print(f"\nresumed at 1,2,1,1 from a 2,1,1,1 checkpoint: loss rel err {err:.1e}")
    assert err <= TOL


def test_serial_grid_adapters_start_from_peft_and_forward_the_same():
    """On the 1x1x1x1 grid the engine's adapters are peft's numbers and give peft's logits."""
    import axonn

    peft_model = apply_lora(_model(), SETTINGS, seed=5)
    mine = _sharded((1, 1, 1, 1), "paired")
    theirs = {k.replace("base_model.model.", "").replace(".default.", "."): v
              for k, v in peft_model.named_parameters() if v.requires_grad}
    assert {k: v for k, v in mine.named_parameters() if v.requires_grad}.keys() == theirs.keys()
    with torch.no_grad():
        for k, p in mine.named_parameters():
            if k in theirs:
                assert torch.equal(p, theirs[k]), k
                if ".lora_B." in k:  # B starts at zero: give it values so the side path shows
                    p.normal_(generator=torch.Generator().manual_seed(len(k)))
                    theirs[k].copy_(p)
        ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
        assert _rel(mine(ids).logits, peft_model(ids).logits) <= 1e-12
    assert axonn.is_parallel(mine)
