"""The `memorize` command line: demo, train, eval, scan (bad input -> one line on stderr, exit 2).

Each command imports what it runs when it runs (the `# deferred` imports below): `import
memorization.cli` takes 0.01 s, while the modules behind the commands import torch and
transformers (memorization.train.pipeline 2.8 s, memorization.train.dryrun 3.4 s on the 2-core CI machine), so
`memorize --help` and argument errors answer at once.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import fields, replace

from axonn.config import MAX_STEPS  # pure Python, no torch
from axonn.launch import LAUNCHERS  # pure Python: the launchers' variables, no torch
from memorize_core import NEAR_DISTANCES, ConfigError, fail


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as a one-line ConfigError."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{self.prog}: {message}; see --help")


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--overwrite", action="store_true", help="replace results already in --out")
    p.add_argument("--grid", default=None, help="X,Y,Z,DATA parallel grid (launch with torchrun), or auto")


def _add_dry_run(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true",
                   help="size and check the job on --world GPUs without running it")
    p.add_argument("--world", type=int, default=None, metavar="N", help="GPUs of the job (with --dry-run)")
    p.add_argument("--gpus-per-node", type=int, default=None, metavar="G",
                   help="with --dry-run (default: the hardware preset's)")
    p.add_argument("--hardware", default=None, help="with --dry-run: axonn-plan preset (default h100)")
    p.add_argument("--json", action="store_true", help="with --dry-run: print JSON")


def _wants_dry_run(args) -> bool:
    return bool(args.dry_run or args.json or args.hardware or args.world is not None
                or args.gpus_per_node is not None)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every subcommand."""
    parser = _Parser(prog="memorize", description="Memorization research on a 4D hybrid-parallel trainer.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    d = sub.add_parser("demo", help="standard vs goldfish loss on Wikipedia leads (the main job)")
    d.add_argument("--out", default="runs/demo", help="output folder (default runs/demo)")
    d.add_argument("--epochs", type=int, default=None, help="epochs per run (default from the config: 60)")
    d.add_argument("overrides", nargs="*", help="config overrides key=value, e.g. trainer.lr=5e-4")
    _add_common(d)

    t = sub.add_parser("train", help="train one run from a YAML config")
    t.add_argument("config", help="YAML run config, e.g. configs/train/tiny-wiki.yaml")
    t.add_argument("--out", default=None, help="output folder (default runs/<name>)")
    t.add_argument("--steps", type=int, default=None, help="optimizer steps (overrides epochs)")
    t.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                   help="write an atomic checkpoint to OUT/checkpoints every N steps "
                        "(trainer.checkpoint_every)")
    t.add_argument("--resume", default=None, metavar="auto|PATH",
                   help="resume from the newest checkpoint in OUT (auto) or from a checkpoint folder")
    t.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                   help="plan the run here, then start it on N local processes with torchrun (one line and "
                        "exit 2 if the plan refuses, nothing started)")
    t.add_argument("overrides", nargs="*", help="config overrides key=value")
    _add_common(t)
    _add_dry_run(t)

    r = sub.add_parser("run", help="run a research experiment (configs/experiments/NAME.yaml)")
    r.add_argument("config", help="experiment YAML, e.g. configs/experiments/goldfish-extreme.yaml")
    r.add_argument("--out", default=None, help="output folder (default runs/<experiment name>)")
    r.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                   help="plan every sub-run here, then start the experiment on N local processes with "
                        "torchrun (one line and exit 2 if a plan refuses, nothing started)")
    r.add_argument("overrides", nargs="*", help="config overrides key=value")
    _add_common(r)
    _add_dry_run(r)

    a = sub.add_parser("aggregate", help="average one experiment's reports over seeds (one folder per seed, "
                       "e.g. run as separate jobs)")
    a.add_argument("reports", nargs="+", metavar="DIR", help="experiment output folders, one seed each")
    a.add_argument("--out", required=True, help="folder for the averaged report.{json,md} and replicates.png")
    a.add_argument("--reference", default="", metavar="ROW",
                   help="row label (a table's first index value) of the paired differences (default: the "
                        "experiment's own, e.g. none or retrain, else the first row others pair with)")
    a.add_argument("--confidence", type=float, default=0.95, help="level of every interval (default 0.95)")
    a.add_argument("--overwrite", action="store_true", help="replace an averaged report already in --out")

    m = sub.add_parser("compare", help="per-document paired tests: does RUN memorize less than REF on the "
                       "same documents? (exact McNemar, bootstrap, paired AUC)")
    m.add_argument("reference", metavar="REF", help="the reference folder (a run, an experiment's "
                   "OUT/runs/NAME, or a memorize eval --out folder), e.g. runs/demo/standard")
    m.add_argument("runs", nargs="+", metavar="RUN",
                   help="folders tested against REF, e.g. runs/demo/goldfish")
    m.add_argument("--out", default=None,
                   help="also write report.json and report.md here (default: print only)")
    m.add_argument("--overwrite", action="store_true", help="replace a comparison already in --out")
    m.add_argument("--n", type=int, default=1000,
                   help="draws of the (n, p)-extractability test (default 1000)")
    m.add_argument("--p", type=float, default=0.5, help="its probability (default 0.5)")
    m.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples (default 1000)")
    m.add_argument("--seed", type=int, default=0, help="seed of the resamples (default 0)")

    x = sub.add_parser("export", help="consolidate a checkpoint into a Hugging Face model folder")
    x.add_argument("checkpoint", help="a checkpoint folder, e.g. OUT/checkpoints/step-00000100")
    x.add_argument("out", help="where to write the save_pretrained folder")
    x.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty OUT, replacing only the files export writes")

    e = sub.add_parser("eval", help="extraction, membership inference and perplexity of a saved model")
    e.add_argument("--model", required=True,
                   help="a Hugging Face model dir (e.g. OUT/model) or a pretrained name (smollm2-135m)")
    e.add_argument("--corpus", default=None,
                   help="extraction corpus: name or file (see data_pipelines.CORPORA), or run:members / "
                        "run:held-out: what the memorize run of --model OUT/model trained on / held out")
    e.add_argument("--mia", action="store_true",
                   help="membership inference: --members vs --non-members, or (neither given) the training "
                        "run's own documents vs its held-out split (run.json beside --model)")
    e.add_argument("--members", default=None, metavar="CORPUS", help="documents the model was trained on")
    e.add_argument("--non-members", default=None, metavar="CORPUS",
                   help="documents it never saw, from the members' distribution (a blind baseline "
                        "flags a shift)")
    e.add_argument("--reference", default=None, metavar="DIR",
                   help="reference model folder or pretrained name (same tokenizer) for the ref_ratio attack")
    e.add_argument("--mia-k", type=float, default=0.2, help="Min-K%% fraction k in (0, 1] (default 0.2)")
    e.add_argument("--bootstrap", type=int, default=1000,
                   help="bootstrap resamples for 95%% CIs of AUC and TPR@1%%FPR (default 1000, 0 = none)")
    e.add_argument("--perplexity", nargs="+", default=None, metavar="CORPUS",
                   help="held-out corpora: token-weighted cross-entropy and perplexity")
    e.add_argument("--prefix", type=int, default=32, help="prefix tokens P (default 32)")
    e.add_argument("--suffix", type=int, default=32, help="suffix tokens S to decode (default 32)")
    e.add_argument("--max-tokens", type=int, default=None,
                   help="cut documents to their first N tokens (default 128, or P+S if larger, "
                        "capped at the model's context)")
    e.add_argument("--tasks", default=None, metavar="NAME[,NAME...]",
                   help="downstream tasks through lm-eval: the bundled offline ones (memorize tasks) or "
                        "lm-eval's own (need network)")
    e.add_argument("--num-fewshot", type=int, default=None, metavar="K",
                   help="in-context examples per task (default: each task's own)")
    e.add_argument("--verbose", action="store_true",
                   help="lm-eval's own log on stderr (default: OUT/lm-eval.log; a temp file without --out)")
    e.add_argument("--limit", type=int, default=0, help="first N documents of every corpus and task only")
    e.add_argument("--batch-size", type=int, default=32)
    e.add_argument("--beams", type=int, default=1, help="beam search width (1 = greedy)")
    e.add_argument("--decode", default="auto", choices=["auto", "static", "kv"],
                   help="greedy decoder of the extraction: auto (the compiled static-cache decode, every "
                        "row checked, on a GPU for a one-process evaluation; else the KV-cache decoder), "
                        "static or kv")
    e.add_argument("--seed", type=int, default=0, help="seed of the bootstrap resamples (default 0)")
    e.add_argument("--out", default=None,
                   help="write report.json, report.md, report.png (and extraction.jsonl, sampled.jsonl, "
                        "near_verbatim.jsonl, mia.jsonl) here (default: print JSON only)")
    e.add_argument("--overwrite", action="store_true", help="replace eval results already in --out")
    e.add_argument("--grid", default=None, metavar="X,Y,Z,D|auto",
                   help="evaluate sharded over this grid (launch with torchrun / srun; default: one process)")
    e.add_argument("--mode", default="auto", choices=["auto", "easy", "paired"],
                   help="parallel layers for --grid (auto: paired for Llama-family: a KV cache of local "
                        "heads)")
    e.add_argument("--keep-gathered", action="store_true",
                   help="with a Z split: gather the weights once and hold them for the whole evaluation")
    _add_sampling(e)
    e.add_argument("--offsets", default="0", metavar="O[,O...]",
                   help="with --corpus: token offsets of the prefix into each document, e.g. 0,16,32 "
                        "(default 0; greedy exact match and (n, p) at each)")
    _add_near(e, "with --corpus: ")
    _add_scan(sub)
    c = sub.add_parser("coverage", help="goldfish mask coverage of duplicate clusters (no training, seconds)")
    c.add_argument("--corpus", required=True, help="corpus name or file (see data_pipelines.CORPORA)")
    c.add_argument("--strategy", default="hash,hash-table,apertus,static",
                   help="comma-separated goldfish strategies and/or none (default: the four hashes/static)")
    c.add_argument("--k", type=int, default=4, help="drop 1 token in k (default 4)")
    c.add_argument("--h", type=int, default=13, help="hash context width (default 13)")
    c.add_argument("--near-copies", type=int, default=0, metavar="N",
                   help="inject N near-copies of --clusters documents and audit them (default: find the "
                        "corpus' own near-duplicate clusters by shared n-grams)")
    c.add_argument("--clusters", type=int, default=8, help="with --near-copies: documents copied (default 8)")
    c.add_argument("--edit-rate", type=float, default=0.05, help="with --near-copies: edits per word (0.05)")
    c.add_argument("--edit-unit", default="word", choices=["word", "token"], help="with --near-copies")
    c.add_argument("--manifest", default=None, help="audit the duplicates of this injection manifest.json "
                   "(--corpus is then the injected corpus)")
    c.add_argument("--seed", type=int, default=0, help="seed of the injection (and of `random`)")
    c.add_argument("--tokenizer", default="gpt2", help="bpe, gpt2 or a tokenizer folder (default gpt2)")
    c.add_argument("--limit", type=int, default=0, help="first N documents of the corpus only")
    c.add_argument("--max-tokens", type=int, default=128, help="cut documents like rows (default 128)")
    c.add_argument("--prefix", type=int, default=32, help="eval prefix P: the suffix starts there (32)")
    c.add_argument("--suffix", type=int, default=32, help="suffix tokens S (default 32)")
    c.add_argument("--ngram", type=int, default=13, help="shared n-gram length for finding clusters (13)")
    c.add_argument("--min-shared", type=float, default=0.5,
                   help="share of a document in shared n-grams to join a cluster (0.5)")
    c.add_argument("--out", default=None, help="write report.json and report.md here")
    c.add_argument("--overwrite", action="store_true", help="replace a report already in --out")
    k = sub.add_parser("tasks", help="the bundled offline downstream tasks (lm-eval task YAMLs)")
    k.add_argument("--path", action="store_true",
                   help="print only their folder, for lm_eval --include_path")
    return parser


