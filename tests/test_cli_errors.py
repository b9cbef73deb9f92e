"""Bad input anywhere in `memorize` -> exit 2, one line on stderr naming the field, nothing written."""
from __future__ import annotations

import pytest
from helpers import TINY, checkpoint_trainer, tiny_model

from memorization.cli import main


@pytest.fixture
def cfg(tmp_path):
    p = tmp_path / "tiny.yaml"
    p.write_text(TINY)
    return p


def _refused(capsys, argv, *needles, strict=True):
    capsys.readouterr()
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    if not strict:  # third-party progress bars / logging may precede our line; ours is the last
        err = err.splitlines()[-1]
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    for n in needles:
        assert n in err, err
    return err


OVERRIDES = [
    (["trainer.bogus=1"], "trainer.bogus"),
    (["trainer.lr=abc"], "trainer.lr"),
    (["trainer.batch_size=0"], "trainer.batch_size"),
    (["trainer.checkpoint_every=-1"], "trainer.checkpoint_every"),
    (["trainer.max_bad_steps=0"], "trainer.max_bad_steps"),
    (["trainer.collective_timeout_s=0"], "trainer.collective_timeout_s"),
    (["goldfish.k=1"], "goldfish.k"),
    (["goldfish.h=0", "goldfish.enabled=true"], "goldfish.h"),
    (["data.corpus=nope"], "corpus"),
    (["model.name=nope"], "model.name"),
    (["trainer"], "unrecognized arguments: trainer"),
    (["trainer.lr.x=1"], "trainer.lr"),
]


@pytest.mark.parametrize("overrides,field", OVERRIDES)
def test_bad_overrides(capsys, tmp_path, cfg, overrides, field):
    out = tmp_path / "out"
    _refused(capsys, ["train", cfg, "--out", out, *overrides], field)
    assert not out.exists()


@pytest.mark.parametrize("flags,field", [
    (["--steps", "0"], "--steps"), (["--checkpoint-every", "0"], "--checkpoint-every"),
    (["--checkpoint-every", "x"], "--checkpoint-every"), (["--grid", "2,2"], "grid"),
    (["--grid", "2,1,1,1"], "--grid"), (["--bogus"], "--bogus"),
    (["--resume", "auto", "--overwrite"], "--resume"),
])
def test_bad_flags(capsys, tmp_path, cfg, flags, field):
    out = tmp_path / "out"
    _refused(capsys, ["train", cfg, "--out", out, *flags], field)
    assert not out.exists()


def test_missing_and_malformed_config(capsys, tmp_path):
    out = tmp_path / "out"
    _refused(capsys, ["train", tmp_path / "nope.yaml", "--out", out], "config", "no such file")
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: {lr: [1,\n")
    _refused(capsys, ["train", bad, "--out", out], "config", "not valid YAML")
    bad.write_text("- a\n- b\n")
    _refused(capsys, ["train", bad, "--out", out], "config", "mapping")
    assert not out.exists()


def test_existing_results_are_refused(capsys, tmp_path, cfg):
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text("{}\n")
    _refused(capsys, ["train", cfg, "--out", out], "--out", "--overwrite")
    assert [p.name for p in out.iterdir()] == ["metrics.jsonl"]


def _checkpoint(root):

    t = checkpoint_trainer(root, checkpoint_every=2, max_steps=2)
    t.fit()
    return root / "step-00000002"


def test_bad_resume_paths(capsys, tmp_path, cfg):
    out = tmp_path / "out"
    _refused(capsys, ["train", cfg, "--out", out, "--resume", tmp_path / "none"], "no such checkpoint")
    ck = _checkpoint(tmp_path / "ck")
    (ck / "COMPLETE").unlink()
    _refused(capsys, ["train", cfg, "--out", out, "--resume", ck], "incomplete checkpoint")
    (ck / "COMPLETE").write_text("2\n")
    shard = ck / "rank-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-7])
    _refused(capsys, ["train", cfg, "--out", out, "--resume", ck], "sha256", "rank-00000.safetensors")
    _refused(capsys, ["export", ck, out], "sha256")
    assert not out.exists()


def test_resume_from_another_model_is_refused(capsys, tmp_path, cfg):
    out = tmp_path / "out"
    ck = _checkpoint(tmp_path / "ck")  # vocab 64; this config trains a 300-id tokenizer
    _refused(capsys, ["train", cfg, "--out", out, "--resume", ck], "--resume", "vocab_size")
    assert not out.exists()


def test_tokenizer_larger_than_model_vocab(capsys, tmp_path, cfg):
    tiny_model(vocab=64).save_pretrained(tmp_path / "m")
    out = tmp_path / "out"
    # a corpus BPE is refused for a pretrained model before it is trained (as the dry run refuses it)
    _refused(capsys, ["train", cfg, "--out", out, f"model.name={tmp_path / 'm'}", "data.tokenizer=bpe"],
             "data.tokenizer", "never matches", strict=False)
    assert not out.exists()


def test_auto_tokenizer_for_a_folder_without_one(capsys, tmp_path, cfg):
    tiny_model(vocab=64).save_pretrained(tmp_path / "m")
    out = tmp_path / "out"
    _refused(capsys, ["train", cfg, "--out", out, f"model.name={tmp_path / 'm'}"], "data.tokenizer", "auto",
             "no tokenizer files", strict=False)
    assert not out.exists()


def test_export_refuses_non_empty_out(capsys, tmp_path):
    ck = _checkpoint(tmp_path / "ck")
    out = tmp_path / "out"
    out.mkdir()
    (out / "x").write_text("keep")
    _refused(capsys, ["export", ck, out], "out", "--overwrite")
    assert (out / "x").read_text() == "keep"
