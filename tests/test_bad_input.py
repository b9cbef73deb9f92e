"""The bad inputs of issue 27's probe: exit 2, one stderr line naming the field, no traceback, nothing
written (OUT not created). Each case is the exact command shape with its files made in tmp."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import TINY, tiny_model

from memorization import outputs
from memorization.cli import main
from memorize_core import ConfigError

ROOT = Path(__file__).resolve().parents[1]
BIG = "100000000000000000000"  # 1e20 as an integer literal


def _refused(capsys, argv, *needles):
    capsys.readouterr()
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.endswith("\n") and len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, err
    return err.strip()


@pytest.fixture
def cfg(tmp_path):
    p = tmp_path / "tiny.yaml"
    p.write_text(TINY)
    return p


NUMBERS = [  # non-finite or absurd numbers: refused when the config is read
    ("trainer.lr=.nan", "trainer.lr", "finite"), ("trainer.lr=.inf", "trainer.lr", "finite"),
    ("trainer.lr=1e400", "trainer.lr", "finite"), ("trainer.lr=-.inf", "trainer.lr", "finite"),
    ("trainer.beta1=1", "trainer.beta1", "[0, 1)"), ("trainer.beta2=-0.1", "trainer.beta2", "[0, 1)"),
    ("trainer.beta2=.nan", "trainer.beta2", "finite"),
    ("trainer.weight_decay=.nan", "trainer.weight_decay", "finite"),
    ("trainer.weight_decay=-1", "trainer.weight_decay", ">= 0"),
    ("trainer.grad_clip=.inf", "trainer.grad_clip", "finite"),
    ("trainer.min_lr_ratio=.nan", "trainer.min_lr_ratio", "finite"),
    ("trainer.collective_timeout_s=.inf", "trainer.collective_timeout_s", "finite"),
    (f"trainer.warmup_steps={BIG}", "trainer.warmup_steps", "1e+09"),
    (f"trainer.max_steps={BIG}", "trainer.max_steps", "1e+09"),
    (f"trainer.epochs={BIG}", "trainer.epochs", "1e+09"),
    (f"trainer.checkpoint_every={BIG}", "trainer.checkpoint_every", "1e+09"),
    (f"trainer.batch_size={BIG}", "trainer.batch_size", "2147483648"),
    (f"trainer.seed={BIG}", "trainer.seed", "2**63"), (f"seed={BIG}", "seed", "2**63"),
    ("seed=-1", "seed", "2**63"),
    (f"data.block_len={BIG}", "data.block_len", "2**24"),
    (f"data.vocab_size={BIG}", "data.vocab_size", "2**24"),
    ("data.limit=.nan", "data.limit", "integer"),
    ("data.held_out_fraction=.nan", "data.held_out_fraction", "[0, 1)"),
    ("eval.mia_k=.nan", "eval.mia_k", "(0, 1]"),
    (f"goldfish.h={BIG}", "goldfish.h", "2**20"), (f"goldfish.k={BIG}", "goldfish.k", "2**62"),
    ("trainer.dp.target_epsilon=1e12", "trainer.dp.target_epsilon", "<= 100"),
    ("trainer.dp.target_epsilon=.nan", "trainer.dp.target_epsilon", "> 0"),
    ("trainer.dp.delta=.nan", "trainer.dp.delta", "(0, 1)"),
    ("trainer.dp.noise_multiplier=.inf", "trainer.dp.noise_multiplier", ">= 0"),
    ("model.overrides.num_hidden_layers=1000000000", "model.name", "num_hidden_layers=1000000000"),
    ("model.overrides.num_hidden_layers=0", "model.name", "num_hidden_layers=0"),
    ("tr\u0430iner.lr=1e-3", "tr\u0430iner", "unknown key"),  # Cyrillic a
    ("trainer.\u200blr=1e-3", "trainer.\u200blr", "unknown key"),  # zero-width space
    ("trainer.lr\uff1d1e-3", "unrecognized arguments", "trainer.lr"),  # full-width '='
]


@pytest.mark.parametrize("override,field,why", NUMBERS)
def test_bad_numbers_and_keys(capsys, tmp_path, cfg, override, field, why):
    out = tmp_path / "out"
    _refused(capsys, ["train", cfg, "--out", out, override], field, why)
    assert not out.exists()


NAMES = ["..", ".", "", ".hidden", "a/b", "../escape", " padded"]


@pytest.mark.parametrize("name", NAMES)
def test_run_names_are_plain_file_names(capsys, tmp_path, cfg, name):
    out = tmp_path / "out"
    _refused(capsys, ["train", cfg, "--out", out, f"name={json.dumps(name)}"], "name=", "plain file name")
    assert not out.exists()


@pytest.mark.parametrize("argv,field", [
    (["configs/experiments/catastrophic-llama.yaml", "--dry-run", "--world", "8",
      'sizes=[{name: "..", model: llama-8b}]'], "sizes[0].name"),
    (["configs/experiments/mitigations.yaml", "--dry-run", "--world", "1",
      'arms=[{name: "..", mitigation: none}]'], "arms[0].name"),
    (["configs/experiments/goldfish-sweep.yaml", "--dry-run", "--world", "1", "name=../up"], "name="),
])
def test_experiment_names_are_plain_file_names(capsys, argv, field):
    _refused(capsys, ["run", *argv], field, "plain file name")


@pytest.mark.parametrize("patch,why", [
    ("access", "permission denied"), ("rdonly", "read-only file system"), ("full", "no space left"),
])
def test_unwritable_out_is_found_before_any_work(capsys, monkeypatch, tmp_path, cfg, patch, why):
    # root (this CI) may write anywhere, so the three conditions are simulated where the check reads them
    real = os.statvfs(tmp_path)

    class Full:
        f_flag = real.f_flag | (os.ST_RDONLY if patch == "rdonly" else 0)
        f_bavail = 0 if patch == "full" else real.f_bavail

    if patch == "access":
        monkeypatch.setattr(outputs.os, "access", lambda *a, **k: False)
    else:
        monkeypatch.setattr(outputs.os, "statvfs", lambda p: Full)
    out = tmp_path / "ro" / "out"
    _refused(capsys, ["train", cfg, "--out", out], "--out=", why)
    tiny_model().save_pretrained(tmp_path / "m")
    (tmp_path / "c.txt").write_text("x\n")
    _refused(capsys, ["eval", "--model", tmp_path / "m", "--corpus", tmp_path / "c.txt", "--out", out],
             "--out=", why)
    assert not (tmp_path / "ro").exists()


def test_out_under_a_file(capsys, tmp_path, cfg):
    _refused(capsys, ["train", cfg, "--out", tmp_path / "tiny.yaml" / "sub"], "is not a directory")
    _refused(capsys, ["run", "configs/experiments/goldfish-sweep.yaml", "--out", cfg], "is not a directory")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through any permission")
def test_out_in_a_folder_without_write_permission(capsys, tmp_path, cfg):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    _refused(capsys, ["train", cfg, "--out", locked / "out"], "permission denied")


def _model(tmp_path, name, **config):
    folder = tmp_path / name
    tiny_model().save_pretrained(folder)
    c = json.loads((folder / "config.json").read_text())
    c.update(config)
    (folder / "config.json").write_text(json.dumps(c))
    return folder


@pytest.mark.parametrize("config,needles", [
    ({"num_hidden_layers": 10**9}, ["num_hidden_layers=1000000000", "no model that deep"]),
    ({"vocab_size": 0}, ["vocab_size=0", ">= 1"]),
    ({"hidden_size": 65536, "intermediate_size": 262144, "num_hidden_layers": 200},
     ["GiB per process", "this machine's"]),
])
def test_eval_refuses_shapes_before_building(capsys, tmp_path, config, needles):
    model = _model(tmp_path, "m", **config)
    (tmp_path / "c.txt").write_text("x\n")
    _refused(capsys, ["eval", "--model", model, "--corpus", tmp_path / "c.txt"], "--model=", *needles)


@pytest.mark.parametrize("value", ["99999", "101"])
def test_num_fewshot_bound(capsys, tmp_path, value):
    _refused(capsys, ["eval", "--model", tmp_path, "--tasks", "x", "--num-fewshot", value], "--num-fewshot",
             "<= 100")


def test_eval_batch_size_bound(capsys, tmp_path):
    _refused(capsys, ["eval", "--model", tmp_path, "--corpus", "x", "--batch-size", BIG], "--batch-size")


@pytest.fixture
def files(tmp_path):
    (tmp_path / "folder").mkdir()
    os.symlink(tmp_path / "loop.txt", tmp_path / "loop.txt")
    os.symlink(tmp_path / "loop.yaml", tmp_path / "loop.yaml")
    (tmp_path / "latin1.txt").write_bytes(("caf\xe9 r\xe9sum\xe9 " * 30 + "\n").encode("latin-1") * 5)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("\n\n  \n")
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text('{"version": "1.0", "trunc')
    return tmp_path


@pytest.mark.parametrize("args,needles", [
    (["CFG", "data.corpus=T/loop.txt"], ["data.corpus=", "symlink loop"]),
    (["CFG", "data.corpus=T/folder"], ["corpus=", "no non-empty documents"]),
    (["CFG", "data.corpus=T/latin1.txt", "data.min_tokens=1"], ["corpus=", "not UTF-8"]),
    (["CFG", "data.corpus=T/empty.txt"], ["corpus=", "no non-empty documents"]),
    (["CFG", "data.corpus=T/blank.txt"], ["corpus=", "no non-empty documents"]),
    (["CFG", "data.tokenizer=T/tok"], ["tokenizer=", "could not load a tokenizer"]),
    (["T/folder"], ["config=", "no such file"]),
    (["T/loop.yaml"], ["config=", "no such file"]),
])
def test_bad_files(capsys, files, cfg, args, needles):
    out = files / "out"
    argv = [a.replace("T/", f"{files}/") if a != "CFG" else str(cfg) for a in args]
    _refused(capsys, ["train", *argv, "--out", out], *needles)
    assert not out.exists()


def test_only_the_main_rank_prints_a_refusal(capsys, monkeypatch, tmp_path, cfg):
    argv = ["train", str(cfg), "--out", str(tmp_path / "o"), "trainer.lr=.nan"]
    for rank, printed in (("1", ""), ("0", "error: trainer.lr=nan: must be a finite number\n")):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        assert main(argv) == 2
        assert capsys.readouterr().err == printed


def test_check_name_accepts_plain_names():
    for ok in ("arm-1", "llama-8b", "dp-eps8", "a.b", "x_y"):
        assert outputs.check_name("n", ok) == ok
    with pytest.raises(ConfigError):
        outputs.check_name("n", 3)


def test_stderr_to_takes_what_subprocesses_and_logging_write(tmp_path, capfd):
    import logging

    from memorization.eval.utility import stderr_to

    log = tmp_path / "lm-eval.log"
    with stderr_to(log):
        subprocess.run([sys.executable, "-c", "import sys; sys.stderr.write('fatal: not a git repo\\n')"])
        logging.StreamHandler(sys.__stderr__).emit(logging.makeLogRecord({"msg": "lm-eval says"}))
    assert "fatal: not a git repo" in log.read_text() and "lm-eval says" in log.read_text()
    assert capfd.readouterr().err == ""
    print("after", file=sys.stderr)  # the descriptor is back
    assert capfd.readouterr().err == "after\n"


def test_eval_tasks_log_goes_beside_the_report(tmp_path, capfd):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(["the capital of france is paris"] * 5,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    model = tmp_path / "m"
    tiny_model(vocab=300).save_pretrained(model)
    fast.save_pretrained(model)
    capfd.readouterr()
    assert main(["eval", "--model", str(model), "--tasks", "analogies_family", "--limit", "2",
                 "--out", str(tmp_path / "ev")]) == 0
    assert capfd.readouterr().err == ""  # lm-eval's lines, bars and its git call: all in the log
    assert (tmp_path / "ev" / "lm-eval.log").read_text().strip()
    assert json.loads((tmp_path / "ev" / "report.json").read_text())["tasks_log"].endswith("lm-eval.log")


@pytest.mark.parametrize("response", ["", "   \n"])
def test_empty_chat_response_is_refused_before_a_tokenizer_is_cached(capsys, monkeypatch, tmp_path, cfg,
                                                                        response):
    monkeypatch.setenv("MEMORIZE_CACHE", str(tmp_path / "cache"))
    chat = tmp_path / "chat.jsonl"
    chat.write_text("\n".join(json.dumps({"prompt": f"question {i}?", "response": response if i == 3 else
                                          f"answer number {i}"}) for i in range(6)) + "\n")
    out = tmp_path / "out"
    _refused(capsys, ["train", cfg, "--out", out, f"data.corpus={chat}", "data.format=chat"],
             "chat.jsonl/4.response", "empty")
    assert not out.exists() and not (tmp_path / "cache").exists()


def test_resuming_a_plain_checkpoint_with_lora_is_one_line(capsys, tmp_path, cfg):
    from helpers import checkpoint_trainer

    checkpoint_trainer(tmp_path / "ck", checkpoint_every=2, max_steps=2).fit()
    out = tmp_path / "out"
    # a real process: pytest records warnings itself, so only a subprocess shows what a user sees
    done = subprocess.run([sys.executable, "-m", "memorization", "train", str(cfg), "--out", str(out),
                           "--resume", str(tmp_path / "ck" / "step-00000002"), "model.lora.enabled=true"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith("error: --resume="), done.stderr
    assert not out.exists()
