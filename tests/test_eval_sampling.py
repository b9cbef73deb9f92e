"""`memorize eval --corpus --sampling --offsets`: per offset the greedy exact-match rate and the (n, p)
summaries, each document's log p_z per scheme in sampled.jsonl (equal to evals.scan.score_windows' on the
same windows), offset 0's exact match that of the greedy decode; --near-verbatim's bounds start at those
log p_z; bad flags are one line, exit 2."""
from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch
from helpers import levenshtein
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from data_pipelines import load_tokenizer
from evals.sampling import extractable, np_summary, parse_schemes
from evals.scan import score_windows
from memorization.cli import main
from memorization.eval.membership import corpus_from_texts, eval_corpus
from memorization.eval.plots import PANEL_PX, np_threshold, pz_curves
from memorization.eval.sections import marked_diff

CYCLE = ["river", "stone", "light", "north", "garden", "paper"]
OTHER = ["window", "market", "silver", "morning", "engine", "letter", "harbor", "winter", "copper", "signal"]
SCHEMES = "t=1.0;t=0.7,top_k=40;top_p=0.9"
NAMES = [s.name for s in parse_schemes(SCHEMES)]


def _texts() -> list[str]:
    """8 documents cycling through CYCLE (from different words), 8 of random OTHER words."""
    rng = random.Random(0)
    cyc = [" ".join(CYCLE[(i + j) % len(CYCLE)] for j in range(24)) for i in range(8)]
    rand = [" ".join(rng.choice(OTHER) for _ in range(rng.randint(18, 26))) for _ in range(8)]
    return [t for pair in zip(cyc, rand) for t in pair]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A 1-layer Llama that is a bigram model (attention and MLP write nothing; the head maps each token
    to its successor in CYCLE's documents, any other token to itself), its tokenizer, and corpus.txt:
    greedy decoding reproduces the cycling documents at every offset, not the random ones."""
    root = tmp_path_factory.mktemp("eval-sampling")
    texts = _texts()
    tok = load_tokenizer("bpe", texts=texts, vocab_size=300, cache_dir=root / "cache")
    seqs = corpus_from_texts("--corpus", "c", ["x"] * 8, texts[::2], tok, len(tok), 128).seqs
    nxt = {a: b for s in seqs for a, b in zip(s, s[1:])}
    assert all(nxt[a] == b for s in seqs for a, b in zip(s, s[1:]))  # one next token per token
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        e = model.model.embed_tokens.weight
        h = e / e.pow(2).mean(-1, keepdim=True).add(cfg.rms_norm_eps).sqrt()  # the final norm's output
        head = torch.zeros_like(h)
        for x in range(len(tok)):  # the logit of x's next token is |h_x|^2 = 64, others ~N(0, 64)
            head[nxt.get(x, x)] += h[x]
        model.lm_head.weight.copy_(head)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    (root / "corpus.txt").write_text("\n".join(texts) + "\n")
    return root


def _eval(setup, out, *extra) -> list[str]:
    return ["eval", "--model", str(setup / "model"), "--corpus", str(setup / "corpus.txt"), "--prefix", "4",
            "--suffix", "4", *extra, "--out", str(out)]


@pytest.fixture(scope="module")
def evaluated(setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("out") / "o"
    assert main(_eval(setup, out, "--sampling", SCHEMES, "--offsets", "0,8", "--np-n", "1,10")) == 0
    return out


def _lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_per_offset_exact_match_and_np(evaluated):
    report = json.loads((evaluated / "report.json").read_text())
    ex = report["extraction"]
    smp = report["sampled"]
    assert smp["schemes"] == NAMES and smp["ns"] == [1, 10] and smp["p"] == 0.5
    assert sorted(smp["offsets"]) == ["0", "8"]
    assert smp["offsets"]["0"]["exact_match_rate"] == ex["exact_match_rate"]  # the greedy decode's
    for at in smp["offsets"].values():
        assert 0.4 <= at["exact_match_rate"] < 1  # the 8 cycling documents, not the random ones
        assert list(at["np"]["schemes"]) == ["greedy", *NAMES] and at["np"]["rows"] == at["docs"]
        greedy = at["np"]["schemes"]["greedy"]
        assert all(greedy[k]["fraction"] == at["exact_match_rate"] for k in ("n=1", "n=10"))
    md = (evaluated / "report.md").read_text()
    assert "### Beyond greedy" in md and "| 8 |" in md and "`top_p=0.9`" in md
    assert sorted(p.name for p in evaluated.iterdir()) == ["extraction.jsonl", "report.json", "report.md",
                                                          "report.png", "sampled.jsonl"]


def test_rows_hold_the_log_pz_of_score_windows(setup, evaluated):
    report = json.loads((evaluated / "report.json").read_text())
    rows = _lines(evaluated / "sampled.jsonl")
    tok = AutoTokenizer.from_pretrained(setup / "model")
    c = eval_corpus("--corpus", str(setup / "corpus.txt"), tok, len(tok), report["max_tokens"], 0)
    model = AutoModelForCausalLM.from_pretrained(setup / "model").eval()
    decoded = {r["doc"]: r["exact_match"] for r in _lines(evaluated / "extraction.jsonl")}
    for o in (0, 8):
        keep = [i for i, s in enumerate(c.seqs) if len(s) >= o + 8]
        got = [r for r in rows if r["offset"] == o]
        assert [r["doc"] for r in got] == [c.ids[i] for i in keep]
        want = score_windows(model, torch.tensor([c.seqs[i][o:o + 8] for i in keep]), 4,
                             schemes=parse_schemes(SCHEMES))
        for name in ["greedy", *NAMES]:
            lz = np.array([-np.inf if r["logpz"][name] is None else r["logpz"][name] for r in got])
            np.testing.assert_allclose(lz, want[f"logpz_{name}" if name == "greedy" else f"logpz/{name}"],
                                       rtol=1e-12, err_msg=f"{o} {name}")
        exact = np.array([r["logpz"]["greedy"] == 0.0 for r in got])
        assert exact.tolist() == want["exact_match"].tolist()
        if o == 0:  # the one forward's exact match is the greedy decode's, document by document
            assert exact.tolist() == [decoded[r["doc"]] for r in got]
        summary = report["sampled"]["offsets"][str(o)]["np"]
        assert summary == np_summary({n: want[f"logpz/{n}"] for n in NAMES}, (1, 10), 0.5, greedy=exact)


def test_report_png_curves_cross_the_np_lines_at_the_reports_fractions(evaluated):
    """report.png's beyond-greedy panel: a curve's height at n's line is the report's (n, p) fraction."""
    report = json.loads((evaluated / "report.json").read_text())
    curves = pz_curves(_lines(evaluated / "sampled.jsonl"))
    smp = report["sampled"]
    assert sorted(curves) == sorted((int(o), s) for o in smp["offsets"] for s in ["greedy", *NAMES])
    checked = 0
    for (o, name), c in curves.items():
        for n in smp["ns"]:
            want = smp["offsets"][str(o)]["np"]["schemes"][name][f"n={n}"]["fraction"]
            assert (c >= np_threshold(n, smp["p"])).mean() == want, (o, name, n)
            checked += want > 0
    assert checked  # some curve is above a line: the check compared non-trivial heights
    png = (evaluated / "report.png").read_bytes()  # extraction and beyond greedy: two panels
    assert int.from_bytes(png[16:20], "big") == 2 * PANEL_PX


def test_np_lines_sit_where_extractable_turns_true():
    for n in (1, 10, 1000, 10**6):
        for p in (0.1, 0.5, 0.99):
            at = np_threshold(n, p) * math.log(10)  # natural log p_z of the line
            assert extractable(np.array([at + 1e-9, at - 1e-9]), n, p).tolist() == [True, False], (n, p)


def test_greedy_only_at_offset_zero_writes_no_rows(setup, tmp_path, evaluated, capsys):
    assert main(_eval(setup, tmp_path / "g", "--sampling", "")) == 0
    report = json.loads((tmp_path / "g" / "report.json").read_text())
    assert "sampled" not in report and not (tmp_path / "g" / "sampled.jsonl").exists()
    # the default schemes; an --overwrite without extraction removes the stale sampled.jsonl
    assert main(_eval(setup, tmp_path / "d")) == 0
    report = json.loads((tmp_path / "d" / "report.json").read_text())
    assert report["sampled"]["schemes"] == NAMES
    assert main(["eval", "--model", str(setup / "model"), "--perplexity", str(setup / "corpus.txt"),
                 "--out", str(tmp_path / "d"), "--overwrite"]) == 0
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["report.json", "report.md"]


def test_near_verbatim_rows_start_at_the_exact_copy(setup, evaluated, tmp_path):
    """--near-verbatim 2: per (offset, document) the bound at d = 0 is sampled.jsonl's log p_z (the search
    keeps the verbatim path), the bound grows with d, the likeliest path is spelled out; report.md tables
    it; report.png gains a panel."""
    out = tmp_path / "nv"
    assert main(_eval(setup, out, "--sampling", SCHEMES, "--offsets", "0,8", "--np-n", "1,10",
                      "--near-verbatim", "2", "--nv-beams", "2")) == 0
    report = json.loads((out / "report.json").read_text())
    nv = report["near_verbatim"]
    assert (nv["max_edits"], nv["beams"], nv["schemes"], nv["ns"]) == (2, 2, NAMES, [1, 10])
    assert report["sampled"] == {**json.loads((evaluated / "report.json").read_text())["sampled"],
                                 "seconds": report["sampled"]["seconds"]}
    rows, sampled = _lines(out / "near_verbatim.jsonl"), _lines(out / "sampled.jsonl")
    tok = AutoTokenizer.from_pretrained(setup / "model")
    c = eval_corpus("--corpus", str(setup / "corpus.txt"), tok, len(tok), report["max_tokens"], 0)
    by_doc = dict(zip(c.ids, c.seqs))
    assert [(r["offset"], r["doc"]) for r in rows] == [(r["offset"], r["doc"]) for r in sampled]
    grew = 0
    for r, want in zip(rows, sampled):
        for name in NAMES:
            b = [-math.inf if x is None else x for x in r["bound"][name]]
            lz = want["logpz"][name]
            assert (b[0] == -math.inf) if lz is None else b[0] == pytest.approx(lz, abs=1e-4), (r, name)
            assert b[0] <= b[1] <= b[2]
            grew += b[2] > b[0] + 1e-3
            best = r["likeliest"][name]
            assert best["edits"] <= 2 and len(best["tokens"]) == 4 and isinstance(best["text"], str)
        assert r["suffix"] == tok.decode(by_doc[r["doc"]][r["offset"] + 4:r["offset"] + 8])
    assert grew  # some document has near-copies with real mass
    # report.md's examples: the likeliest near-copies (not exact), one per window, most probable first
    examples = nv["examples"]
    want = sorted(((p["logp"], r["doc"], r["offset"]) for r in rows for p in r["likeliest"].values()
                   if p["edits"] and p["logp"] is not None), reverse=True)
    assert examples and examples[0]["logp"] == want[0][0] and all(x["edits"] > 0 for x in examples)
    assert len({(x["doc"], x["offset"]) for x in examples}) == len(examples) <= 3
    assert [x["logp"] for x in examples] == sorted((x["logp"] for x in examples), reverse=True)
    for o, at in nv["offsets"].items():
        for name in NAMES:
            got = [r for r in rows if r["offset"] == int(o)]
            for d in range(3):
                hits = sum(b is not None and b >= math.log(0.5) for b in (r["bound"][name][d] for r in got))
                assert at["np"][name]["schemes"][f"d={d}"]["n=1"]["count"] == hits
    md = (out / "report.md").read_text()
    assert "### Near-verbatim" in md and "| 8 |" in md and "| <= 2 |" in md and "near_verbatim.jsonl" in md
    assert f"near: {examples[0]['text']!r}" in md and "Likeliest near-copies found" in md
    diff = examples[0]["diff"]
    assert f"diff: {diff!r}" in md and ("{+" in diff or "[-" in diff)
    png = (out / "report.png").read_bytes()
    assert int.from_bytes(png[16:20], "big") == 3 * PANEL_PX


def test_marked_diff_shows_what_a_near_copy_changes():
    """A deleted and an inserted token marked as git's word diff does, the rest as it reads."""
    class Words:
        words = {1: " the", 2: " big", 3: " cat", 4: " sat", 5: " down", 9: " up", 7: " dog"}

        def decode(self, ids):
            return "".join(self.words[i] for i in ids)

    assert marked_diff(Words(), [1, 2, 3, 4, 5], [1, 3, 4, 9, 5]) == " the[- big-] cat sat{+ up+} down"
    assert marked_diff(Words(), [1, 2, 3], [1, 7, 3]) == " the[- big-]{+ dog+} cat"
    assert marked_diff(Words(), [1, 2, 3], [1, 2, 3]) == " the big cat"