def _add_scan(sub) -> None:
    """`memorize scan`: memorized sequences of a whole training corpus, one forward each."""
    s = sub.add_parser("scan", help="scan a training corpus for memorized sequences (one forward each)")
    s.add_argument("--model", required=True, help="a Hugging Face model folder (a zoo name with --dry-run)")
    s.add_argument("--data", default=None, help="bundled corpus, .txt/.jsonl, .npy, raw .bin (--dtype), "
                   "indexed NAME.bin + NAME.idx, or hf:NAME (streamed)")
    s.add_argument("--prefix", type=int, default=32, help="prefix tokens P (default 32)")
    s.add_argument("--suffix", type=int, default=32, help="suffix tokens S (default 32)")
    s.add_argument("--out", default=None, help="output folder: parts/, scan-state.json, report.*")
    s.add_argument("--seq-len", type=int, default=None, metavar="L",
                   help="cut the concatenated documents into L-token training sequences (default: one "
                        "sequence per document)")
    s.add_argument("--offsets", default="start", help="start | stride:N | random:K windows per sequence")
    s.add_argument("--seed", type=int, default=0, help="seed of random:K offsets (default 0)")
    s.add_argument("--limit", type=int, default=None, help="scan the first N windows only")
    s.add_argument("--dtype", default=None, help="token dtype of a raw .bin file, e.g. uint16")
    s.add_argument("--count-key", default=None, metavar="KEY",
                   help="JSONL key holding each document's duplicate count (report by count)")
    s.add_argument("--manifest", default=None, help="injection manifest.json: duplicate counts per document")
    s.add_argument("--generate", action="store_true",
                   help="also decode the non-exact rows greedily: memorization score and RougeL")
    s.add_argument("--min-k", type=float, default=0.2, help="Min-K%% fraction (default 0.2)")
    s.add_argument("--batch-size", type=int, default=32)
    s.add_argument("--format", default="parquet", choices=["parquet", "jsonl"],
                   help="row files (default parquet)")
    s.add_argument("--part-rows", type=int, default=10000, help="rows per part file (the resume unit)")
    s.add_argument("--top", type=int, default=20, help="top memorized windows in the report (default 20)")
    s.add_argument("--mode", default="auto", choices=["auto", "easy", "paired"],
                   help="parallel layers for --grid")
    s.add_argument("--keep-gathered", action="store_true", help="with a Z split: gather the weights once")
    s.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    s.add_argument("--wandb", default="disabled", choices=["offline", "online", "disabled"],
                   help="log the report to W&B (offline: OUT/wandb, `wandb sync` later; default disabled)")
    _add_sampling(s)
    _add_near(s)
    s.add_argument("--nv-rows", type=int, default=1000, metavar="K",
                   help="with --near-verbatim: search the K windows the scan's forward ranks likeliest to be "
                        "near-verbatim (default 1000; the others count by their exact copy's p_z: a lower "
                        "bound)")
    _add_common(s)
    _add_dry_run(s)


