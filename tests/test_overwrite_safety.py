"""`--overwrite` removes only what the command itself writes (memorization/outputs.py): every byte
outside those entries is unchanged (the tree hashed before and after), symlink targets are never
touched, and an --out that is, contains or lies inside the command's own input is refused in one line."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from helpers import TINY, checkpoint_trainer, tiny_model

from memorization.cli import main
from memorization.outputs import LEDGER, check_inputs, remove_entries
from memorize_core import ConfigError


def tree(root: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """relative path -> sha256 of the bytes (a symlink: '-> target'), every entry under root."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if rel.split(os.sep)[0] in skip:
                continue
            if p.is_symlink():
                out[rel] = "-> " + os.readlink(p)
            elif p.is_file():
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                out[rel] = "dir"
    return out


def _refused(capsys, argv, *needles):
    capsys.readouterr()
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, err
    return err


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A sealed checkpoint of a tiny Llama with a tokenizer folder (as memorize train writes one)."""
    root = tmp_path_factory.mktemp("ck")
    checkpoint_trainer(root, checkpoint_every=2, max_steps=2).fit()
    step = root / "step-00000002"
    (step / "tokenizer").mkdir()
    (step / "tokenizer" / "tokenizer_config.json").write_text('{"model_max_length": 64}\n')
    return step


def test_export_overwrite_keeps_everything_it_does_not_write(capsys, tmp_path, ckpt):
    out = tmp_path / "exp"
    (out / "notes").mkdir(parents=True)
    (out / "precious.txt").write_text("mine")
    (out / "notes" / "a.md").write_text("mine too")
    (out / "config.json").write_text("{}")  # a name export writes: replaced
    # a user's sharded model: looks like an export's weights, but no export wrote it: kept
    (out / "model-00001-of-00002.safetensors").write_bytes(b"user shard 1")
    (out / "model-00002-of-00002.safetensors").write_bytes(b"user shard 2")
    (out / "model.safetensors.index.json").write_text("{}")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "w.bin").write_bytes(b"target")
    os.symlink(elsewhere / "w.bin", out / "model.safetensors")  # a link: replaced, its target kept
    before_out, before_else = tree(out), tree(elsewhere)
    assert main(["export", str(ckpt), str(out), "--overwrite"]) == 0
    written = {"config.json", "generation_config.json", "model.safetensors", "tokenizer_config.json",
               LEDGER}
    after = tree(out)
    assert written <= set(after), after
    assert not (out / "model.safetensors").is_symlink()
    keep = {k: v for k, v in before_out.items() if k not in written}
    assert "model-00002-of-00002.safetensors" in keep
    assert {k: after[k] for k in keep} == keep  # every byte outside what export writes is unchanged
    assert set(after) - written == set(keep)  # and nothing else was added (no scratch folder left)
    assert tree(elsewhere) == before_else
    assert (out / "tokenizer_config.json").read_text() == '{"model_max_length": 64}\n'


def test_export_overwrite_removes_an_earlier_exports_files_by_its_ledger(capsys, tmp_path, ckpt):
    out = tmp_path / "exp"
    assert main(["export", str(ckpt), str(out)]) == 0
    (out / "model-00001-of-00002.safetensors").write_bytes(b"an earlier export's shard")
    (out / "mine.txt").write_text("mine")
    ledger = json.loads((out / LEDGER).read_text())
    ledger["entries"].append("model-00001-of-00002.safetensors")  # as a sharded export would record it
    (out / LEDGER).write_text(json.dumps(ledger))
    assert main(["export", str(ckpt), str(out), "--overwrite"]) == 0
    assert not (out / "model-00001-of-00002.safetensors").exists()
    assert (out / "mine.txt").read_text() == "mine"
    assert "model-00001-of-00002.safetensors" not in json.loads((out / LEDGER).read_text())["entries"]


@pytest.mark.parametrize("where,how", [("contains", "contains"), ("is", "is"), ("inside", "lies inside")])
@pytest.mark.parametrize("overwrite", [False, True])
def test_export_refuses_an_out_overlapping_its_checkpoint(capsys, tmp_path, ckpt, where, how, overwrite):
    import shutil

    run = tmp_path / "run"
    step = run / "checkpoints" / ckpt.name
    shutil.copytree(ckpt, step)
    (run / "metrics.jsonl").write_text("{}\n")
    out = {"contains": run, "is": step, "inside": step / "exported"}[where]
    before = tree(run)
    _refused(capsys, ["export", step, out] + (["--overwrite"] if overwrite else []), how,
             "the input checkpoint=")
    assert tree(run) == before


def test_train_overwrite_with_a_symlinked_model_folder(capsys, tmp_path):
    cfg = tmp_path / "t.yaml"
    cfg.write_text(TINY)
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (elsewhere / "weights.bin").write_bytes(b"someone else's")
    (out / "run.json").write_text("{}")
    (out / "keep.txt").write_text("mine")
    os.symlink(elsewhere, out / "model")
    before = tree(elsewhere)
    assert main(["train", str(cfg), "--out", str(out), "--overwrite"]) == 0
    assert tree(elsewhere) == before  # the link's target is untouched
    assert (out / "model").is_dir() and not (out / "model").is_symlink()
    assert (out / "model" / "config.json").is_file() and (out / "keep.txt").read_text() == "mine"


def test_train_refuses_an_out_whose_result_entry_holds_its_corpus(capsys, tmp_path):
    cfg = tmp_path / "t.yaml"
    cfg.write_text(TINY)
    out = tmp_path / "out"
    (out / "model").mkdir(parents=True)
    corpus = out / "model" / "docs.txt"
    corpus.write_text("a document\n" * 20)
    before = tree(out)
    _refused(capsys, ["train", cfg, "--out", out, "--overwrite", f"data.corpus={corpus}"],
             "--out=", "contains the input data.corpus=")
    assert tree(out) == before


def test_eval_refuses_writing_into_its_model_folder(capsys, tmp_path):
    model = tmp_path / "m"
    tiny_model().save_pretrained(model)
    (tmp_path / "c.txt").write_text("x\n")
    before = tree(model)
    _refused(capsys, ["eval", "--model", model, "--corpus", tmp_path / "c.txt", "--out", model],
             "is the input --model")
    _refused(capsys, ["eval", "--model", model, "--corpus", tmp_path / "c.txt", "--out", model / "r"],
             "lies inside the input --model")
    assert tree(model) == before


def test_remove_entries_removes_only_named_entries_and_links_not_targets(tmp_path):
    out, target = tmp_path / "out", tmp_path / "target"
    target.mkdir()
    (target / "f").write_text("x")
    (out / "runs" / "a").mkdir(parents=True)
    (out / "other").write_text("keep")
    os.symlink(target, out / "model")
    os.symlink(tmp_path / "nowhere", out / "dangling")
    assert remove_entries(out, ["runs", "model", "dangling", "absent"]) == ["runs", "model", "dangling"]
    assert sorted(p.name for p in out.iterdir()) == ["other"] and (target / "f").read_text() == "x"
    for bad in ("..", "../x", "", ".hidden", "a/b"):
        with pytest.raises(ConfigError, match="plain file name"):
            remove_entries(out, [bad])
    assert (out / "other").read_text() == "keep"


def test_check_inputs_rules(tmp_path):
    out, src = tmp_path / "out", tmp_path / "out" / "model" / "c.txt"
    src.parent.mkdir(parents=True)
    src.write_text("x")
    check_inputs("--out", out, {"corpus": tmp_path / "out" / "notes.txt"})  # absent: skipped
    check_inputs("--out", out, {"corpus": None})
    (out / "mine.txt").write_text("x")
    check_inputs("--out", out, {"corpus": out / "mine.txt"}, entries=["model"])  # not an entry it writes
    with pytest.raises(ConfigError, match="contains the input corpus"):
        check_inputs("--out", out, {"corpus": src}, entries=["model"])
    with pytest.raises(ConfigError, match="contains the input corpus"):
        check_inputs("--out", out, {"corpus": out / "mine.txt"})  # the whole of OUT is the command's
    with pytest.raises(ConfigError, match="lies inside the input d"):
        check_inputs("--out", src.parent / "x", {"d": src.parent}, entries=["model"])


def test_experiment_writes_nothing_until_checked_and_overwrite_removes_only_its_own(tmp_path):
    from memorization.experiments.runner import Experiment

    out, target = tmp_path / "exp", tmp_path / "target"
    Experiment(out, overwrite=True).open()
    assert not out.exists()  # a refusal in the sub-run checks leaves no empty OUT/runs tree
    (out / "runs" / "old").mkdir(parents=True)
    target.mkdir()
    (target / "f").write_text("x")
    os.symlink(target, out / "runs" / "linked")
    for name in ("report.json", "report.md", "plot.png", "notes.txt"):
        (out / name).write_text(name)
    exp = Experiment(out, overwrite=True).open()
    exp.prepare_out()
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "runs"]
    assert list((out / "runs").iterdir()) == [] and (target / "f").read_text() == "x"


def test_prepare_corpus_overwrite_never_replaces_its_input(capsys, tmp_path):
    import importlib.util

    script = Path(__file__).resolve().parents[1] / "scripts" / "prepare_corpus.py"
    spec = importlib.util.spec_from_file_location("prepare_corpus_27", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "hello world"}\n')
    before = tree(tmp_path)
    assert module.main([str(src), "--out", str(src), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "is the input inputs[0]=" in err, err
    assert tree(tmp_path) == before
