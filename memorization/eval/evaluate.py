"""`memorize eval`: extraction, membership inference and utility (perplexity, lm-eval downstream tasks) of
any Hugging Face model folder.

Every input is validated (flags, output folder, model folders, corpora, tokenization, vocabulary
agreement, member/non-member overlap) before any scoring starts, and the result files are written
only at the end, so a bad input or a crash leaves --out as it was.

With `--grid X,Y,Z,D` (or `auto`) under torchrun / srun the model is evaluated sharded: it is built
on the meta device, parallelized over the grid and its safetensors streamed into each rank's shards
(no rank ever holds the whole model), the reference model likewise; every section runs on every
rank through evals' one scoring path and the main rank writes the same files as a serial run.
"""
from __future__ import annotations

import json
import math
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from axonn.config import MAX_ROWS
from axonn.inference import keep_gathered
from axonn.plan.fits import check_fits, check_shape
from evals import ExtractionResult, to_jsonl
from evals.static_decode import DECODES
from memorization.eval.files import EVAL_FILES, check_eval_out, markdown_report
from memorization.eval.membership import (
    RUN_CORPORA,
    EvalCorpus,
    check_run_corpus,
    eval_corpus,
    mia_corpora,
    run_corpus,
    run_documents,
)
from memorization.eval.plots import best_effort, eval_png
from memorization.eval.sections import (
    EvalOptions,
    check_near_verbatim,
    extraction_section,
    mia_section,
    near_verbatim_section,
    parse_ns,
    parse_offsets,
    parse_p,
    parse_sampling,
    perplexity_section,
    sampled_section,
    wants_sampled,
)
from memorization.eval.utility import check_fewshot, check_tasks, score_tasks
from memorization.models import context_length, hf_config, load_model, model_folder
from memorization.outputs import check_inputs, write_files
from memorization.train.parallel import eval_mode, inference_grid, plan_inference
from memorize_core import fail

# lm-eval's messages name its own CLI (`--metadata`, `--include_path`): say whose they are
LM_EVAL_LOG_HEAD = ("# lm-evaluation-harness's own output during `memorize eval --tasks`; the flags it "
                    "mentions are lm_eval's CLI, not memorize's.\n")
DEFAULT_MAX_TOKENS = 128  # this project's training block length (configs/train/tiny-wiki.yaml)


def check_options(o: EvalOptions) -> None:
    """Flag-level checks that need no file: one ConfigError naming the flag, the value and the fix."""
    if not (o.corpus or o.mia or o.perplexity or o.tasks):
        raise fail("--corpus/--mia/--perplexity/--tasks", None, "nothing to evaluate; pass --corpus CORPUS "
                   "(extraction), --mia (membership inference), --perplexity CORPUS and/or --tasks NAME "
                   "(utility)")
    check_fewshot(o.num_fewshot)
    if o.num_fewshot is not None and not o.tasks:
        raise fail("--num-fewshot", o.num_fewshot, "only applies to downstream tasks; add --tasks NAME")
    for name in ("prefix", "suffix", "batch_size", "beams"):
        if getattr(o, name) < 1:
            raise fail(f"--{name.replace('_', '-')}", getattr(o, name), "must be >= 1")
    if o.batch_size > MAX_ROWS:
        raise fail("--batch-size", o.batch_size, f"must be <= {MAX_ROWS}: no memory holds that many "
                   "sequences at once; pass e.g. 32")
    if o.max_tokens is not None and o.max_tokens < 2:
        raise fail("--max-tokens", o.max_tokens, "must be >= 2 (one context token and one scored token)")
    if o.limit < 0:
        raise fail("--limit", o.limit, "must be >= 0 (0 = every document)")
    if o.tasks is not None:
        o.tasks = ",".join(check_tasks(o.tasks))
    if o.mode not in ("auto", "easy", "paired"):
        raise fail("--mode", o.mode, "choose auto, easy or paired")
    if o.decode not in DECODES:
        raise fail("--decode", o.decode, "choose " + ", ".join(DECODES))
    if o.decode == "static" and o.beams > 1:
        raise fail("--decode", o.decode, f"the static decode is greedy; drop --beams {o.beams} or pass "
                   "--decode auto")
    parse_sampling(o.sampling)
    parse_offsets(o.offsets)
    parse_ns(o.np_n)
    parse_p(o.np_p)
    check_near_verbatim(o)
    if not o.corpus:
        for flag, value, default in (("--sampling", o.sampling, None), ("--offsets", o.offsets, "0"),
                                     ("--np-n", o.np_n, None), ("--np-p", o.np_p, None),
                                     ("--near-verbatim", o.near_verbatim, 0)):
            if value != default:
                raise fail(flag, value, "only applies to extraction; add --corpus CORPUS")
    if not o.mia:
        for flag, value in (("--members", o.members), ("--non-members", o.non_members),
                            ("--reference", o.reference)):
            if value is not None:
                raise fail(flag, value, "only applies to membership inference; add --mia")
        return
    if bool(o.members) != bool(o.non_members):  # neither: the training run's own documents (eval_mia)
        missing = "--members" if not o.members else "--non-members"
        raise fail(missing, None, "--mia takes both --members CORPUS (training documents) and "
                   "--non-members CORPUS (documents of the same distribution the model never saw), or "
                   "neither for a memorize run's OUT/model (its run.json names both)")
    if not 0 < o.mia_k <= 1 or math.isnan(o.mia_k):
        raise fail("--mia-k", o.mia_k, "pass a fraction in (0, 1], e.g. 0.2")
    if o.bootstrap < 0:
        raise fail("--bootstrap", o.bootstrap, "pass the number of resamples, >= 0 (0 = no intervals)")