def _add_sampling(p: argparse.ArgumentParser) -> None:
    """--sampling, --np-n, --np-p: probabilistic (n, p) extraction from the one forward (scan and eval)."""
    p.add_argument("--sampling", default=None, metavar="SCHEMES",
                   help="decoding schemes scored per sequence as log p_z, ';' between schemes, e.g. "
                        "'t=1.0;t=0.7,top_k=40;top_p=0.9' (the default); '' = greedy only")
    p.add_argument("--np-n", default=None, metavar="N[,N...]",
                   help="numbers of samples n of the (n, p)-extractable fractions (default 1,10,100,1000)")
    p.add_argument("--np-p", type=float, default=None, metavar="P",
                   help="probability p of an (n, p) extraction, in (0, 1) (default 0.5)")


def _add_near(p: argparse.ArgumentParser, where: str = "") -> None:
    """--near-verbatim, --nv-beams, --nv-distance: near-verbatim extraction's lower bound (eval and scan)."""
    p.add_argument("--near-verbatim", type=int, default=0, metavar="D",
                   help=f"{where}also bound, per --sampling scheme, the probability that a sample lies "
                        "within D changed tokens of the suffix (a constrained beam search; 0: off)")
    p.add_argument("--nv-beams", type=int, default=8, metavar="W",
                   help="with --near-verbatim: paths kept per number of changed tokens (default 8)")
    p.add_argument("--nv-distance", choices=NEAR_DISTANCES, default="hamming",
                   help="with --near-verbatim: count changes as tokens substituted in place (hamming, the "
                        "default) or substituted, inserted and deleted (levenshtein: a copy that drops or "
                        "adds a word and goes on verbatim is 2 edits away)")


