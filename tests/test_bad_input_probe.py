"""The bad inputs of issue 40's probe (item 9): each is one `error: ` line on stderr naming the field,
exit 2, nothing written anywhere (the working folder, which holds every input and --out, hashed before
and after). stderr is captured at the file descriptor, so third-party logging counts as a line too."""
from __future__ import annotations

import json
import shlex

import numpy as np
import pytest
from helpers import TINY, refused, tiny_model, tiny_scan_folder, write_indexed
from test_overwrite_safety import tree
from transformers import LlamaConfig, LlamaForCausalLM

from axonn.config import apply_overrides
from data_pipelines import load_corpus, load_tokenizer
from memorization.cli import main
from memorization.config import load_run_config
from memorization.eval.membership import FIX_SPLIT
from memorize_core import ConfigError

BIG = "1" + "0" * 30


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The tiny scan folder (model of 320 ids, no tokenizer; corpus.bin/.idx), token files with id 400
    in document 35 of 40, and a model folder with a 320-id BPE but fewer embeddings than ids."""
    r = tiny_scan_folder(tmp_path_factory.mktemp("probe"))
    g = np.random.default_rng(0)
    docs = [g.integers(0, 320, size=20).tolist() for _ in range(40)]
    docs[35][2] = 400
    write_indexed(r / "oov", docs, np.uint16)
    np.save(r / "oov.npy", np.array(docs, dtype=np.int32))
    texts = [d.text for d in load_corpus("wiki-leads", limit=30)]
    tok = load_tokenizer("bpe", texts=texts, vocab_size=320, cache_dir=tmp_path_factory.mktemp("tok"))
    # letters and digits the BPE never merged have low ids; common words are its last merges
    lines = ["QZXJKQZXJKQZXJKQZXJK", "9876543210987654321"] * 4 + ["the history of the city and the state"]
    tops = [max(tok(t, add_special_tokens=False)["input_ids"]) for t in lines]
    vocab = max(tops[:-1]) + 1  # the first two batches (4 lines each) fit; the last line does not
    assert tops[-1] >= vocab
    (r / "lines.txt").write_text("\n".join(lines) + "\n")
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    LlamaForCausalLM(cfg).save_pretrained(r / "small-vocab")
    tok.save_pretrained(r / "small-vocab")
    (r / "docs.jsonl").write_text("".join(json.dumps({"text": t, "dup": i + 1}) + "\n"
                                          for i, t in enumerate(texts[:6])))
    (r / "empty").mkdir()
    (r / "tiny.yaml").write_text(TINY)
    tok.save_pretrained(r / "tok")
    return r


@pytest.fixture
def here(root, monkeypatch):
    monkeypatch.chdir(root)  # relative paths (and anything a command writes by mistake) land in root
    return root


def _refused(capfd, root, argv, *needles):
    """main(argv) exits 2 with one `error: ` line holding `needles`, and root is byte for byte unchanged."""
    before = tree(root)
    err = refused(capfd, argv, *needles)
    assert tree(root) == before
    return err


def _scan(data, *extra, model="model", out="out"):
    return ["scan", "--model", model, "--data", data, "--prefix", "6", "--suffix", "6", "--out", out,
            "--no-progress", *extra]


# 1. --data that names no source
@pytest.mark.parametrize("data", ["", " ", ".", "/", "empty", "./empty/"])
def test_data_names_no_source(capfd, here, data):
    _refused(capfd, here, _scan(data), "--data=")


# 2. --offsets with digits int() refuses, or that would be a second spelling of a number
@pytest.mark.parametrize("offsets", ["stride:\u00b2", "random:\u00b3", "stride:\u0661\u0660", "random:\u0663",
                                     "stride:\uff15", "stride:" + "9" * 5000, "stride:1_0", "stride: 5"])
def test_offsets_ascii_digits_only(capfd, here, offsets):
    _refused(capfd, here, _scan("corpus.bin", "--offsets", offsets), "--offsets=")


# 3. an id outside the vocabulary after the first batch: refused before the first part
@pytest.mark.parametrize("data", ["oov.bin", "oov.idx", "oov.npy"])
@pytest.mark.parametrize("limit", [[], ["--limit", "39"]])
def test_out_of_vocabulary_after_first_batch(capfd, here, data, limit):
    _refused(capfd, here, _scan(data, "--batch-size", "4", "--part-rows", "1", *limit), "--data=",
             "token id 400", "vocabulary of 320")


def test_text_beyond_the_models_embeddings(capfd, here):
    """A tokenizer with more ids than the model has embeddings: the windows are cut ahead."""
    _refused(capfd, here, _scan("lines.txt", "--batch-size", "4", "--part-rows", "1", model="small-vocab"),
             "--data=", "outside the model's vocabulary")


# 4. --steps past the bound: refused before OUT (and the W&B run) is written
@pytest.mark.parametrize("flag", ["--steps", "--checkpoint-every"])
def test_train_steps_past_the_bound(capfd, here, flag):
    err = _refused(capfd, here, ["train", "tiny.yaml", flag, BIG, "--out", "run"], f"={BIG}", "1e+09")
    assert "steps" in err or "checkpoint" in err


# 5. --out ''
@pytest.mark.parametrize("out", ["", "  "])
def test_scan_out_empty(capfd, here, out):
    _refused(capfd, here, _scan("corpus.bin", out=out), "--out=")


# 6. --count-key that no line has (or on a source without lines); --dtype against a stated dtype
def test_count_key(capfd, here):
    err = _refused(capfd, here, _scan("docs.jsonl", "--count-key", "copies", model="small-vocab"),
                   "--count-key='copies'", "no line")
    assert "dup, text" in err  # the keys the lines have
    _refused(capfd, here, _scan("corpus.bin", "--count-key", "dup"), "--count-key='dup'", ".jsonl")
    (here / "bad.jsonl").write_text(json.dumps({"text": "a b c", "dup": "three"}) + "\n")
    try:
        _refused(capfd, here, _scan("bad.jsonl", "--count-key", "dup", model="small-vocab"), "--count-key=",
                 "line 1", "'three'")
    finally:
        (here / "bad.jsonl").unlink()


@pytest.mark.parametrize("data,dtype,stored", [
    ("corpus.bin", "int32", "uint16"), ("corpus.idx", "uint8", "uint16"), ("oov.npy", "uint16", "int32")])
def test_dtype_disagreeing_with_the_file(capfd, here, data, dtype, stored):
    _refused(capfd, here, _scan(data, "--dtype", dtype), f"--dtype='{dtype}'", stored)


def test_dtype_agreeing_with_the_index_is_accepted(capfd, here, tmp_path):
    out = tmp_path / "ok"
    assert main(_scan("corpus.bin", "--dtype", "uint16", "--limit", "3", out=str(out))) == 0
    assert (out / "scan-state.json").is_file()


# 7. MemorizationCallback members that are neither texts nor conversations
@pytest.mark.parametrize("members,field", [([1, 2, 3], "members[0]=1"), ([[5, 6, 7]], "members[0]="),
                                           (["a text " * 20, 7], "members[1]=7"),
                                           ([["a", "b"]], "members[0]=")])
def test_callback_members(here, members, field):
    from transformers import AutoTokenizer

    from memorization.integrations.callback import MemorizationCallback

    tok = AutoTokenizer.from_pretrained(here / "tok")
    with pytest.raises(ConfigError) as e:
        MemorizationCallback(tok, members=members, prefix=4, suffix=4)
    assert str(e.value).startswith(field) and "texts" in str(e.value), e.value


# 8. the MIA refusal's fix pastes into a shell: "data.held_out=" is the empty string
def test_mia_fix_is_shell_safe(here):
    fix = FIX_SPLIT[FIX_SPLIT.index("(") + 1:FIX_SPLIT.index(")")]
    overrides = shlex.split(fix)  # what a shell passes on
    assert overrides == ["data.held_out=", "data.held_out_fraction=0.5"]
    cfg = load_run_config(here / "tiny.yaml", overrides)
    assert cfg.data.held_out == "" and cfg.data.held_out_fraction == 0.5
    assert apply_overrides({}, ["a=", "b=''", "c=null"]) == {"a": "", "b": "", "c": None}


# 9. a model of vocab_size 0 (whose special token ids transformers then warns about): only our line
def test_vocab_zero_only_our_line(capfd, here, tmp_path):
    folder = tmp_path / "v0"
    tiny_model().save_pretrained(folder)
    for f in (here / "tok").iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    c = json.loads((folder / "config.json").read_text())
    c.update(vocab_size=0, bos_token_id=1, eos_token_id=2)
    (folder / "config.json").write_text(json.dumps(c))
    _refused(capfd, here, ["eval", "--model", folder, "--corpus", "wiki-leads", "--out", "ev"], "--model=",
             "vocab_size=0")
    _refused(capfd, here, _scan("corpus.bin", model=folder), "--model=", "vocab_size=0")
    _refused(capfd, here, ["train", "tiny.yaml", f"model.name={folder}", "--out", "run"], "error: ")


# 10. an unreachable hf: dataset: one line, at once (no retries logged)
def test_unreachable_hub_one_line(capfd, here, monkeypatch):
    from data_pipelines import corpora

    monkeypatch.setattr(corpora, "hub_reachable", lambda timeout=corpora.HUB_PROBE_S: False)
    _refused(capfd, here, ["train", "tiny.yaml", "data.corpus=hf:nobody/nothing", "--out", "run"],
             "hf:nobody/nothing", "not reachable")
    _refused(capfd, here, _scan("hf:nobody/nothing", model="small-vocab"), "--data=", "not reachable")
