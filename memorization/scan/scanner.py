"""`memorize scan`: score every training sequence of a corpus for memorization, one forward each.

    memorize scan --model DIR --data SOURCE --prefix 32 --suffix 32 --out OUT [--seq-len 2049]
                  [--offsets start|stride:N|random:K] [--limit N] [--generate] [--format jsonl]
                  [--sampling 't=1.0;t=0.7,top_k=40;top_p=0.9'] [--np-n 1,10,100,1000] [--np-p 0.5]
                  [--near-verbatim D [--nv-distance levenshtein] [--nv-beams 8] [--nv-rows 1000]]

The source is streamed (data_pipelines/token_sources.py, windows cut by data_pipelines/scan_windows.py),
batches of windows go through one teacher-forced forward each (evals/scan.py, the scoring layer, so a
model sharded on any grid under torchrun / srun scores there: batch shards score their share in
lockstep and the main rank writes), and rows are written in parts that make the scan resumable after
SIGKILL (memorization/scan/parts.py); the report comes last (memorization/scan/summary.py). The same
forward gives each row's log p_z per --sampling scheme (Hayes et al. 2024's probabilistic extraction,
evals/sampling.py), summarized in the report as (n, p)-extractable fractions beside greedy exact match.
With --near-verbatim D, after the last part the windows that forward ranks likeliest to lie within D
changes of their suffix are searched for near-copies (memorization/scan/near.py; lower bounds).

Every input is checked before anything is written (flags, OUT and the resume, the model folder, the
source, its dtype and its ids against the vocabulary, the grid): one ConfigError line, exit 2, OUT
untouched.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from itertools import chain, islice
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from axonn.config import MAX_ROWS
from axonn.inference import keep_gathered
from axonn.plan.fits import check_fits, check_shape
from data_pipelines.inject import Manifest
from data_pipelines.scan_windows import (
    Selection,
    Window,
    WindowStats,
    check_selection,
    parse_offsets,
    windows,
)
from data_pipelines.token_sources import TokenSource, check_spec, index_pair, open_source
from evals.metrics import ids_text
from evals.near_verbatim import DEFAULT_BEAMS
from evals.scan import score_windows
from evals.scoring import Scorer
from memorization.config import WANDB_MODES, WandbConfig
from memorization.eval.sections import check_near_verbatim, parse_ns, parse_p, parse_sampling
from memorization.models import context_length, folder_tokenizer, hf_config, load_model
from memorization.outputs import check_inputs, remove_entries, write_files
from memorization.scan.near import NV_ROWS, check_nv_rows
from memorization.scan.near import search as search_near
from memorization.scan.parts import (
    NEAR_SCORE,
    PNGS,
    SCAN_FILES,
    STATE,
    check_scan_out,
    clean_for_resume,
    write_part,
    write_state,
)
from memorization.scan.summary import build_report, dumps, extractable_fractions, markdown, plot
from memorization.tracking import WandbSink
from memorization.train.parallel import inference_grid, plan_inference
from memorize_core import ConfigError, fail


@dataclass
class ScanOptions:
    """What `memorize scan` was asked to do (the command line, as given)."""

    model: str
    data: str
    out: str
    prefix: int = 32
    suffix: int = 32
    seq_len: int | None = None
    offsets: str = "start"
    seed: int = 0
    limit: int | None = None
    dtype: str | None = None  # stored dtype of a raw .bin token file
    count_key: str | None = None  # JSONL key holding each document's duplicate count
    manifest: str | None = None  # data_pipelines.inject manifest: duplicate counts per document
    generate: bool = False
    min_k: float = 0.2
    batch_size: int = 32
    format: str = "parquet"
    part_rows: int = 10000
    top: int = 20
    overwrite: bool = False
    grid: str | None = None
    mode: str = "auto"
    keep_gathered: bool = False
    progress: bool = True
    wandb: str = "disabled"  # offline | online | disabled: the report's summary, plots and top rows
    sampling: str | None = None  # decoding schemes scored per row (None: evals.sampling.DEFAULT_SCHEMES)
    np_n: str | None = None  # the report's numbers of draws n, e.g. "1,10,100,1000" (None: those)
    np_p: float | None = None  # the report's probability p of an (n, p) extraction (None: 0.5)
    near_verbatim: int = 0  # D: bound P(a sample within D changes of the suffix) on the best-ranked rows
    nv_beams: int = DEFAULT_BEAMS  # paths kept per number of changes
    nv_distance: str = "hamming"  # hamming (substituted in place) or levenshtein (+ inserted, deleted)
    nv_rows: int = NV_ROWS  # windows searched: the best by the forward's near_score

    def selection(self) -> Selection:
        """The windows this scan scores."""
        return Selection(self.prefix, self.suffix, self.seq_len, self.offsets, self.seed, self.limit)

    def schemes(self) -> tuple[Any, ...]:
        """The --sampling schemes (evals.sampling.Scheme); ConfigError naming --sampling."""
        return parse_sampling(self.sampling)


# options that decide the rows: a resume must agree on every one (scan_output.check_scan_out)
ROW_OPTIONS = ("prefix", "suffix", "seq_len", "offsets", "seed", "limit", "dtype", "count_key", "manifest",
               "generate", "min_k", "batch_size", "format", "part_rows")


def check_options(o: ScanOptions) -> None:
    """Flag-level checks that need no file: one ConfigError naming the flag, the value and the fix."""
    check_selection(o.selection())
    check_spec(o.data)
    if not isinstance(o.out, str) or not o.out.strip():
        raise fail("--out", o.out, "name the output folder, e.g. --out runs/scan (use --out . for this "
                   "folder)")
    for flag, value, low in (("--batch-size", o.batch_size, 1), ("--part-rows", o.part_rows, 1),
                             ("--top", o.top, 0), ("--seed", o.seed, 0)):
        if value < low:
            raise fail(flag, value, f"must be >= {low}")
    if o.batch_size > MAX_ROWS:
        raise fail("--batch-size", o.batch_size, f"must be <= {MAX_ROWS}; pass e.g. 256")
    if not 0 < o.min_k <= 1:
        raise fail("--min-k", o.min_k, "pass a fraction in (0, 1], e.g. 0.2")
    if o.format not in ("parquet", "jsonl"):
        raise fail("--format", o.format, "choose parquet or jsonl")
    if o.mode not in ("auto", "easy", "paired"):
        raise fail("--mode", o.mode, "choose auto, easy or paired")
    if o.wandb not in WANDB_MODES:
        raise fail("--wandb", o.wandb, f"choose one of {', '.join(WANDB_MODES)}")
    if o.manifest and o.count_key:
        raise fail("--count-key", o.count_key, "and --manifest both give duplicate counts; pass one")
    o.schemes()
    parse_ns(o.np_n)
    parse_p(o.np_p)
    check_near_verbatim(o)
    check_nv_rows(o)


def _files_of(spec: str) -> list[Path]:
    path = Path(spec).expanduser()
    pair = index_pair(spec)
    if pair is not None and pair[1].is_file():
        return [p for p in pair if p.is_file()]
    return [path] if path.exists() else []


def fingerprint(o: ScanOptions) -> dict[str, Any]:
    """Every option that decides the rows, with the identity of the model and data files."""
    folder = Path(o.model).resolve()
    cfg = folder / "config.json"
    weights = sum(p.stat().st_size for p in folder.glob("*.safetensors")) + \
        sum(p.stat().st_size for p in folder.glob("*.bin"))
    conf = hashlib.sha256(cfg.read_bytes()).hexdigest()[:16] if cfg.is_file() else None
    data = [f"{p.resolve()}:{p.stat().st_size}" for p in _files_of(o.data)] or [o.data]
    near = {"near_verbatim": o.near_verbatim} if o.near_verbatim else {}  # its rows carry a near_score
    return {"model_files": f"{folder} config:{conf} weights:{weights}", "data_files": " ".join(data),
            **{k: getattr(o, k) for k in ROW_OPTIONS},
            "sampling": ";".join(sch.name for sch in o.schemes()), **near}  # canonical: t=1 = t=1.0


def duplicate_counts(o: ScanOptions, source: TokenSource) -> dict[int, int] | None:
    """Document -> times in the training set: from --manifest (1 for documents it did not inject), from
    the --count-key of each JSONL line as read, or None."""
    if o.manifest:
        try:
            m = Manifest.from_json(o.manifest)
        except ConfigError as e:
            raise ConfigError(f"--manifest: {e}") from None
        counts = dict.fromkeys(range(m.num_documents), 1)
        for item in m.items:
            for p in item.positions:
                counts[p] = item.count
        return counts
    return source.counts if o.count_key else None


def _check_vocab(o: ScanOptions, source: TokenSource, vocab: int) -> None:
    top = source.max_id()
    if top is not None and top < vocab - 1:
        flag = "--dtype" if source.kind == "bin" else "--data"
        raise fail(flag, o.dtype or o.data, f"stores {source.dtype} tokens (ids up to {top}), which "
                   f"cannot hold this model's vocabulary of {vocab} ids; write the tokens with a wider dtype "
                   "(uint32/int32) or scan with the model they were tokenized for")


TOKEN_FILES = ("indexed", "npy", "bin")


def _tokenizer_top(tok: Any) -> int | None:
    """The largest id the tokenizer can give (added tokens included), None when it cannot say."""
    try:
        return max(len(tok) - 1, max(tok.get_vocab().values(), default=-1))
    except (AttributeError, TypeError, ValueError):
        return None


def _check_source_ids(o: ScanOptions, source: TokenSource, sel: Selection, vocab: int, tok: Any,
                      sep: int | None, start_row: int) -> None:
    """Refuse an id outside the vocabulary anywhere the scan will read, before its first write.

    Token files without --limit: one pass over the memory-mapped ids (one sequential read of the
    file, no tokenizing or scoring). With --limit: the windows it selects, cut once ahead (as many
    as it will score). Text is tokenized by the model's own tokenizer: only one with more ids than
    the model has embeddings can give such an id, and only then are its windows cut ahead (a local
    file read twice). A streamed hf: source is never read twice (that is a second download); its
    batches are checked as they come (_check_ids), so there alone the refusal can follow written
    parts."""
    if source.kind in TOKEN_FILES and o.limit is None:
        bad = source.first_outside(vocab)
        if bad is not None:
            raise fail("--data", o.data, f"holds token id {bad[1]} (document {bad[0]}), outside the model's "
                       f"vocabulary of {vocab}; scan with the model it was tokenized for")
        return
    if source.kind not in TOKEN_FILES:
        top = _tokenizer_top(tok)
        if source.kind == "hf" or (top is not None and top < vocab):
            return
    for w in windows(source, sel, separator=sep, start_row=start_row):
        if w.tokens.max() >= vocab or w.tokens.min() < 0:
            _check_ids(o, [w], vocab)


def _check_ids(o: ScanOptions, batch: list[Window], vocab: int) -> np.ndarray:
    """The batch's windows as one [B, P + S] array; ConfigError on an id outside the vocabulary."""
    ids = np.stack([w.tokens for w in batch])
    if ids.max() >= vocab or ids.min() < 0:
        bad = int(ids.max() if ids.max() >= vocab else ids.min())
        raise fail("--data", o.data, f"holds token id {bad} (row {batch[0].row}+), outside the model's "
                   f"vocabulary of {vocab}; scan with the model it was tokenized for")
    return ids


