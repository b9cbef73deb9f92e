"""scripts/prepare_corpus.py: text and JSONL in, one corpus JSONL + manifest out, loadable as data.corpus."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("prepare_corpus", ROOT / "scripts" / "prepare_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PREP = _script()


def _inputs(tmp_path: Path) -> tuple[Path, Path]:
    txt = tmp_path / "notes.txt"
    txt.write_text("The first note is long enough.\nshort\n\nThe  first note is long enough.\n")
    jsonl = tmp_path / "records.jsonl"
    jsonl.write_text(json.dumps({"body": "A record from the JSONL file."}) + "\n"
                     + json.dumps({"body": "The first note is long enough."}) + "\n")
    return txt, jsonl


def test_writes_a_loadable_corpus_and_manifest(tmp_path, capsys):
    from data_pipelines import load_corpus

    txt, jsonl = _inputs(tmp_path)
    out = tmp_path / "corpus.jsonl"
    assert PREP.main([str(txt), str(jsonl), "--out", str(out), "--text-field", "body", "--min-chars", "10",
                      "--dedupe", "--tokenizer", "gpt2", "--block-len", "8"]) == 0
    docs = load_corpus(str(out))
    assert [d.text for d in docs] == ["The first note is long enough.", "A record from the JSONL file."]
    manifest = json.loads((tmp_path / "corpus.jsonl.manifest.json").read_text())
    assert manifest["output"]["documents"] == 2 and len(manifest["output"]["sha256"]) == 64
    assert manifest["dropped"]["short"] == ["notes.txt/2"]
    assert [d["id"] for d in manifest["dropped"]["duplicate"]] == ["notes.txt/4", "records.jsonl/2"]
    assert all(len(i["sha256"]) == 64 for i in manifest["inputs"])
    assert manifest["tokens"]["tokens"] > 0 and manifest["tokens"]["packed_blocks"] >= 1
    assert "2 documents" in capsys.readouterr().out


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys):
    txt, _ = _inputs(tmp_path)
    out = tmp_path / "c.jsonl"
    cases = [([str(txt), "--out", str(tmp_path / "c.txt")], "--out="),
             ([str(tmp_path / "missing.txt"), "--out", str(out)], "corpus="),
             ([str(txt), "--out", str(out), "--min-chars", "1000"], "inputs="),
             ([str(txt), "--out", str(out), "--tokenizer", "bpe"], "--tokenizer='bpe'")]
    for argv, field in cases:
        assert PREP.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and field in err, err
        assert not out.exists()
    out.write_text("")
    assert PREP.main([str(txt), "--out", str(out)]) == 2 and "exists" in capsys.readouterr().err
