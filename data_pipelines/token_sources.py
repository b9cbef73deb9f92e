"""Token streams a corpus scan reads, one document at a time (never the whole corpus in memory).

`open_source(spec, ...)` resolves a source spec to a `TokenSource`, whose `documents(start)` yields
`(document index, int64 token array)` from document `start` on:

- a GPT-NeoX / Megatron indexed dataset, `NAME.bin` + `NAME.idx` (spec: either file, or NAME): the
  `.idx` header read here from the published layout (`MMIDIDX\\0\\0`, version 1, dtype code, counts,
  sizes, pointers, document indices); each of its sequences is one document, read from the
  memory-mapped `.bin`;
- a flat token file: `.npy` (1-D: one stream; 2-D: one document per row), or a raw `.bin` with no
  `.idx` beside it, which needs its `dtype` stated;
- text, tokenized with the model's tokenizer: a bundled corpus name, a `.txt` (one document per
  non-empty line) or `.jsonl` (the `text` key of each line; a count key per line can say how many
  times the document was in the training set), read line by line;
- `hf:NAME[:CONFIG]`: a Hugging Face dataset in streaming mode (needs the hub; not run here).

Document ids (`doc_id`) are the corpora's own: `<file name>/<1-based line>` for text files,
`<corpus>/<key>` for bundled corpora, `hf:NAME/<split>/<row>` for the hub, and the document index
for token files.
"""
from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from data_pipelines.corpora import CORPORA, hub_access, hub_failure, load_corpus
from memorize_core import fail

IDX_MAGIC = b"MMIDIDX\x00\x00"
# The indexed format's dtype codes (GPT-NeoX / Megatron-LM's published table).
IDX_DTYPES: dict[int, np.dtype] = {1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16),
                                   4: np.dtype(np.int32), 5: np.dtype(np.int64), 6: np.dtype(np.float64),
                                   7: np.dtype(np.float32), 8: np.dtype(np.uint16)}
RAW_DTYPES = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "int64")
SOURCE_HELP = ("a bundled corpus name, a .txt/.jsonl file (tokenized with the model's tokenizer), a .npy "
               "or raw .bin token file (with --dtype), an indexed NAME.bin + NAME.idx pair, or hf:NAME")


@dataclass
class TokenSource:
    """One opened source: its kind, path, document count (None: unknown until read) and reader."""

    spec: str
    kind: str  # indexed | npy | bin | text | hf
    num_documents: int | None
    dtype: str | None = None  # stored token dtype of token files (None for text)
    _read: Any = field(default=None, repr=False)
    _doc_id: Any = field(default=None, repr=False)
    counts: dict[int, int] = field(default_factory=dict)  # document -> times in the training set
    # token files: (the stored ids as one flat array, position -> document or None for a gap)
    _flat: Any = field(default=None, repr=False)

    def documents(self, start: int = 0) -> Iterator[tuple[int, np.ndarray]]:
        """(document index, token ids as int64) from document `start` on, in source order."""
        return self._read(start)

    def doc_id(self, doc: int) -> str:
        """The stable id of document `doc` (see the module docstring)."""
        return self._doc_id(doc) if self._doc_id is not None else str(doc)

    def max_id(self) -> int | None:
        """The largest id the stored dtype can hold (None for text: the tokenizer's ids)."""
        if self.dtype is None:
            return None
        dt = np.dtype(self.dtype)
        return int(np.iinfo(dt).max) if dt.kind in "iu" else int(2 ** np.finfo(dt).nmant)

    def first_outside(self, vocab: int, chunk: int = 1 << 24) -> tuple[int, int] | None:
        """(document, id) of a stored id outside [0, vocab), or None; token files only (text: None).

        One sequential pass over the memory-mapped ids, `chunk` at a time (the whole source, so a
        scan refuses it before its first part is written, not after the parts before it)."""
        if self._flat is None:
            return None
        flat, owner = self._flat
        dt = flat.dtype
        if dt.kind == "u" and np.iinfo(dt).max < vocab:
            return None  # no stored value can reach past the vocabulary
        for lo in range(0, flat.size, chunk):
            part = flat[lo:lo + chunk]
            if part.max() < vocab and (dt.kind == "u" or part.min() >= 0):
                continue
            for j in np.flatnonzero((part >= vocab) | (part < 0)):
                doc = owner(lo + int(j))
                if doc is not None:  # not a byte between sequences that no document reads
                    return doc, int(part[j])
        return None


# -- the GPT-NeoX / Megatron indexed format ------------------------------------------------------
@dataclass(frozen=True)
class IndexHeader:
    """An `.idx` file's contents: dtype, per-sequence sizes and byte pointers, document indices."""

    dtype: np.dtype
    sizes: np.ndarray  # int32 [n]: tokens per sequence
    pointers: np.ndarray  # int64 [n]: byte offset of each sequence in the .bin
    doc_idx: np.ndarray  # int64 [d]: sequence index where each document starts (+ the end)


