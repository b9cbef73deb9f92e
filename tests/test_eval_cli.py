"""`memorize eval` on a saved HF folder: extraction, membership inference with CIs, perplexity, bad input."""
from __future__ import annotations

import json
import random

import pytest
import torch
from helpers import refused
from sklearn.metrics import roc_auc_score
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from data_pipelines import load_corpus, load_tokenizer, tokenize_documents
from evals.mia import membership_inference
from evals.perplexity import corpus_loss, mean_loss
from memorization.cli import main
from memorization.eval.plots import PANEL_PX

WORDS = ["river", "stone", "light", "quiet", "north", "garden", "paper", "window", "market", "silver",
         "morning", "engine", "letter", "harbor", "winter", "copper", "signal", "forest", "candle", "orbit",
         "valley", "thunder", "mirror", "lantern"]


def _texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 30))) for _ in range(n)]


def _save(folder, tok, vocab: int, seed: int) -> None:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny model + tokenizer folder, a reference model, and three disjoint corpus files."""
    root = tmp_path_factory.mktemp("eval")
    texts = _texts(60, seed=0)
    tok = load_tokenizer("bpe", texts=texts + [" ".join(WORDS)], vocab_size=300, cache_dir=root / "cache")
    _save(root / "model", tok, len(tok), seed=0)
    _save(root / "ref", tok, len(tok), seed=1)
    for name, lines in (("members", texts[:20]), ("nonmembers", texts[20:40]), ("heldout", texts[40:])):
        (root / f"{name}.txt").write_text("\n".join(lines) + "\n")
    return root


def _run(capsys, *argv) -> dict:
    capsys.readouterr()
    assert main([str(a) for a in ["eval", *argv]]) == 0
    return json.loads(capsys.readouterr().out)


def _model_and_tok(folder):
    return AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


def test_perplexity_equals_mean_token_nll_from_logits(setup, capsys):
    report = _run(capsys, "--model", setup / "model", "--perplexity", setup / "heldout.txt",
                  "--max-tokens", 12)
    (ppl,) = report["perplexity"]
    model, tok = _model_and_tok(setup / "model")
    nll, n_tok, docs = 0.0, 0, 0
    for line in (setup / "heldout.txt").read_text().splitlines():
        ids = tok(line, add_special_tokens=False)["input_ids"][:12]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].double(), -1)
        nll -= float(logp.gather(-1, torch.tensor(ids[1:])[:, None]).sum())
        n_tok, docs = n_tok + len(ids), docs + 1
    assert (ppl["docs"], ppl["tokens"], ppl["scored_tokens"]) == (docs, n_tok, n_tok - docs)
    assert ppl["loss"] == pytest.approx(nll / (n_tok - docs), rel=1e-5)
    assert ppl["perplexity"] == pytest.approx(torch.tensor(nll / (n_tok - docs)).exp().item(), rel=1e-5)
    assert report["max_tokens"] == 12 and "mia" not in report and "extraction" not in report


def test_corpus_loss_equals_mean_loss_on_padded_rows(setup):
    model, _ = _model_and_tok(setup / "model")
    seqs = [[5, 9, 2, 7], [3, 3], [8, 1, 4, 4, 6, 2]]
    rows = torch.zeros(3, 6, dtype=torch.long)
    labels = torch.full((3, 6), -100)
    for i, s in enumerate(seqs):
        rows[i, :len(s)] = labels[i, :len(s)] = torch.tensor(s)
    got = corpus_loss(model, seqs, batch_size=2)
    assert got["loss"] == pytest.approx(mean_loss(model, rows, labels), rel=1e-6)
    assert (got["docs"], got["tokens"], got["scored_tokens"]) == (3, 12, 9)


def test_mia_equals_membership_inference(setup, capsys):
    report = _run(capsys, "--model", setup / "model", "--mia", "--members", setup / "members.txt",
                  "--non-members", setup / "nonmembers.txt", "--reference", setup / "ref",
                  "--mia-k", 0.3, "--bootstrap", 200, "--seed", 5, "--max-tokens", 16)
    mia = report["mia"]
    model, tok = _model_and_tok(setup / "model")
    ref, _ = _model_and_tok(setup / "ref")
    seqs = [tokenize_documents(load_corpus(str(setup / f"{n}.txt")), tok, max_tokens=16, min_tokens=2)
            for n in ("members", "nonmembers")]
    want = membership_inference(model, seqs[0], seqs[1], tokenizer=tok, ref_model=ref, k=0.3,
                                bootstrap=200, seed=5)
    assert set(mia["methods"]) == {"loss", "zlib", "min_k", "min_k_plus_plus", "ref_ratio"}
    for method, metrics in want.items():
        assert set(mia["methods"][method]) == set(metrics), method
        for key, value in metrics.items():  # key by key: pytest >= 9.2 refuses approx of nested values
            assert mia["methods"][method][key] == pytest.approx(value), (method, key)
        for key in ("auc", "tpr_at_1pct_fpr"):
            lo, hi = mia["methods"][method][f"{key}_ci"]
            assert lo <= metrics[key] <= hi, (method, key)
    assert mia["counts"]["members"] == len(seqs[0]) and mia["counts"]["non_members"] == len(seqs[1])


def test_out_holds_exactly_the_report_and_refuses_to_overwrite(setup, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--model", setup / "model", "--corpus", setup / "members.txt", "--prefix", 4, "--suffix", 4,
            "--mia", "--members", setup / "members.txt", "--non-members", setup / "nonmembers.txt",
            "--bootstrap", 50, "--perplexity", setup / "heldout.txt", setup / "nonmembers.txt", "--out", out]
    printed = _run(capsys, *argv)
    assert sorted(p.name for p in out.iterdir()) == ["extraction.jsonl", "mia.jsonl", "report.json",
                                                     "report.md", "report.png", "sampled.jsonl"]
    report = json.loads((out / "report.json").read_text())
    assert report == printed
    # mia.jsonl: every member then every non-member with each attack's score; its AUCs are the report's
    rows = [json.loads(line) for line in (out / "mia.jsonl").read_text().splitlines()]
    members = [d.id for d in load_corpus(str(setup / "members.txt"))]
    non_members = [d.id for d in load_corpus(str(setup / "nonmembers.txt"))]
    want = [(i, True) for i in members] + [(i, False) for i in non_members]
    assert [(r["id"], r["member"]) for r in rows] == want
    for method, got in report["mia"]["methods"].items():
        auc = roc_auc_score([r["member"] for r in rows], [r[method] for r in rows])
        assert auc == pytest.approx(got["auc"], abs=1e-12), method
    # report.png: a panel per pictured section (extraction, beyond greedy, MIA), shown in report.md
    png = (out / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[16:20], "big") == 3 * PANEL_PX
    assert report["extraction"]["docs"] == len((out / "extraction.jsonl").read_text().splitlines()) > 0
    assert [p["corpus"] for p in report["perplexity"]] == [str(setup / "heldout.txt"),
                                                           str(setup / "nonmembers.txt")]
    md = (out / "report.md").read_text()
    for needle in ("## Extraction", "| method | AUC [95% CI] | TPR@1%FPR [95% CI]", "| min_k_plus_plus |",
                   "## Utility", "perplexity |", "](report.png)", "scores are in mia.jsonl"):
        assert needle in md, needle
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert _refused(capsys, argv, "--out", "--overwrite")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # --overwrite without extraction: the stale extraction.jsonl goes too.
    _run(capsys, "--model", setup / "model", "--perplexity", setup / "heldout.txt", "--out", out,
         "--overwrite")
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md"]


def _refused(capsys, argv, *needles) -> str:
    return refused(capsys, ["eval", *argv], *needles)


def _other_tokenizer_model(root, vocab: int):
    folder = root / f"other-{vocab}"
    if not folder.exists():
        tok = load_tokenizer("bpe", texts=_texts(60, seed=9) + ["zebra quartz " * 9], vocab_size=vocab,
                             cache_dir=root / "cache")
        _save(folder, tok, len(tok), seed=2)
    return folder


BAD = [
    ([], ["--corpus/--mia/--perplexity", "nothing to evaluate"]),
    (["--mia", "--non-members", "{d}/nonmembers.txt"], ["--members", "--mia takes both"]),
    (["--mia", "--members", "{d}/members.txt"], ["--non-members"]),
    (["--members", "{d}/members.txt", "--perplexity", "{d}/heldout.txt"], ["--members", "add --mia"]),
    (["--mia", "--members", "{d}/members.txt", "--non-members", "{d}/members.txt"],
     ["--non-members", "20 of its documents", "members.txt/1", "disjoint"]),
    (["--mia", "--members", "{d}/members.txt", "--non-members", "{d}/overlap.txt"],
     ["--non-members", "1 of its documents", "overlap.txt/2 = members.txt/3"]),
    (["--mia", "--members", "{d}/members.txt", "--non-members", "{d}/nonmembers.txt", "--mia-k", "0"],
     ["--mia-k=0.0", "(0, 1]"]),
    (["--mia", "--members", "{d}/members.txt", "--non-members", "{d}/nonmembers.txt", "--mia-k", "1.5"],
     ["--mia-k=1.5"]),
    (["--mia", "--members", "{d}/members.txt", "--non-members", "{d}/nonmembers.txt", "--bootstrap", "-1"],
     ["--bootstrap=-1", ">= 0"]),
    (["--mia", "--members", "{d}/members.txt", "--non-members", "{d}/nonmembers.txt", "--mia-k", "x"],
     ["--mia-k", "invalid float"]),
    (["--perplexity", "nope"], ["--perplexity", "'nope'", "unknown corpus"]),
    (["--perplexity", "{d}/missing.txt"], ["--perplexity", "no such file"]),
    (["--corpus", "{d}/members.txt", "--max-tokens", "100"], ["--max-tokens=100", "context of 64"]),
    (["--corpus", "{d}/members.txt", "--max-tokens", "10"], ["--max-tokens=10", "--prefix + --suffix = 64"]),
    (["--corpus", "{d}/members.txt", "--decode", "static", "--beams", "2"], ["--decode='static'", "greedy"]),
]


@pytest.mark.parametrize("flags,needles", BAD)
def test_bad_input_is_one_line_and_writes_nothing(setup, tmp_path, capsys, flags, needles):
    lines = (setup / "members.txt").read_text().splitlines()
    (setup / "overlap.txt").write_text(f"fresh words only here\n{lines[2]}\n")
    out = tmp_path / "out"
    _refused(capsys, ["--model", setup / "model", *[f.format(d=setup) for f in flags], "--out", out],
             *needles)
    assert not out.exists()


def test_same_tokens_count_as_overlap(setup, tmp_path, capsys):
    first = (setup / "members.txt").read_text().splitlines()[0]
    (tmp_path / "near.txt").write_text(first + " zebra tail beyond the cut\n")
    _refused(capsys, ["--model", setup / "model", "--mia", "--members", setup / "members.txt",
                      "--non-members", tmp_path / "near.txt", "--max-tokens", 3, "--out", tmp_path / "out"],
             "1 of its documents", "near.txt/1 = members.txt/1")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("what", ["missing", "not-hf", "vocab-size", "tokenizer", "model-tokenizer"])
def test_bad_model_folders(setup, tmp_path, capsys, what):
    mia = ["--mia", "--members", setup / "members.txt", "--non-members", setup / "nonmembers.txt"]
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "weights.bin").write_bytes(b"x")
    model, ref = setup / "model", None
    if what == "missing":
        model, needles = tmp_path / "nope", ["--model", "no config.json"]
    elif what == "not-hf":
        ref, needles = tmp_path / "plain", ["--reference", "no config.json"]
    elif what == "vocab-size":
        ref, needles = _other_tokenizer_model(setup, 280), ["--reference", "vocab_size 280", "300"]
    elif what == "tokenizer":
        ref, needles = _other_tokenizer_model(setup, 300), ["--reference", "different tokenizer"]
    else:  # a model whose own tokenizer yields ids beyond its embedding table
        model = tmp_path / "small"
        _save(model, AutoTokenizer.from_pretrained(setup / "model"), 200, seed=0)
        needles = ["--model", "beyond the model's vocab_size 200"]
    argv = ["--model", model, *mia, *(["--reference", ref] if ref else []), "--out", tmp_path / "out"]
    _refused(capsys, argv, *needles)
    assert not (tmp_path / "out").exists()


def test_static_decode_gives_the_kv_decoders_report_and_says_how_it_decoded(setup, tmp_path, capsys):
    """`--decode static` (what a GPU evaluation takes by default) on CPU: the same extraction rows as the
    KV-cache decoder, every row verified, and report.md says so."""
    argv = ["--model", setup / "model", "--corpus", setup / "members.txt", "--prefix", 4, "--suffix", 6,
            "--batch-size", 8, "--sampling", ""]
    kv = _run(capsys, *argv, "--decode", "kv", "--out", tmp_path / "kv")
    st = _run(capsys, *argv, "--decode", "static", "--out", tmp_path / "st")
    assert kv["extraction"]["decode"]["path"] == "kv"
    n = st["extraction"]["docs"]
    assert st["extraction"]["decode"].pop("gap_shift_max") < 1e-4
    assert st["extraction"]["decode"] == {"path": "static", "rows": n, "checked": n, "verified": n,
                                          "redecoded": 0, "disagreements": []}
    rows = [(tmp_path / arm / "extraction.jsonl").read_text() for arm in ("kv", "st")]
    assert rows[0] == rows[1]
    assert "compiled static-cache decode" in (tmp_path / "st" / "report.md").read_text()


def test_a_plot_that_fails_costs_no_results(setup, tmp_path, capsys, monkeypatch):
    def broken(panels):
        raise RuntimeError("no font")

    monkeypatch.setattr("memorization.eval.plots.panels_png", broken)
    out = tmp_path / "out"
    argv = ["--model", setup / "model", "--corpus", setup / "members.txt", "--prefix", 4, "--suffix", 4,
            "--sampling", "", "--out", out]
    assert main([str(a) for a in ["eval", *argv]]) == 0
    assert "warning: report.png not drawn (RuntimeError: no font)" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["extraction.jsonl", "report.json", "report.md"]
    assert "report.png" not in (out / "report.md").read_text()
