"""Meta-device models filled by `load_pretrained` from safetensors: exact shards, bounded memory."""
from __future__ import annotations

from pathlib import Path

import engine_cases as ec
import pytest

from axonn.spawn import run_distributed


def _load_and_compare(rank: int, world: int, ckpts: dict) -> list[dict]:
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    import axonn

    ids, labels = ec.batch()
    out = []
    for dims, mode, name in [((2, 2, 1, 1), "paired", "llama_tied"), ((1, 2, 2, 1), "easy", "llama"),
                             ((2, 1, 2, 1), "easy", "gpt2"), ((1, 2, 2, 1), "easy", "gpt2")]:
        grid = axonn.ProcessGrid(*dims)
        path = ckpts[name]
        cfg = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        axonn.parallelize(model, grid, mode=mode)
        axonn.load_pretrained(model, path)
        serial = AutoModelForCausalLM.from_pretrained(path).float()
        # every shard equals the slice of the serial weights, rotary buffers were recomputed
        want = dict(serial.named_parameters())
        layouts = axonn.layouts_of(model)
        exact = all(torch.equal(p.detach(), s.local_from_full(want[n].detach()) if (s := layouts.get(n))
                                else want[n].detach()) for n, p in model.named_parameters())
        buffers = dict(serial.named_buffers())
        bufs = all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
        ref = ec.serial_reference(serial, ids, labels)
        r = ec.check_grid(serial, ref, ids, labels, grid, mode, gather=True)
        # the loaded model itself runs like the serial one
        logits = model(input_ids=axonn.shard_batch(ids, grid)).logits
        full = axonn.gather_logits(logits, grid).detach().as_subclass(torch.Tensor)
        run_err = ec.rel(full, axonn.shard_batch(ref["logits"], grid))
        # full_state_dict of the loaded model = the tensors in the file (save_pretrained drops tied keys)
        state = axonn.full_state_dict(model)
        files = sorted(Path(path).glob("*.safetensors"))
        same = True
        for f in files:
            with safe_open(str(f), framework="pt") as fh:
                same &= all(torch.equal(state[k], fh.get_tensor(k)) for k in fh.keys())
        out.append(dict(name=name, dims=dims, exact=exact, bufs=bufs, run_err=run_err, file_equal=same,
                        grad=r["grad"], logits=r["logits"]))
    return out


@pytest.mark.distributed
def test_meta_model_loads_its_shards_exactly(tmp_path: Path) -> None:
    ckpts = {}
    for name, model in [("llama_tied", ec.llama(tied=True, kv_heads=4)), ("llama", ec.llama(tied=False)),
                        ("gpt2", ec.family("gpt2"))]:
        model.save_pretrained(tmp_path / name)
        ckpts[name] = str(tmp_path / name)
    rows = [r for ranks in run_distributed(_load_and_compare, 4, ckpts, timeout=300) for r in ranks]
    for r in rows:
        what = f"{r['name']} {r['dims']}"
        assert r["exact"] and r["bufs"] and r["file_equal"], what
        assert r["run_err"] <= ec.TOL and r["grad"] <= ec.TOL and r["logits"] <= ec.TOL, what


def _rss_kb(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _load_memory(rank: int, world: int, path: str) -> dict:
    import gc

    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    import axonn

    grid = axonn.ProcessGrid(2, 2, 2, 1)
    cfg = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    gc.collect()
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak-RSS mark to the current RSS
    base = _rss_kb("VmRSS")
    axonn.parallelize(model, grid, mode="paired")
    axonn.load_pretrained(model, path)
    peak = _rss_kb("VmHWM")
    local = sum(p.numel() * p.element_size() for p in model.parameters())
    # checked after measuring: every shard equals the slice read by the safetensors library
    with safe_open(str(Path(path) / "model.safetensors"), framework="pt") as fh:
        ok = True
        layouts = axonn.layouts_of(model)
        for name, p in model.named_parameters():
            spec = layouts.get(name)
            if spec is None:
                ok &= torch.equal(p.detach(), fh.get_tensor(name))
            else:
                (r0, r1), (c0, c1) = spec.row_range(), spec.col_range()
                sl = fh.get_slice(name)
                piece = sl[r0:r1, c0:c1] if spec.cols is not None else sl[r0:r1]
                ok &= torch.equal(p.detach()[: r1 - r0], piece)
    return {"peak_delta": (peak - base) * 1024, "local": local, "ok": ok}


@pytest.mark.distributed
def test_loading_peak_memory_is_a_shard_not_the_model(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    save_file({k: torch.randn(s, generator=g) * 0.02 for k, s in shapes.items()},
              str(tmp_path / "model.safetensors"))
    cfg.save_pretrained(tmp_path)
    model_bytes = sum(4 * torch.Size(s).numel() for s in shapes.values())
    res = run_distributed(_load_memory, 8, str(tmp_path), timeout=300)
    overhead = 24 * 2**20  # staging buffer (8 MiB) + one piece in flight + allocator slack
    for r in res:
        assert r["ok"]
        assert r["local"] <= model_bytes / 8 * 1.01
        assert r["peak_delta"] <= model_bytes / 8 + overhead, (r, model_bytes)
    worst = max(r["peak_delta"] for r in res)
    print(f"\nmodel {model_bytes / 2**20:.1f} MiB; per-rank shard {res[0]['local'] / 2**20:.1f} MiB; "
          f"worst per-rank peak while loading {worst / 2**20:.1f} MiB")