def read_index(idx_path: str | Path, field_name: str = "--data") -> IndexHeader:
    """Parse an `.idx` file (memory-mapped arrays); ConfigError when it is not one."""
    path = Path(idx_path)
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    head = bytes(raw[:34]) if raw.size >= 34 else b""
    if head[:9] != IDX_MAGIC:
        raise fail(field_name, str(path), "is not a GPT-NeoX/Megatron .idx file (no MMIDIDX header); pass "
                   "the NAME.idx written with its NAME.bin, or a raw .bin with --dtype")
    version, = struct.unpack("<Q", head[9:17])
    code, = struct.unpack("<B", head[17:18])
    n, d = struct.unpack("<QQ", head[18:34])
    if version != 1 or code not in IDX_DTYPES:
        raise fail(field_name, str(path), f"has .idx version {version}, dtype code {code}; only version 1 "
                   f"with codes {sorted(IDX_DTYPES)} is known: rewrite it with GPT-NeoX's preprocess_data.py")
    need = 34 + 4 * n + 8 * n + 8 * d
    if raw.size < need:
        raise fail(field_name, str(path), f"is truncated ({raw.size} bytes, its header announces {n} "
                   f"sequences and {d} document indices = {need} bytes); rewrite the .idx")
    sizes = np.frombuffer(raw, dtype=np.int32, count=n, offset=34)
    pointers = np.frombuffer(raw, dtype=np.int64, count=n, offset=34 + 4 * n)
    doc_idx = np.frombuffer(raw, dtype=np.int64, count=d, offset=34 + 12 * n)
    return IndexHeader(IDX_DTYPES[code], sizes, pointers, doc_idx)