def _positive(name: str, value: int | None, minimum: int = 1) -> None:
    if value is not None and value < minimum:
        raise fail(name, value, f"must be >= {minimum}")
    if value is not None and value > MAX_STEPS:  # before the dry run and before any folder exists
        raise fail(name, value, f"must be <= {MAX_STEPS:.0e}: even at 1 ms a step that many steps take over "
                   "11 days; no run here could finish")


def cmd_demo(args) -> int:
    """Run the demo."""
    from memorization.demo import run_demo  # deferred: see the module docstring

    _positive("--epochs", args.epochs)
    run_demo(args.out, epochs=args.epochs, overwrite=args.overwrite, overrides=args.overrides,
             grid=args.grid)
    return 0


def cmd_train(args) -> int:
    """Train one run (or, with --dry-run, check and size it: the same refusals)."""
    from memorization.config import load_run_config  # deferred: see the module docstring

    cfg = load_run_config(args.config, args.overrides)
    _positive("--steps", args.steps)
    _positive("--checkpoint-every", args.checkpoint_every)
    if args.resume is not None and args.overwrite:
        raise fail("--resume", args.resume, "cannot be combined with --overwrite (which deletes the "
                   "checkpoints); drop one of them")
    if args.steps:
        cfg = replace(cfg, trainer=replace(cfg.trainer, max_steps=args.steps))
    if args.checkpoint_every:
        cfg = replace(cfg, trainer=replace(cfg.trainer, checkpoint_every=args.checkpoint_every))
    if _wants_dry_run(args):
        from memorization.train.dryrun import cli_dry_run  # deferred: see the module docstring

        return cli_dry_run(args, "train", cfg)
    out = args.out or f"runs/{cfg.name}"
    if args.nproc_per_node is not None:
        from memorization.train.launcher import launch_train  # deferred: see the module docstring

        return launch_train(cfg, args.argv, nproc=args.nproc_per_node, out=out, grid=args.grid,
                            overwrite=args.overwrite, resume=args.resume)
    from memorization.train.pipeline import run_training  # deferred: see the module docstring

    summary = run_training(cfg, out, overwrite=args.overwrite, grid_spec=args.grid, resume=args.resume)
    from memorization.train.parallel import is_main_process  # deferred: see the module docstring

    if is_main_process():
        print(json.dumps(summary, indent=2))
        _warn(summary)
    return 0