def _inputs(o: EvalOptions) -> dict[str, str | None]:
    """Every path the evaluation reads (corpus names that are not paths are skipped by check_inputs)."""
    found: dict[str, str | None] = {"--model": o.model, "--reference": o.reference, "--corpus": o.corpus,
                                    "--members": o.members, "--non-members": o.non_members}
    found.update({f"--perplexity[{i}]": p for i, p in enumerate(o.perplexity or [])})
    return found


def _max_tokens(o: EvalOptions, config: Any) -> int:
    """--max-tokens, or the default: 128 (prefix+suffix if larger), never beyond the model's context."""
    ctx = context_length(config)
    last = max(parse_offsets(o.offsets))  # the furthest window ends at last + P + S
    if o.max_tokens is not None:
        if ctx is not None and o.max_tokens > ctx:
            raise fail("--max-tokens", o.max_tokens, f"exceeds the model's context of {ctx} positions; "
                       f"pass at most {ctx}")
        if o.corpus and o.max_tokens < o.prefix + o.suffix:
            raise fail("--max-tokens", o.max_tokens, f"is shorter than --prefix + --suffix = "
                       f"{o.prefix + o.suffix}; raise it or shorten the prefix/suffix")
        if o.corpus and o.max_tokens < last + o.prefix + o.suffix:
            raise fail("--offsets", o.offsets, f"offset {last} + --prefix + --suffix = "
                       f"{last + o.prefix + o.suffix} tokens is beyond --max-tokens {o.max_tokens}: no "
                       "document would reach it; raise --max-tokens or lower the offset")
        return o.max_tokens
    want = max(DEFAULT_MAX_TOKENS, last + o.prefix + o.suffix if o.corpus else 0)
    if ctx is not None and want > ctx:
        if o.corpus and o.prefix + o.suffix > ctx:
            raise fail("--prefix", o.prefix, f"+ --suffix {o.suffix} exceeds the model's context of "
                       f"{ctx} positions; shorten them")
        if o.corpus and last + o.prefix + o.suffix > ctx:
            raise fail("--offsets", o.offsets, f"offset {last} + --prefix + --suffix = "
                       f"{last + o.prefix + o.suffix} tokens exceeds the model's context of {ctx} "
                       "positions; lower the offset")
        want = ctx
    return want


def _check_reference(o: EvalOptions, model: Any, tok: Any, ref: Any, ref_tok: Any) -> None:
    """The reference model must score the same ids: equal vocab_size and, when it has one, tokenizer."""
    a, b = model.config.vocab_size, ref.config.vocab_size
    if a != b:
        raise fail("--reference", o.reference, f"has vocab_size {b} but the target model has {a}; "
                   "use a reference model with the target's tokenizer")
    if ref_tok is None:
        return
    va, vb = tok.get_vocab(), ref_tok.get_vocab()
    if va != vb:
        diff = sorted(set(va.items()) ^ set(vb.items()), key=lambda kv: kv[1])
        raise fail("--reference", o.reference, f"has a different tokenizer ({len(va)} vs {len(vb)} "
                   f"tokens, e.g. {diff[0][0]!r} -> id {diff[0][1]} in one only); use a reference model "
                   "with the target's tokenizer")