def _indexed(spec: str, bin_path: Path, idx_path: Path, dtype: str | None) -> TokenSource:
    head = read_index(idx_path)
    _same_dtype(spec, dtype, head.dtype, f"its {idx_path.name} header")
    data = np.memmap(bin_path, dtype=np.uint8, mode="r") if bin_path.stat().st_size else np.zeros(0, np.uint8)
    item = head.dtype.itemsize
    ends = head.pointers.astype(np.int64) + head.sizes.astype(np.int64) * item
    bad = np.nonzero((head.pointers < 0) | (ends > data.size) | (head.sizes < 0))[0]
    if bad.size:
        i = int(bad[0])
        raise fail("--data", str(idx_path), f"does not match {bin_path.name}: sequence {i} ends at byte "
                   f"{int(ends[i])} but the .bin has {data.size} bytes; use the .idx written with this .bin")

    def read(start: int) -> Iterator[tuple[int, np.ndarray]]:
        for i in range(start, len(head.sizes)):
            p, n = int(head.pointers[i]), int(head.sizes[i])
            yield i, np.frombuffer(data, dtype=head.dtype, count=n, offset=p).astype(np.int64)

    flat = np.frombuffer(data, dtype=head.dtype, count=data.size // item)
    starts, stops = head.pointers // item, ends // item

    def owner(pos: int) -> int | None:
        i = int(np.searchsorted(starts, pos, side="right")) - 1
        return i if i >= 0 and pos < stops[i] else None

    return TokenSource(spec, "indexed", len(head.sizes), head.dtype.name, read, _flat=(flat, owner))


def _same_dtype(spec: str, dtype: str | None, stored: np.dtype, where: str) -> None:
    """--dtype with a file that states its own dtype: accepted when it agrees, refused when not."""
    if dtype is not None and np.dtype(dtype) != stored:
        raise fail("--dtype", dtype, f"{spec} states its own dtype, {stored.name}, in {where}; drop --dtype "
                   "(it is for raw .bin token files with no .idx beside them)")


# -- flat token files ------------------------------------------------------------------------------
def _npy(spec: str, path: Path, dtype: str | None) -> TokenSource:
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as e:
        raise fail("--data", spec, f"is not a readable .npy array ({e}); save token ids with numpy.save") \
            from None
    if arr.ndim not in (1, 2) or arr.dtype.kind not in "iu":
        raise fail("--data", spec, f"holds a {arr.ndim}-D {arr.dtype} array; pass integer token ids, 1-D "
                   "(one stream) or 2-D (one document per row)")
    _same_dtype(spec, dtype, arr.dtype, "its .npy header")
    rows = arr[None] if arr.ndim == 1 else arr

    def read(start: int) -> Iterator[tuple[int, np.ndarray]]:
        for i in range(start, rows.shape[0]):
            yield i, np.asarray(rows[i], dtype=np.int64)

    # a view, never a copy: C order walks row by row, Fortran order (fortran_order=True) column by column
    fortran = arr.ndim == 2 and not arr.flags.c_contiguous and arr.flags.f_contiguous
    flat = arr.reshape(-1, order="F" if fortran else "C")
    n_rows, n_cols = rows.shape
    owner = (lambda pos: pos % n_rows) if fortran else (lambda pos: pos // max(n_cols, 1))
    return TokenSource(spec, "npy", rows.shape[0], arr.dtype.name, read, _flat=(flat, owner))


def _raw_bin(spec: str, path: Path, dtype: str | None) -> TokenSource:
    if dtype is None:
        raise fail("--dtype", None, f"{spec} is a raw token file with no .idx beside it; state its dtype "
                   f"(one of {', '.join(RAW_DTYPES)}), e.g. --dtype uint16")
    size = path.stat().st_size
    item = np.dtype(dtype).itemsize
    if size % item:
        raise fail("--dtype", dtype, f"{spec} has {size} bytes, not a whole number of {item}-byte tokens; "
                   "state the dtype it was written with")
    data = np.memmap(path, dtype=np.dtype(dtype), mode="r") if size else np.zeros(0, dtype)

    def read(start: int) -> Iterator[tuple[int, np.ndarray]]:
        if start == 0:
            yield 0, np.asarray(data, dtype=np.int64)

    return TokenSource(spec, "bin", 1, np.dtype(dtype).name, read, _flat=(data, lambda pos: 0))


# -- text, tokenized with the model's tokenizer -----------------------------------------------------
def _encode(tokenizer: Any, text: str) -> np.ndarray:
    return np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)


def _text_file(spec: str, path: Path, tokenizer: Any, count_key: str | None) -> TokenSource:
    """A .txt / .jsonl file read line by line; documents are its non-empty lines (ids as corpora's).

    With a `count_key` (JSONL only) the file is read through once when opened, JSON only, no
    tokenizing: the counts are known, and a key that no line has refused, before the scan writes."""
    jsonl = path.suffix.lower() == ".jsonl"
    lines: list[int] = []  # 1-based line number of each document, filled as the file is read

    def parse(number: int, line: str) -> tuple[str | None, dict | None]:
        if not jsonl:
            return line.strip() or None, None
        if not line.strip():
            return None, None
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise fail("--data", f"{spec}:{number}", f"line {number} is not valid JSON ({e.msg}); write "
                       "one JSON object per line") from None
        text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise fail("--data", f"{spec}:{number}", "each line needs a string 'text' key; rename the key "
                       "that holds the text")
        return text.strip() or None, record

    def read(start: int) -> Iterator[tuple[int, np.ndarray]]:
        lines.clear()
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                text, _ = parse(number, line)
                if text is None:
                    continue
                lines.append(number)
                doc = len(lines) - 1
                if doc >= start:
                    yield doc, _encode(tokenizer, text)

    source = TokenSource(spec, "text", None, None, read, lambda d: f"{path.name}/{lines[d]}")
    if count_key is not None:
        source.counts, source.num_documents = _count_lines(spec, path, count_key, parse)
    return source


def _count_lines(spec: str, path: Path, key: str, parse: Any) -> tuple[dict[int, int], int]:
    """(document -> the integer under `key`, documents) of a JSONL file; ConfigError naming --count-key
    when no line has the key or a line holds something other than a count."""
    counts: dict[int, int] = {}
    seen: set[str] = set()
    docs = 0
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            text, record = parse(number, line)
            if text is None:
                continue
            value = record.get(key, None)
            if key in record:
                if isinstance(value, float) and value.is_integer():
                    value = int(value)
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise fail("--count-key", key, f"line {number} of {spec} holds {value!r} there, not a "
                               "count; store each document's times in the training set as an integer >= 0")
                counts[docs] = value
            elif len(seen) < 50:
                seen.update(map(str, record))
            docs += 1
    if not counts:
        keys = ", ".join(sorted(seen)[:12]) or "none"
        raise fail("--count-key", key, f"no line of {spec} has this key (its lines have: {keys}); pass the "
                   "key that holds each document's count, or drop --count-key")
    return counts, docs


def _bundled(spec: str, tokenizer: Any) -> TokenSource:
    docs = load_corpus(spec)  # small, offline; read once

    def read(start: int) -> Iterator[tuple[int, np.ndarray]]:
        for i in range(start, len(docs)):
            yield i, _encode(tokenizer, docs[i].text)

    return TokenSource(spec, "text", len(docs), None, read, lambda d: docs[d].id)


def _hub(spec: str, tokenizer: Any, split: str) -> TokenSource:
    """A Hugging Face dataset in streaming mode (rows read as they arrive; needs the hub)."""
    name, _, config = spec.removeprefix("hf:").partition(":")

    def read(start: int) -> Iterator[tuple[int, np.ndarray]]:
        import datasets  # deferred: datasets +0.5 s import, hf: sources only

        offline = False
        try:
            with hub_access() as offline:  # no retry lines before our one; unreachable: at once
                ds = datasets.load_dataset(name, config or None, split=split, streaming=True)
        except Exception as e:  # offline, unknown name: user-fixable
            raise fail("--data", spec, f"could not stream it from the Hugging Face hub "
                       f"({hub_failure(e, offline)}); check the name and that the hub is reachable, or "
                       "scan a local file") from None
        for i, row in enumerate(ds):
            if i >= start and isinstance(row.get("text"), str):
                yield i, _encode(tokenizer, row["text"])

    return TokenSource(spec, "hf", None, None, read, lambda d: f"hf:{name}/{split}/{d}")


def in_memory(name: str, documents: list[list[int]]) -> TokenSource:
    """Token lists already in memory (a run's training documents) as a source."""
    def read(start: int) -> Iterator[tuple[int, np.ndarray]]:
        for i in range(start, len(documents)):
            yield i, np.asarray(documents[i], dtype=np.int64)

    return TokenSource(name, "memory", len(documents), None, read)


def check_spec(spec: Any) -> None:
    """ConfigError naming --data for a spec that names no source at all: empty, a folder, a NUL byte."""
    if not isinstance(spec, str) or not spec.strip():
        raise fail("--data", spec, f"name a source: {SOURCE_HELP}")
    if "\0" in spec:
        raise fail("--data", spec, "holds a NUL byte, which no file name can; pass the path as written")
    path = Path(spec).expanduser()
    if path.is_dir() and spec not in CORPORA:
        raise fail("--data", spec, f"is a folder, not a source; pass a file in it or {SOURCE_HELP}")


def index_pair(spec: str) -> tuple[Path, Path] | None:
    """(NAME.bin, NAME.idx) that an indexed spec (either file, or NAME) names; None for '.', '/', ..."""
    path = Path(spec).expanduser()
    base = path.with_suffix("") if path.suffix in (".bin", ".idx") else path
    if base.name in ("", ".", ".."):
        return None
    return base.with_name(base.name + ".bin"), base.with_name(base.name + ".idx")


def open_source(spec: str, *, tokenizer: Any = None, dtype: str | None = None, count_key: str | None = None,
                split: str = "train") -> TokenSource:
    """Open a scan source (see the module docstring); ConfigError naming --data/--dtype otherwise.

    --dtype names the stored dtype of a raw .bin; with an indexed pair or an .npy (which state their
    own) it is accepted when it agrees and refused when it does not. --count-key is for .jsonl only."""
    check_spec(spec)
    if dtype is not None and dtype not in RAW_DTYPES:
        raise fail("--dtype", dtype, f"choose one of {', '.join(RAW_DTYPES)}")
    path = Path(spec).expanduser()
    if count_key is not None and not (path.suffix.lower() == ".jsonl" and path.is_file()):
        raise fail("--count-key", count_key, f"reads a key of each line of a .jsonl source, and {spec} is "
                   "not one; drop it (or pass --manifest for an injected corpus)")
    pair = index_pair(spec)
    if pair is not None and (pair[1].is_file() or (path.suffix == ".idx" and path.exists())):
        bin_path, idx_path = pair
        if not bin_path.is_file():
            raise fail("--data", spec, f"has no {bin_path.name} beside its .idx; put the pair in one folder")
        return _indexed(spec, bin_path, idx_path, dtype)
    if path.suffix == ".npy" and path.is_file():
        return _npy(spec, path, dtype)
    if path.suffix == ".bin" and path.is_file():
        return _raw_bin(spec, path, dtype)
    if dtype is not None:
        raise fail("--dtype", dtype, "applies to raw .bin token files only; drop it for text sources")
    text = spec in CORPORA or spec.startswith("hf:") or (path.suffix.lower() in (".txt", ".jsonl")
                                                         and path.is_file())
    if text and tokenizer is None:
        raise fail("--model", None, f"{spec} is text: it is tokenized with the model's tokenizer, and the "
                   "model folder holds none; save one there (tokenizer.save_pretrained)")
    if spec in CORPORA:
        return _bundled(spec, tokenizer)
    if spec.startswith("hf:"):
        return _hub(spec, tokenizer, split)
    if path.suffix.lower() in (".txt", ".jsonl") and path.is_file():
        return _text_file(spec, path, tokenizer, count_key)
    if path.exists() or path.suffix:
        what = "no such file" if not path.exists() else f"unknown format {path.suffix}"
        raise fail("--data", spec, f"{what}; pass {SOURCE_HELP}")
    raise fail("--data", spec, f"unknown source; pass {SOURCE_HELP} (bundled: {', '.join(CORPORA)})")


__all__ = ["IDX_DTYPES", "IndexHeader", "TokenSource", "check_spec", "in_memory", "index_pair", "open_source",
           "read_index"]