def test_near_verbatim_by_edit_distance(setup, tmp_path):
    """--nv-distance levenshtein: the same exact-copy column (p_z), each likeliest path's changes are its
    edit distance to the suffix, and report.md names edits, not changed tokens."""
    out = tmp_path / "lev"
    assert main(_eval(setup, out, "--sampling", "t=1.0", "--np-n", "1,10", "--near-verbatim", "2",
                      "--nv-beams", "2", "--nv-distance", "levenshtein")) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["near_verbatim"]["distance"] == "levenshtein"
    tok = AutoTokenizer.from_pretrained(setup / "model")
    c = eval_corpus("--corpus", str(setup / "corpus.txt"), tok, len(tok), report["max_tokens"], 0)
    by_doc = dict(zip(c.ids, c.seqs))
    sampled = {r["doc"]: r for r in _lines(out / "sampled.jsonl")}
    for r in _lines(out / "near_verbatim.jsonl"):
        b = [-math.inf if x is None else x for x in r["bound"]["t=1.0"]]
        lz = sampled[r["doc"]]["logpz"]["t=1.0"]
        assert (b[0] == -math.inf) if lz is None else b[0] == pytest.approx(lz, abs=1e-4)
        assert b[0] <= b[1] <= b[2]
        best = r["likeliest"]["t=1.0"]
        truth = list(by_doc[r["doc"]][4:8])
        assert best["edits"] == levenshtein(best["tokens"], truth) <= 2
    md = (out / "report.md").read_text()
    assert "within d token edits" in md and "edit distance" in md and "changed tokens" not in md


