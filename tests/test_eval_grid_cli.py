"""`memorize eval --grid`: sharded equals serial under torchrun; bad grids, truncated weights and chat
corpora are one line, exit 2, nothing written (before any process group)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from axonn.spawn import free_port
from data_pipelines import load_tokenizer
from memorization.cli import main

TEXTS = [f"the {w} of the {v} is near the {u} again" for w in ("river", "stone", "light", "north")
         for v in ("garden", "window", "market") for u in ("harbor", "forest", "valley")]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A model folder (4 heads, 2 KV heads, its tokenizer), its twin with vocab 302, text corpora."""
    root = tmp_path_factory.mktemp("grid-eval")
    tok = load_tokenizer("bpe", texts=TEXTS, vocab_size=300, cache_dir=root / "cache")
    for name, vocab in (("model", len(tok)), ("odd-vocab", 302)):
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          initializer_range=0.2)
        LlamaForCausalLM(cfg).save_pretrained(root / name)
        tok.save_pretrained(root / name)
    (root / "members.txt").write_text("\n".join(TEXTS[:18]) + "\n")
    (root / "nonmembers.txt").write_text("\n".join(TEXTS[18:]) + "\n")
    (root / "chat.jsonl").write_text(json.dumps({"prompt": "hi", "response": "hello there"}) + "\n")
    (root / "keys.jsonl").write_text(json.dumps({"body": "a plain document"}) + "\n")
    return root