def cmd_eval(args) -> int:
    """Extraction, membership inference and/or perplexity of a saved model (memorization.eval.evaluate)."""
    from memorization.eval.evaluate import EvalOptions, run_eval  # deferred: see the module docstring
    from memorization.train.parallel import is_main_process  # deferred: see the module docstring

    report = run_eval(EvalOptions(**{f.name: getattr(args, f.name) for f in fields(EvalOptions)}))
    if is_main_process():
        print(json.dumps(report, indent=2))
        _warn(report)
    return 0


def _warn(result: dict) -> None:
    """The blind baseline's one-line distribution-shift warning, last, so it is not lost above the JSON."""
    warning = (result.get("mia") or {}).get("warning")
    if warning:
        print(warning, file=sys.stderr)


def cmd_scan(args) -> int:
    """Scan a training corpus (or, with --dry-run, size the scan on a cluster preset)."""
    if _wants_dry_run(args):
        from memorization.scan.sizing import cli_scan_dry_run  # deferred: see the module docstring

        return cli_scan_dry_run(args)
    for flag in ("data", "out"):
        if getattr(args, flag) is None:
            raise fail(f"--{flag}", None, "is required to scan (a --dry-run needs neither)")
    from memorization.scan.scanner import ScanOptions, run_scan  # deferred: see the module docstring
    from memorization.train.parallel import is_main_process  # deferred: see the module docstring

    report = run_scan(ScanOptions(**{f.name: getattr(args, f.name) for f in fields(ScanOptions)}))
    if is_main_process():
        print(json.dumps(report.get("summary", report), indent=2))
    return 0


