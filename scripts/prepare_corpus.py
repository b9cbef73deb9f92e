#!/usr/bin/env python
"""Turn your text into one corpus file with a manifest, ready for `data.corpus=` on a cluster.

    python scripts/prepare_corpus.py INPUT [INPUT ...] --out corpus.jsonl [--text-field text]
        [--min-chars 1] [--dedupe] [--limit N] [--tokenizer DIR --block-len 4096] [--overwrite]

INPUT is anything `data.corpus` takes (a .txt file with one document per line, a .jsonl file with a
text field, a .parquet file, a folder of .txt files, a registry name). The output is JSONL, one
{"id", "text", "source"} object per document (ids stay those of data_pipelines.load_corpus, so a
result can be traced to its line), and OUT.manifest.json records every input (with a sha256 for
files), what was dropped and why, the output's sha256, and with --tokenizer the tokens and the
number of packed blocks of --block-len (a run needs batch_size blocks per step). Bad input: one
line, exit 2, nothing written.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memorization.outputs import check_inputs, check_writable
from memorize_core import ConfigError, fail


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are ConfigErrors (one line, exit 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{message}; see --help")


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    p = _Parser(prog="prepare_corpus.py", description=__doc__.split("\n\n")[0])
    p.add_argument("inputs", nargs="+", help="text/JSONL/parquet files, folders of .txt, or corpus names")
    p.add_argument("--out", required=True, help="the corpus file to write (.jsonl)")
    p.add_argument("--text-field", default="text", help="JSONL/parquet key holding the text")
    p.add_argument("--min-chars", type=int, default=1, help="drop documents shorter than this")
    p.add_argument("--dedupe", action="store_true", help="drop exact repeats (whitespace-normalised)")
    p.add_argument("--limit", type=int, default=None, help="keep the first N documents")
    p.add_argument("--tokenizer", default=None,
                   help="count tokens with this tokenizer folder (or gpt2, or smollm2-135m)")
    p.add_argument("--block-len", type=int, default=4096, help="block length for the block count")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    return p


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _source(spec: str) -> dict[str, Any]:
    """What an input was: its spec and, for a file, its size and sha256."""
    p = Path(spec).expanduser()
    if p.is_file():
        return {"spec": spec, "bytes": p.stat().st_size, "sha256": _sha256(p)}
    return {"spec": spec}


def collect(args: argparse.Namespace) -> tuple[list[dict[str, str]], dict[str, Any]]:
    """The kept documents and the manifest's account of inputs and drops."""
    # deferred: data_pipelines +3.1 s import (torch, transformers); --help and usage errors answer
    # without it
    from data_pipelines import load_corpus  # deferred: +3.1 s import

    if args.min_chars < 0:
        raise fail("--min-chars", args.min_chars, "must be >= 0")
    if args.limit is not None and args.limit < 1:
        raise fail("--limit", args.limit, "must be >= 1")
    kept: list[dict[str, str]] = []
    seen: dict[str, str] = {}
    dropped = {"short": [], "duplicate": []}
    inputs = []
    for spec in args.inputs:
        docs = load_corpus(spec, text_field=args.text_field)
        inputs.append({**_source(spec), "documents": len(docs)})
        for d in docs:
            if len(d.text) < args.min_chars:
                dropped["short"].append(d.id)
                continue
            key = " ".join(d.text.split())
            if args.dedupe and key in seen:
                dropped["duplicate"].append({"id": d.id, "first": seen[key]})
                continue
            seen.setdefault(key, d.id)
            kept.append({"id": d.id, "text": d.text, "source": spec})
    if args.limit is not None:
        kept = kept[:args.limit]
    if not kept:
        raise fail("inputs", args.inputs, "no document is left; lower --min-chars or check the text field")
    return kept, {"inputs": inputs, "dropped": dropped}


def count_tokens(docs: list[dict[str, str]], spec: str, block_len: int) -> dict[str, Any]:
    """Tokens with `spec` and the packed blocks they make
    (documents joined by EOS, as data.packing=packed)."""
    from data_pipelines import load_tokenizer  # deferred: +3.1 s import, as in collect

    if spec == "bpe":
        raise fail("--tokenizer", spec,
                   "a corpus BPE is trained at run time; pass a tokenizer folder or gpt2")
    if block_len < 2:
        raise fail("--block-len", block_len, "must be >= 2")
    if spec == "smollm2-135m":  # the pretrained name model.name takes: its cached folder, made once
        from memorization.models import model_folder  # deferred: as above

        spec = model_folder("--tokenizer", spec)
    tok = load_tokenizer(spec)
    tokens = sum(len(ids) + 1
                 for ids in tok([d["text"] for d in docs], add_special_tokens=False)["input_ids"])
    return {"tokenizer": spec, "tokens": tokens, "block_len": block_len, "packed_blocks": tokens // block_len}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: 0, or 2 with one line on stderr (nothing written)."""
    try:
        args = build_parser().parse_args(argv)
        out = Path(args.out)
        manifest_path = out.with_name(out.name + ".manifest.json")
        if out.suffix != ".jsonl":
            raise fail("--out", args.out, "write a .jsonl file (data.corpus reads it with text_field=text)")
        if (out.exists() or manifest_path.exists()) and not args.overwrite:
            raise fail("--out", args.out, "exists; choose a new name or pass --overwrite")
        # --overwrite replaces OUT and its manifest only, never an input (memorization/outputs.py)
        check_inputs("--out", out, {f"inputs[{i}]": p for i, p in enumerate(args.inputs)})
        check_inputs("--out", manifest_path, {f"inputs[{i}]": p for i, p in enumerate(args.inputs)})
        check_writable("--out", out.parent)
        docs, manifest = collect(args)
        tokens = count_tokens(docs, args.tokenizer, args.block_len) if args.tokenizer else None
    except ConfigError as e:
        print(f"prepare_corpus.py: error: {e}", file=sys.stderr)
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        for d in docs:
            fh.write(json.dumps(d, ensure_ascii=False) + "\n")
    tmp.replace(out)  # a half-written corpus is never mistaken for a finished one
    manifest.update({
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "output": {"path": str(out), "documents": len(docs), "chars": sum(len(d["text"]) for d in docs),
                   "sha256": _sha256(out)},
        "settings": {"text_field": args.text_field, "min_chars": args.min_chars, "dedupe": args.dedupe,
                     "limit": args.limit},
        "tokens": tokens,
    })
    manifest_path.write_text(json.dumps(manifest, indent=1, ensure_ascii=False))
    summary = f"{len(docs)} documents -> {out} (manifest {manifest_path.name})"
    if tokens:
        summary += (f"; {tokens['tokens']:,} tokens = {tokens['packed_blocks']:,} "
                    f"blocks of {tokens['block_len']}")
    print(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