def _refused(capsys, argv, *needles) -> None:
    capsys.readouterr()
    assert main(["eval", *map(str, argv)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    for n in needles:
        assert n in err, (n, err)


@pytest.mark.parametrize("grid,world,needles", [
    ("1,2,1,1", None, ["--grid='1,2,1,1'", "job has 1 process(es)", "torchrun --nproc-per-node 2"]),
    ("1,3,1,1", 3, ["grid.y=3"]),                    # 4 heads, 2 KV heads
    ("1,4,1,1", 4, ["grid.y=4"]),                    # 2 KV heads
    ("1,2,1", 2, ["--grid"]),                         # not X,Y,Z,D
])
def test_bad_grids_are_refused_before_any_process_group(folders, tmp_path, capsys, monkeypatch, grid,
                                                        world, needles):
    if world:  # what torchrun would set; nothing is launched, no process group is made
        monkeypatch.setenv("WORLD_SIZE", str(world))
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
    _refused(capsys, ["--model", folders / "model", "--perplexity", folders / "members.txt", "--grid", grid,
                      "--out", tmp_path / "out"], *needles)
    assert not (tmp_path / "out").exists()
    assert not torch.distributed.is_initialized()


def test_a_vocabulary_the_grid_does_not_divide(folders, tmp_path, capsys, monkeypatch):
    for k, v in (("WORLD_SIZE", "4"), ("RANK", "0"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(k, v)
    _refused(capsys, ["--model", folders / "odd-vocab", "--perplexity", folders / "members.txt",
                      "--grid", "1,4,1,1", "--mode", "easy", "--out", tmp_path / "out"], "grid.y=4", "302")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag", ["--model", "--reference"])
def test_truncated_weights_are_one_line(folders, tmp_path, capsys, flag):
    bad = tmp_path / "truncated"
    bad.mkdir()
    for f in (folders / "model").iterdir():
        data = f.read_bytes()
        (bad / f.name).write_bytes(data[:len(data) // 2] if f.name == "model.safetensors" else data)
    model, ref = (bad, folders / "model") if flag == "--model" else (folders / "model", bad)
    _refused(capsys, ["--model", model, "--mia", "--members", folders / "members.txt", "--non-members",
                      folders / "nonmembers.txt", "--reference", ref, "--out", tmp_path / "out"],
             f"{flag}=", "cannot be loaded as a causal LM", "complete weights")
    assert not (tmp_path / "out").exists()


def test_corpora_eval_cannot_read_name_its_own_flags(folders, tmp_path, capsys):
    _refused(capsys, ["--model", folders / "model", "--corpus", folders / "chat.jsonl",
                      "--out", tmp_path / "o"], "--corpus=", "holds conversations", "plain documents")
    _refused(capsys, ["--model", folders / "model", "--perplexity", folders / "keys.jsonl"],
             "--perplexity:", "'text' key")
    assert "set text_field" not in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.distributed
def test_eval_under_torchrun_writes_what_serial_writes(folders, tmp_path, capsys):
    """4 ranks at 1,2,1,2 (paired: heads and vocab over Y, batch over data), the reference sharded too:
    the same extraction.jsonl, AUCs and perplexity as the serial command."""
    args = ["--model", folders / "model", "--corpus", folders / "members.txt", "--prefix", 4, "--suffix", 4,
            "--mia", "--members", folders / "members.txt", "--non-members", folders / "nonmembers.txt",
            "--reference", folders / "model", "--bootstrap", 50,
            "--perplexity", folders / "nonmembers.txt", "--batch-size", 3]
    assert main(["eval", *map(str, args), "--out", str(tmp_path / "serial")]) == 0
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                           "--master-port", str(free_port()), "-m", "memorization", "eval", *map(str, args),
                           "--grid", "1,2,1,2", "--out", str(tmp_path / "grid")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    serial = json.loads((tmp_path / "serial" / "report.json").read_text())
    grid = json.loads((tmp_path / "grid" / "report.json").read_text())
    assert grid["grid"] == "1,2,1,2" and grid["mode"] == "paired"
    assert (tmp_path / "grid" / "extraction.jsonl").read_text() == \
        (tmp_path / "serial" / "extraction.jsonl").read_text()
    for m, rec in serial["mia"]["methods"].items():
        assert grid["mia"]["methods"][m] == rec, m
    assert grid["perplexity"][0]["loss"] == pytest.approx(serial["perplexity"][0]["loss"], rel=1e-5)
    assert done.stdout.count('{\n  "model": ') == 1  # only the main rank prints the report


@pytest.mark.distributed
def test_static_decode_on_replicas_merges_every_shards_log(folders, tmp_path):
    """2 replicas (1,1,1,2) decoding through the static path (what a GPU evaluation of a replica grid
    takes): the serial KV decoder's extraction.jsonl, and the report's decode log counts both shards' rows."""
    args = ["--model", folders / "model", "--corpus", folders / "members.txt", "--prefix", 4, "--suffix", 4,
            "--batch-size", 3, "--sampling", ""]
    assert main(["eval", *map(str, args), "--decode", "kv", "--out", str(tmp_path / "serial")]) == 0
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), "-m", "memorization", "eval", *map(str, args),
                           "--grid", "1,1,1,2", "--decode", "static", "--out", str(tmp_path / "grid")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "grid" / "extraction.jsonl").read_text() == \
        (tmp_path / "serial" / "extraction.jsonl").read_text()
    ex = json.loads((tmp_path / "grid" / "report.json").read_text())["extraction"]
    assert ex["decode"]["path"] == "static" and ex["decode"]["rows"] == ex["decode"]["checked"] == ex["docs"]


def test_grid_auto_asks_the_planner_for_a_grid_that_fits_the_model(folders):
    from transformers import AutoConfig

    from axonn.grid import validate_grid_for_model
    from memorization.train.parallel import Launch, detect_hardware, plan_inference

    config = AutoConfig.from_pretrained(folders / "model")
    for world in (1, 2, 4):
        plan = plan_inference(config, spec="auto", model=str(folders / "model"), batch=16, width=64,
                              mode="paired", launch=Launch(world, world, detect_hardware()))
        dims = plan.dims
        assert dims[0] * dims[1] * dims[2] * dims[3] == world and plan.distributed == (world > 1)
        validate_grid_for_model(dims, config, "paired")