@pytest.mark.parametrize("extra,needle", [
    (["--nv-distance", "levenshtein"], "--nv-distance"),
    (["--near-verbatim", "4"], "--near-verbatim"), (["--near-verbatim", "-1"], "--near-verbatim"),
    (["--near-verbatim", "1", "--sampling", ""], "--near-verbatim"), (["--nv-beams", "3"], "--nv-beams"),
    (["--near-verbatim", "1", "--nv-beams", "0"], "--nv-beams"),
    (["--sampling", "t=0.7,top_k=0"], "--sampling"), (["--sampling", "x=1"], "--sampling"),
    (["--offsets", "0,-8"], "--offsets"), (["--offsets", "8,8"], "--offsets"), (["--np-n", "0"], "--np-n"),
    (["--np-p", "0"], "--np-p"), (["--offsets", "100", "--max-tokens", "20"], "--offsets"),
    (["--offsets", "200"], "--offsets"),  # beyond the model's context of 128
])
def test_bad_flags_are_one_line(setup, tmp_path, capsys, extra, needle):
    capsys.readouterr()
    assert main(_eval(setup, tmp_path / "o", *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {needle}="), err
    assert not (tmp_path / "o").exists()


def test_sampling_flags_without_a_corpus_are_refused(setup, capsys):
    capsys.readouterr()
    assert main(["eval", "--model", str(setup / "model"), "--perplexity", str(setup / "corpus.txt"),
                 "--offsets", "0,8"]) == 2
    assert "--offsets='0,8': only applies to extraction" in capsys.readouterr().err
    assert main(["eval", "--model", str(setup / "model"), "--perplexity", str(setup / "corpus.txt"),
                 "--near-verbatim", "1"]) == 2
    assert "--near-verbatim=1: only applies to extraction" in capsys.readouterr().err


def _rank(rank, world, argv):
    return main(argv)


@pytest.mark.distributed
def test_sharded_eval_writes_the_serial_summaries(setup, evaluated, tmp_path):
    """4 gloo ranks at 1,2,1,2 (heads and vocab over Y: top-k / top-p from merged candidates, batch over
    data): every rank scores, the main rank writes the serial command's summaries and log p_z."""
    from axonn.spawn import run_distributed

    argv = _eval(setup, tmp_path / "g", "--sampling", SCHEMES, "--offsets", "0,8", "--np-n", "1,10",
                 "--grid", "1,2,1,2")
    assert run_distributed(_rank, 4, argv, init=False, timeout=600) == [0] * 4
    serial, grid = (json.loads((d / "report.json").read_text())["sampled"]
                    for d in (evaluated, tmp_path / "g"))
    assert grid["offsets"] == serial["offsets"]
    rows = zip(_lines(tmp_path / "g" / "sampled.jsonl"), _lines(evaluated / "sampled.jsonl"), strict=True)
    for got, want in rows:
        assert (got["offset"], got["doc"]) == (want["offset"], want["doc"])
        for name, v in want["logpz"].items():
            assert (got["logpz"][name] is None) == (v is None), name
            assert v is None or got["logpz"][name] == pytest.approx(v, rel=1e-5, abs=1e-6), name