def run_eval(o: EvalOptions) -> dict[str, Any]:
    """Validate everything, run the requested sections, write --out (if given); return the report.

    Under a launcher with --grid, call it on every rank: each returns the report, rank 0 writes it."""
    start = time.perf_counter()
    check_options(o)
    out = check_eval_out(o.out, o.overwrite) if o.out else None
    o.model = model_folder("--model", o.model)  # smollm2-135m: its cached folder, made if needed
    if o.mia and o.reference:
        o.reference = model_folder("--reference", o.reference)
    if o.mia and not o.members:
        run_documents(o.model)  # the run's members and non-members exist: refused before any loading
    if o.corpus in RUN_CORPORA:
        check_run_corpus(o.corpus, o.model)
    if o.out:  # the report must not land in (or over) what the evaluation reads
        check_inputs("--out", o.out, _inputs(o), entries=EVAL_FILES)
    config = hf_config("--model", o.model)
    check_shape("--model", o.model, config)  # 10^9 layers, a vocabulary of 0: before anything is built
    max_tokens = _max_tokens(o, config)
    ref_config = hf_config("--reference", o.reference) if o.mia and o.reference else None
    plan = plan_inference(config, spec=o.grid, model=o.model, batch=o.batch_size, width=max_tokens,
                          suffix=o.suffix, mode=o.mode)  # the grid and mode, before anything is built
    mode = plan.mode
    grid = inference_grid(plan)
    check_fits("--model", o.model, config, shards=grid.dims[0] * grid.dims[1] * grid.dims[2])
    if ref_config is not None:
        check_fits("--reference", o.reference, ref_config, shards=grid.dims[0] * grid.dims[1] * grid.dims[2])
    model, tok = load_model("--model", o.model, grid, mode)
    if tok is None:
        raise fail("--model", o.model, "holds no tokenizer; save it next to the model "
                   "(tokenizer.save_pretrained(DIR))")
    ref = None
    if ref_config is not None:
        ref, ref_tok = load_model("--reference", o.reference, grid, eval_mode(o.mode, ref_config))
        _check_reference(o, model, tok, ref, ref_tok)
    vocab = model.config.vocab_size

    def load(flag: str, spec: str, cut: int = max_tokens, **kw: Any) -> EvalCorpus:
        return eval_corpus(flag, spec, tok, vocab, cut, o.limit, **kw)

    extraction = run_corpus(o, load, max_tokens) if o.corpus else None
    if extraction is not None and not any(len(s) >= o.prefix + o.suffix for s in extraction.seqs):
        raise fail("--corpus", o.corpus, f"no document has --prefix + --suffix = {o.prefix + o.suffix} "
                   "tokens; shorten the prefix/suffix or use longer documents")
    sets = mia_corpora(o, load, max_tokens) if o.mia else None
    ppl = [load("--perplexity", spec) for spec in o.perplexity or []]

    report: dict[str, Any] = {"model": o.model, "args": asdict(o), "max_tokens": max_tokens,
                              "grid": ",".join(map(str, grid.dims))}
    if grid.distributed:
        report["mode"] = mode
    results: list[ExtractionResult] = []
    sampled_rows: list[dict[str, Any]] | None = None
    near_rows: list[dict[str, Any]] | None = None
    mia_rows: list[dict[str, Any]] | None = None
    log: Path | None = None
    with keep_gathered(model, o.keep_gathered), keep_gathered(ref, o.keep_gathered and ref is not None):
        if extraction is not None:
            report["extraction"], results = extraction_section(o, model, tok, extraction)
            if wants_sampled(o):
                # beside `extraction` (as a training run's summary has it), which stays the greedy decode's
                report["sampled"], sampled_rows = sampled_section(o, model, extraction)
            if o.near_verbatim:
                report["near_verbatim"], near_rows = near_verbatim_section(o, model, tok, extraction,
                                                                           progress=grid.rank == 0)
        if o.mia:
            report["mia"], mia_rows = mia_section(o, model, tok, ref, sets, progress=grid.rank == 0)
        if ppl:
            report["perplexity"] = [perplexity_section(o, model, c) for c in ppl]
        if o.tasks:  # lm-eval's own output goes to a log beside the report (or a temp file) unless --verbose
            log = None if o.verbose else Path(tempfile.mkstemp(prefix="memorize-lm-eval-", suffix=".log")[1])
            report["tasks"] = score_tasks(model, tok, o.tasks.split(","), num_fewshot=o.num_fewshot,
                                          limit=o.limit or None, batch_size=o.batch_size, grid=grid, log=log)
            if log is not None:
                report["tasks_log"] = str(out / "lm-eval.log") if out is not None else str(log)
    report["seconds"] = time.perf_counter() - start
    if out is not None and grid.rank == 0:
        png = best_effort(eval_png, report, results, sampled_rows, mia_rows, near_rows)
        files: dict[str, str | bytes] = {"report.json": json.dumps(report, indent=2) + "\n"}
        if png is not None:
            files["report.png"] = png
        if extraction is not None:
            files["extraction.jsonl"] = to_jsonl(results)
        for name, rows in (("sampled.jsonl", sampled_rows), ("near_verbatim.jsonl", near_rows),
                           ("mia.jsonl", mia_rows)):
            if rows is not None:
                files[name] = "".join(json.dumps(r) + "\n" for r in rows)
        files["report.md"] = markdown_report(report, "report.png" if png else None, row_files=set(files))
        if log is not None:
            files["lm-eval.log"] = LM_EVAL_LOG_HEAD + log.read_text(encoding="utf-8", errors="replace")
        write_files(out, files, replace=EVAL_FILES)
    if out is not None and log is not None:
        log.unlink(missing_ok=True)  # moved beside the report
    return report