def _batches(it: Iterable[Window], size: int) -> Iterator[list[Window]]:
    batch: list[Window] = []
    for w in it:
        batch.append(w)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _columns(batch: list[Window], s: dict[str, np.ndarray], source: TokenSource,
             counts: dict[int, int] | None, prefix: int, schemes: tuple[Any, ...]) -> dict[str, list]:
    """One batch's rows as columns (scan_output.schema's names)."""
    docs = [w.doc for w in batch]
    tokens = np.stack([w.tokens for w in batch])
    cols: dict[str, list] = {
        "row": [w.row for w in batch], "sequence": [w.sequence for w in batch],
        "offset": [w.offset for w in batch], "doc": docs, "doc_id": [source.doc_id(d) for d in docs],
        "doc_offset": [w.doc_offset for w in batch],
        "count": [None if counts is None else counts.get(d) for d in docs],
        "exact_match": s["exact_match"].tolist(), "lead": s["lead"].tolist(),
        **{k: s[k].tolist() for k in ("token_accuracy", "suffix_loss", "zlib_ratio", "min_k")}}
    if "continuation" in s:
        cols.update(memorization_score=s["memorization_score"].tolist(), rougeL=s["rougeL"].tolist(),
                    continuation_ids=s["continuation"].tolist())
    cols["logpz_greedy"] = np.where(s["exact_match"], 0.0, -np.inf).tolist()  # also without schemes
    cols.update({f"logpz/{sch.name}": s[f"logpz/{sch.name}"].tolist() for sch in schemes})
    if NEAR_SCORE in s:
        cols[NEAR_SCORE] = s[NEAR_SCORE].tolist()
    cols["prefix_ids"], cols["suffix_ids"] = tokens[:, :prefix].tolist(), tokens[:, prefix:].tolist()
    return cols