def cmd_export(args) -> int:
    """Write a checkpoint as a serial Hugging Face model folder (memorization.export)."""
    from memorization.export import export_checkpoint  # deferred: see the module docstring

    result = export_checkpoint(args.checkpoint, args.out, overwrite=args.overwrite)
    print(json.dumps(result))
    return 0


def cmd_run(args) -> int:
    """Run one experiment config (a sweep skips runs that already finished)."""
    if _wants_dry_run(args):
        from memorization.train.dryrun import cli_dry_run  # deferred: see the module docstring

        return cli_dry_run(args, "run")
    if args.nproc_per_node is not None:
        from memorization.train.launcher import launch_experiment  # deferred: see the module docstring

        return launch_experiment(args.config, list(args.overrides), args.argv, nproc=args.nproc_per_node,
                                 out=args.out, grid=args.grid)
    from memorization.experiments import run_experiment  # deferred: see the module docstring

    run_experiment(args.config, out=args.out, overrides=args.overrides, overwrite=args.overwrite,
                   grid=args.grid)
    return 0


def cmd_aggregate(args) -> int:
    """Average the reports of one experiment run once per seed (memorization.experiments.replicates)."""
    from memorization.experiments.replicates import aggregate_folders  # deferred: see the module docstring

    aggregate_folders(args.reports, args.out, reference=args.reference, confidence=args.confidence,
                      overwrite=args.overwrite)
    return 0


def cmd_compare(args) -> int:
    """Per-document paired tests of result folders against a reference (memorization.compare)."""
    from memorization.compare import cmd_compare as run  # deferred: scipy and numpy only for this command

    return run(args)


def cmd_coverage(args) -> int:
    """Goldfish mask coverage of a corpus' duplicate clusters, without training."""
    from memorization.mitigations.coverage import cmd_coverage as run  # deferred: see the module docstring

    return run(args)


def cmd_tasks(args) -> int:
    """List the bundled downstream tasks (or print their folder with --path)."""
    from data_pipelines.downstream import TASK_DIR, describe_tasks  # deferred: see the docstring

    if args.path:
        print(TASK_DIR)
        return 0
    for t in describe_tasks():
        print(f"{t['name']:<24} {t['kind']:<6} {t['items']:>6} items  {t['source']}")
    print(f"\nfolder: {TASK_DIR}"
          "\nmemorize eval --model DIR --tasks NAME[,NAME...] [--num-fewshot K] [--limit N]"
          f"\nlm_eval --model hf --model_args pretrained=DIR --include_path {TASK_DIR} --tasks NAME")
    return 0


COMMANDS = {"demo": cmd_demo, "train": cmd_train, "eval": cmd_eval, "run": cmd_run,
            "aggregate": cmd_aggregate, "compare": cmd_compare, "export": cmd_export,
            "tasks": cmd_tasks, "scan": cmd_scan, "coverage": cmd_coverage}


def _main_rank() -> bool:
    """Whether this process is rank 0 of a torchrun / srun / MPI launch (or not launched at all), read
    from the launcher's variables without importing torch (an argument error answers at once)."""
    for _source, rank_var, size_var, _local in LAUNCHERS:
        if rank_var in os.environ and size_var in os.environ:
            return os.environ[rank_var].strip() in ("0", "")
    return True


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line as `main` reads it (ConfigError on a usage error); nothing runs."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # key=value overrides may follow options (argparse stops collecting positionals there)
    stray = [x for x in extra if x.startswith("-") or "=" not in x or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what train --nproc-per-node hands on
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: returns the exit code (2 on bad input, with one line on stderr)."""
    try:
        args = parse_args(argv)
        return COMMANDS[args.command](args)
    except ConfigError as e:
        if _main_rank():  # every rank refuses alike; one line from one process (torchrun adds its summary)
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except RuntimeError as e:
        from axonn.trainer import NonFiniteError  # deferred: see the module docstring

        if not isinstance(e, NonFiniteError):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