def _total(o: ScanOptions, source: TokenSource) -> int | None:
    if o.limit is not None:
        return o.limit
    if parse_offsets(o.offsets)[0] == "start" and o.seq_len is None:
        return source.num_documents  # at most one window per document
    return None


def run_scan(o: ScanOptions) -> dict[str, Any]:
    """Check everything, scan (resuming an interrupted scan of the same command), write OUT; the report.

    Under a launcher with --grid, call it on every rank: every rank scores, rank 0 writes."""
    start = time.perf_counter()
    check_options(o)
    inputs = {"--model": o.model, "--data": o.data, "--manifest": o.manifest}
    check_inputs("--out", o.out, {**inputs, **{f"--data[{i}]": str(p) for i, p in
                                              enumerate(_files_of(o.data))}}, entries=SCAN_FILES)
    config = hf_config("--model", o.model)
    check_shape("--model", o.model, config)
    sel = o.selection()
    ctx = context_length(config)
    if ctx is not None and sel.width > ctx:
        raise fail("--prefix", o.prefix, f"+ --suffix {o.suffix} exceeds the model's context of {ctx} "
                   "positions; shorten them")
    state = check_scan_out(o.out, fingerprint(o), o.overwrite)
    tok = folder_tokenizer(o.model)
    source = open_source(o.data, tokenizer=tok, dtype=o.dtype, count_key=o.count_key)
    vocab = int(config.vocab_size)
    _check_vocab(o, source, vocab)
    counts = duplicate_counts(o, source)
    start_row = int(state["rows"]) if state else 0
    stats = WindowStats()
    sep = tok.eos_token_id if tok is not None and source.kind in ("text", "hf") else None
    _check_source_ids(o, source, sel, vocab, tok, sep, start_row)
    it = windows(source, sel, separator=sep, start_row=start_row, stats=stats)
    first = list(islice(it, o.batch_size))  # the data's refusals come before anything is written
    if first:
        _check_ids(o, first, vocab)
    elif start_row == 0:
        raise fail("--data", o.data, f"gives no window: all {stats.sequences} of its sequences are shorter "
                   f"than --prefix + --suffix = {sel.width} tokens (skipped); shorten them or scan longer "
                   "documents")
    # the grid and mode, as the scan's dry run plans them (auto: the inference objective)
    plan = plan_inference(config, spec=o.grid, model=o.model, batch=o.batch_size, width=sel.width,
                          suffix=o.suffix, mode=o.mode)
    mode = plan.mode
    grid = inference_grid(plan)
    check_fits("--model", o.model, config, shards=grid.dims[0] * grid.dims[1] * grid.dims[2])
    model, _ = load_model("--model", o.model, grid, mode)
    if grid.distributed:  # every rank has passed its checks before rank 0 touches OUT
        torch.distributed.barrier()
    out, main = Path(o.out), grid.rank == 0
    parts = int(state["parts"]) if state else 0
    record = {"fingerprint": fingerprint(o), "parts": parts, "rows": start_row, "complete": False}
    if main:
        if o.overwrite:
            remove_entries(out, [n for n in SCAN_FILES if os.path.lexists(out / n)])
        clean_for_resume(out, parts, o.format)
        write_state(out, record)
    text = (lambda ids: tok.decode(ids)) if tok is not None else ids_text
    total = _total(o, source)
    bar = tqdm(total=None if total is None else max(0, total - record["rows"]), unit="seq", desc="scan",
               disable=not (main and o.progress), smoothing=0.1)
    sc, pending, scanned, schemes = Scorer(model, grid), {}, 0, o.schemes()
    loop = time.perf_counter()  # reading, selecting, scoring and writing: what sequences/s measures
    with keep_gathered(model, o.keep_gathered):
        for batch in chain([first] if first else [], _batches(it, o.batch_size)):
            ids = _check_ids(o, batch, vocab)
            scores = score_windows(model, torch.from_numpy(ids), o.prefix, k=o.min_k, generate=o.generate,
                                   text=text, scorer=sc, schemes=schemes, near=o.near_verbatim)
            scanned += len(batch)
            bar.update(len(batch))
            if main:
                for k, v in _columns(batch, scores, source, counts, o.prefix, schemes).items():
                    pending.setdefault(k, []).extend(v)
                while len(pending["row"]) >= o.part_rows:
                    parts = _flush(out, o, parts, {k: v[:o.part_rows] for k, v in pending.items()}, record)
                    pending = {k: v[o.part_rows:] for k, v in pending.items()}
    bar.close()
    if main and pending.get("row"):
        parts = _flush(out, o, parts, pending, record)
    now = time.perf_counter()
    seconds, loop = now - start, now - loop
    if main and stats.short and o.progress:
        print(f"[scan] skipped {stats.short} of {stats.sequences} sequences shorter than --prefix + --suffix "
              f"= {sel.width} tokens", file=sys.stderr)
    near = None
    if o.near_verbatim:  # every part is written: the search ranks all of them
        with keep_gathered(model, o.keep_gathered):
            near = search_near(o, model, grid, out, text, schemes,
                               by_offset=parse_offsets(o.offsets)[0] == "stride")
    header = {"model": o.model, "data": o.data, "source": source.kind, "args": asdict(o),
              "selection": asdict(sel), "sequences": stats.sequences, "short": stats.short,
              "grid": ",".join(map(str, grid.dims)), "scanned_now": scanned, "seconds": seconds,
              "scan_seconds": loop, "sequences_per_s": scanned / loop if loop else None}
    if not main:
        return header
    report = build_report(out, fmt=o.format, suffix=o.suffix, generate=o.generate, header=header, text=text,
                          top=o.top, schemes=[sch.name for sch in schemes], ns=parse_ns(o.np_n),
                          p=parse_p(o.np_p), by_offset=parse_offsets(o.offsets)[0] == "stride")
    report["summary"].update(sequences_read=stats.sequences, short_skipped=stats.short)
    if near is not None:
        report["near_verbatim"] = near
        report["summary"]["near_extractable"] = extractable_fractions(near)
    _write_report(out, report)
    _log_wandb(o, out, report)
    write_state(out, {**record, "complete": True})
    return report


def _flush(out: Path, o: ScanOptions, parts: int, cols: dict[str, list], record: dict[str, Any]) -> int:
    """Write part `parts` and count it in the state file (in that order); the new part count."""
    write_part(out, parts, cols, o.format, o.generate, [sch.name for sch in o.schemes()],
               near=bool(o.near_verbatim))
    record.update(parts=parts + 1, rows=record["rows"] + len(cols["row"]))
    write_state(out, record)
    return parts + 1


def _log_wandb(o: ScanOptions, out: Path, report: dict[str, Any]) -> None:
    """The report's summary, PNGs and top rows to a W&B run under OUT/wandb (offline unless asked)."""
    if o.wandb == "disabled":
        return
    sink = WandbSink(WandbConfig(mode=o.wandb), name=f"scan-{out.name}", out_dir=out, config=asdict(o))
    try:
        sink.summary({f"scan/{k}": v for k, v in report["summary"].items()})
        for png in PNGS:
            if (out / png).is_file():
                sink.log_image(f"scan/{png.removesuffix('.png')}", out / png)
        cols = ["row", "doc_id", "doc_offset", "lead", "suffix_loss", "prefix", "suffix"]
        sink.log_table("scan/top", cols, [[t[c] for c in cols] for t in report["top"]])
    finally:
        sink.close()


def _write_report(out: Path, report: dict[str, Any]) -> None:
    """report.json, report.md and the PNGs, each moved into OUT only when all are written."""
    tmp = Path(tempfile.mkdtemp(prefix=".scan-", dir=out))
    try:
        pngs = plot(report, tmp)
        write_files(out, {"report.json": dumps(report), "report.md": markdown(report)},
                    replace=("report.json", "report.md"))
        for p in pngs:
            os.replace(p, out / p.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


__all__ = ["ScanOptions", "check_options", "fingerprint", "run_scan", "STATE"]
