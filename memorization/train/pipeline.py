"""One training run in four named stages, which the CLI, the demo and every experiment compose:

1. `prepare_data(cfg)` (memorization/train/prepare.py): corpus -> tokenizer -> token rows (PreparedData);
2. `start_run(cfg, out, data, ...)`: every check, the model built on its grid, OUT, sinks, the
   Trainer (a `Run`, used as a context manager);
3. `train(run)`: resume, fit, held-out loss;
4. `finish(run)`: export the model, score extraction, write extraction.jsonl and run.json.

`run_training` is the default composition. Per-pass evaluation is a Trainer callback (the
`callbacks` of start_run; see memorization/experiments/passes.py). Every evaluation scores the
trained model where it is, on the run's grid (evals/scoring.py): nothing gathers a serial copy.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch.distributed as dist

from axonn.config import to_dict
from axonn.engine import is_parallel
from axonn.grid import ProcessGrid
from axonn.hooks import Callback, GradientHook
from axonn.plan.fits import check_shape
from axonn.sinks import JsonlSink
from axonn.state import load_pretrained
from axonn.swap import parallelize
from axonn.trainer import Trainer
from axonn.watchdog import Watchdog, start_watchdog
from memorization.config import RunConfig
from memorization.eval.dp_audit import run_audit
from memorization.mitigations.coverage import run_coverage
from memorization.mitigations.dp_sgd import OpacusPrivacy
from memorization.mitigations.ghost_clipping import make_privacy
from memorization.mitigations.goldfish import GoldfishTransform, special_token_ids
from memorization.mitigations.peft_lora import (
    apply_lora,
    apply_sharded_lora,
    export_lora,
    frozen_dtype,
)
from memorization.models import (
    build_model,
    count_params,
    pretrained_config,
    resolve_model_dir,
    trainable_params,
)
from memorization.outputs import remove_entries
from memorization.report import read_metrics
from memorization.tracking import WandbSink
from memorization.train.evaluation import (
    extraction_results,
    membership,
    near_results,
    sampled_results,
    secret_results,
)
from memorization.train.parallel import is_main_process, resolve_grid
from memorization.train.prepare import PreparedData, documents_record, prepare_data
from memorization.train.report import write_run_report
from memorization.train.run_plan import (  # noqa: F401 - RESULT_FILES, check_out_dir: importers read them here
    CHECKPOINTS,
    RESULT_FILES,
    check_out_dir,
    check_out_inputs,
    effective_trainer,
    plan_run,
)
from memorize_core import fail

EXTRACTION_KEYS = ("docs", "exact_match_rate", "rougeL", "token_accuracy", "lcp_mean")  # in run.json


def prepare_out_dir(out: str | Path, overwrite: bool) -> Path:
    """Create `out` for new results (after check_out_dir), clearing old ones when overwrite is set."""
    path = Path(out)
    remove_entries(path, check_out_dir(out, overwrite))  # only the run's own entries; links, not targets
    path.mkdir(parents=True, exist_ok=True)
    return path


def _truncate_metrics(path: Path, step: int) -> None:
    """Keep the metrics lines up to `step`: the resumed run rewrites the rest."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step]
    path.write_text("".join(line + "\n" for line in keep), encoding="utf-8")


@dataclass
class Run:
    """One training run between its stages: built by `start_run`, trained by `train`, closed by `finish`.

    Use it as a context manager (`with start_run(...) as run:`): inside it a collective that fails
    because a peer rank was lost ends the process with the one-line lost-rank message; leaving it
    waits for every rank, stops the watchdog and closes the metric sinks.
    """

    cfg: RunConfig
    data: PreparedData
    out_dir: Path
    trainer: Trainer
    checkpoint: Path | None = None  # the sealed checkpoint `train` resumes from
    privacy: OpacusPrivacy | None = None  # or its subclass GhostPrivacy
    wandb: WandbSink | None = None
    watchdog: Watchdog | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    train_seconds: float = 0.0
    val_loss: float = float("nan")
    _guard: Any = field(default=None, repr=False)  # the watchdog's guard while the run is open

    @property
    def grid(self) -> ProcessGrid:
        """The grid the run trains on (the 1x1x1x1 grid for a serial run)."""
        return self.trainer.grid

    @property
    def is_main(self) -> bool:
        """Rank 0: the rank that writes files."""
        return self.trainer.is_main

    def __enter__(self) -> Run:
        if self.watchdog is not None:
            self._guard = self.watchdog.guard()
            self._guard.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        try:
            if self._guard is not None:
                if exc_type is None:
                    try:
                        dist.barrier()  # everyone is past the last collective before anyone stops watching
                    except RuntimeError as e:
                        self._guard.__exit__(type(e), e, e.__traceback__)  # the lost-rank exit, if so
                        raise
                self._guard.__exit__(exc_type, exc, tb)
        finally:
            if self.watchdog is not None:
                self.watchdog.stop()
            for sink in self.trainer.sinks:
                sink.close()


def start_run(cfg: RunConfig, out: str | Path, data: PreparedData, *, overwrite: bool = False,
              grid: ProcessGrid | None = None, grid_spec: str | None = None, resume: str | None = None,
              progress: bool = True, progress_position: int = 0,
              callbacks: list[Callback] | None = None, gradient_hook: GradientHook | None = None) -> Run:
    """Stage 2: check everything, build the model on its grid, open OUT and the sinks, make the Trainer.

    The run's decision is its plan (memorization.train.run_plan.plan_run, the one every entry point takes):
    bad input (an occupied OUT, a checkpoint of another model, a grid the model cannot split, a
    tokenizer the model cannot take, ...) fails there, before anything is built or written.
    `grid` is an initialised ProcessGrid to train on; without one the grid's X,Y,Z,D come from
    `grid_spec` (the --grid text) or cfg.grid (`auto`: the planner for this config and launch), and
    the ProcessGrid is made once the plan is made (memorization.train.parallel).
    `resume` is "auto" (newest checkpoint in OUT/checkpoints, if any) or a checkpoint folder.
    `callbacks` are Trainer callbacks (axonn.hooks.Callback: on_fit_start, on_step_end,
    on_epoch_end), called on every rank: the hook for per-pass evaluation. `gradient_hook` is another
    objective for the trainer (an unlearning method, memorization/mitigations/unlearning.py); DP-SGD's
    is the config's own, so the two are refused together.
    """
    if gradient_hook is not None and cfg.trainer.dp.enabled:
        raise fail("trainer.dp.enabled", True, "this run trains with its own objective (a gradient hook); "
                   "DP-SGD's clipping and noise are another: turn one off")
    is_main = is_main_process()
    lora = cfg.model.lora
    plan = plan_run(cfg, data, spec=grid_spec, grid=grid, out=out, overwrite=overwrite,
                    resume=resume)  # every decision and refusal; nothing built or written yet
    ckpt = plan.checkpoint
    # streamed weights: built on the meta device, each rank loads its shards (no rank holds them all)
    model = build_model(cfg.model.name, vocab_size=plan.model_config.vocab_size, seed=cfg.seed,
                        overrides=cfg.model.overrides, random_init=cfg.model.random_init,
                        meta=plan.stream_weights)
    grid = resolve_grid(cfg, plan.dims, distributed=plan.distributed, grid=grid)  # the grid from here on
    if lora.enabled:  # the frozen base in its load dtype: bf16 where the run computes in bf16
        dtype = frozen_dtype(plan.trainer.precision)
        model = model.to(dtype) if dtype is not None else model
    if lora.enabled and not plan.sharded_lora:
        model = apply_lora(model, lora, seed=cfg.seed)  # peft keeps its adapters in fp32 over a bf16 base
    tcfg = plan.trainer
    privacy = (make_privacy(tcfg, len(data.train), grid=grid, sigma=plan.noise_multiplier)
               if cfg.trainer.dp.enabled else None)
    if plan.engine:  # the engine's layers (plain HF modules stay for peft at 1,1,1,D and per-sample DP)
        model = parallelize(model, grid, mode=cfg.parallel_mode)
        if plan.stream_weights:
            load_pretrained(model, resolve_model_dir(cfg.model.name))
        if plan.sharded_lora:  # after the load: the base's names are still the serial model's there
            model = apply_sharded_lora(model, lora, plan.lora_targets, seed=cfg.seed)
    tcfg = replace(tcfg, progress=tcfg.progress and progress)  # never mutate the caller's config
    tok, out_dir = data.tokenizer, Path(out)
    trainer = Trainer(model, tcfg, data.train, eval_data=data.held_out,
                      label_transform=GoldfishTransform(cfg.goldfish, seed=cfg.seed,
                                                        special_ids=special_token_ids(tok))
                      if cfg.goldfish.enabled else None,
                      grid=grid, checkpoint_dir=out_dir / CHECKPOINTS,
                      checkpoint_files=lambda d: tok.save_pretrained(d / "tokenizer"),
                      name=cfg.name, progress_position=progress_position, callbacks=callbacks,
                      gradient_hook=privacy if gradient_hook is None else gradient_hook,
                      micro_batches=plan.micro_batches)
    # OUT is touched only now, after every constructor that can refuse (the plan made their refusals
    # already; this order keeps a refusal it missed from costing an earlier run its results)
    if grid.distributed:  # every rank has checked OUT (and the rest) before the main rank writes there
        dist.barrier()
    if resume:  # keep checkpoints and metrics; later results are rewritten
        if is_main:
            out_dir.mkdir(parents=True, exist_ok=True)
            _truncate_metrics(out_dir / "metrics.jsonl", 0 if ckpt is None else
                              json.loads((ckpt / "meta.json").read_text())["step"])
    elif is_main:
        prepare_out_dir(out, overwrite)
    wb = None
    if is_main:
        wb = WandbSink(cfg.wandb, name=cfg.name, out_dir=out_dir, config=to_dict(cfg))
        trainer.sinks = [JsonlSink(out_dir / "metrics.jsonl"), wb]
    return Run(cfg, data, out_dir, trainer, checkpoint=ckpt, privacy=privacy, wandb=wb,
               watchdog=start_watchdog(grid, tcfg.collective_timeout_s))  # None for one process


def train(run: Run) -> list[dict[str, Any]]:
    """Stage 3: resume if asked, fit, and measure the held-out loss; return the per-step history."""
    trainer = run.trainer
    if run.checkpoint is not None:
        trainer.load_checkpoint(run.checkpoint)
    t0 = time.perf_counter()
    run.history = trainer.fit()
    run.train_seconds = time.perf_counter() - t0
    run.val_loss = trainer.evaluate() if run.data.held_out is not None else float("nan")
    return run.history


def finish(run: Run, *, scored: list[Any] | None = None, extra: dict[str, Any] | None = None,
           sampled_rows: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Stage 4: export the model, score extraction, write extraction.jsonl, run.json and the report
    (report.md, report.png); the summary.

    Call it on every rank: exporting and scoring a sharded model are collectives. Extraction runs on
    the trained model where it is, on the run's grid (evals' one scoring path: each batch shard
    decodes its share; nothing gathers the weights). `scored` are extraction results a caller
    already took from the final model on every rank (a per-pass hook's last pass): finish writes
    them instead of extracting again; `extra` adds keys to the summary (run.json), and where it holds
    that hook's "sampled" summary, `sampled_rows` are its rows (sampled.jsonl).
    """
    cfg, trainer = run.cfg, run.trainer
    export(run)
    summary = summarise(run)
    results = scored
    if results is None and cfg.eval.extraction:
        from evals.static_decode import DecodeLog  # deferred: evals +3.2 s import

        log = DecodeLog()
        results = extraction_results(trainer.model, cfg, run.data, grid=run.grid,
                                     progress=trainer.cfg.progress and run.is_main, decode_log=log)
        if log.path == "static":  # the rows the compiled decode got wrong and decoded again, listed
            summary["extraction_decode"] = log.to_dict()
    if results is not None and run.is_main:
        summary.update(_record_extraction(run, results))
    sampled_rows = sampled_rows if "sampled" in (extra or {}) else None
    if cfg.eval.extraction and "sampled" not in (extra or {}):
        sampled = sampled_results(trainer.model, cfg, run.data, grid=run.grid)
        if sampled is not None:
            summary["sampled"], sampled_rows = sampled
    near_rows = None
    if cfg.eval.extraction:
        near = near_results(trainer.model, cfg, run.data, grid=run.grid,
                            progress=trainer.cfg.progress and run.is_main)
        if near is not None:
            summary["near_verbatim"], near_rows = near
    mia_rows = None
    if cfg.eval.mia:
        summary["mia"], mia_rows = membership(trainer.model, cfg, run.data, grid=run.grid)
    if cfg.goldfish.enabled and not run.data.is_chat and run.is_main:
        coverage = run_coverage(cfg, run.data)
        if coverage is not None:
            summary["goldfish_coverage"] = coverage
    if run.data.audit is not None:  # eval.audit: the epsilon lower bound beside the accountant's
        summary["audit"] = run_audit(trainer.model, run.data.audit, epsilon=summary.get("epsilon"),
                                     delta=summary.get("delta") or 0.0, batch_size=cfg.eval.batch_size,
                                     grid=run.grid)
    secrets = secret_results(trainer.model, cfg, run.data,  # eval.secrets: the records' own secrets
                             progress=trainer.cfg.progress and run.is_main)
    if secrets is not None:
        summary["secrets"] = secrets
    if run.data.dedup is not None:
        m = run.data.dedup
        summary["dedup"] = {"documents": m.num_documents, "kept_documents": m.num_kept_documents,
                            "tokens": m.num_tokens, "kept_tokens": m.num_kept_tokens,
                            "removed": {k: v["documents"] for k, v in m.counts.items() if v["spans"]}}
    summary.update(extra or {})
    if run.is_main:
        record = {"summary": summary, "config": to_dict(cfg), "documents": documents_record(cfg, run.data)}
        if run.data.audit is not None:
            record["audit"] = run.data.audit.record()
        if run.data.dedup is not None:  # data.dedup: every removal, the kept copy it duplicated
            run.data.dedup.save(run.out_dir / "dedup.json", overwrite=True)
        (run.out_dir / "run.json").write_text(json.dumps(record, indent=2))
        # per document, as memorize eval writes them: log p_z per scheme and offset; each attack's score
        row_files = {n: rows for n, rows in (("sampled.jsonl", sampled_rows),
                                             ("near_verbatim.jsonl", near_rows), ("mia.jsonl", mia_rows))
                     if rows is not None}
        for name, rows in row_files.items():
            (run.out_dir / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        # the loss curve from metrics.jsonl: a resumed run's history holds only the steps since its resume
        curve = read_metrics(run.out_dir / "metrics.jsonl") or run.history
        write_run_report(run.out_dir, summary, curve, results, sampled_rows, cfg,  # report.md, report.png
                         row_files=tuple(row_files), near_rows=near_rows)
        if run.wandb is not None:
            run.wandb.summary(summary)
            if (run.out_dir / "report.png").is_file():
                run.wandb.log_image("report", run.out_dir / "report.png")
    return summary


def run_training(cfg: RunConfig, out: str | Path, *, data: PreparedData | None = None,
                 **options: Any) -> dict[str, Any]:
    """The default run, the stages in order: prepare data, start the run, train, finish.

    Writes metrics.jsonl, model/, extraction.jsonl and run.json under `out`; `options` are
    start_run's (overwrite, grid, grid_spec, resume, progress, progress_position, callbacks).
    """
    check_out_dir(out, options.get("overwrite", False) or bool(options.get("resume")))  # before the data
    check_out_inputs(cfg, out)  # OUT must not overlap the model, corpus or tokenizer it reads
    if data is None and resolve_model_dir(cfg.model.name) is not None:  # its shape before its tokenizer
        check_shape("model.name", cfg.model.name, pretrained_config(cfg.model.name, cfg.model.overrides))
    data = data or prepare_data(cfg)
    with start_run(cfg, out, data, **options) as run:
        train(run)
        return finish(run)


def export(run: Run) -> Path:
    """The trained model (or the LoRA adapter, or the merged model) and tokenizer in OUT/model."""
    cfg, path = run.cfg, run.out_dir / "model"
    if not cfg.model.lora.enabled:
        return run.trainer.export(path, run.data.tokenizer)
    if run.is_main or is_parallel(run.trainer.model):  # a sharded model exports on every rank
        export_lora(run.trainer.model, path, cfg.model.lora, tokenizer=run.data.tokenizer,
                    base_dir=resolve_model_dir(cfg.model.name), base_name=cfg.model.name)
    return path


def summarise(run: Run) -> dict[str, Any]:
    """The run's summary: what was trained, how long, and its losses (extraction is added by finish)."""
    cfg, trainer, g = run.cfg, run.trainer, run.cfg.goldfish
    distributed = run.grid.distributed
    summary: dict[str, Any] = {
        "name": cfg.name, "loss": "goldfish" if g.enabled else "standard",
        "goldfish_strategy": g.strategy if g.enabled else None,
        "goldfish_k": g.k if g.enabled else None, "goldfish_h": g.h if g.enabled else None,
        # counted at the serial size: a distributed rank's shards by their layouts
        "model": cfg.model.name, "params": count_params(trainer.model),
        "trainable_params": trainable_params(trainer.model),
        # what ran: passes over the data reached (fractional when max_steps stopped mid-pass) and the
        # step budget planned; trainer.epochs is only the budget when max_steps is 0
        "steps": trainer.state.step, "planned_steps": trainer.total_steps,
        "epochs": round(trainer.state.step / trainer.steps_per_epoch, 4), "tokens": trainer.state.tokens,
        "final_train_loss": run.history[-1]["loss"] if run.history else None,
        "val_loss": run.val_loss, "train_seconds": round(run.train_seconds, 2),
    }
    if distributed:
        summary["grid"] = ",".join(map(str, run.grid.dims))
    if run.privacy is not None:
        summary.update(run.privacy.summary(trainer.state.step))  # epsilon, delta, sigma, ...
    return summary


def _record_extraction(run: Run, results: list[Any]) -> dict[str, Any]:
    """Write extraction.jsonl (and a W&B samples table); the summary's extraction figures."""
    from evals import summarize, to_jsonl  # deferred: evals +3.2 s import (scikit-learn, rouge-score)

    (run.out_dir / "extraction.jsonl").write_text(to_jsonl(results), encoding="utf-8")
    stats = summarize(results)
    if run.wandb is not None:
        tok = run.data.tokenizer
        rows = [[str(r.doc), tok.decode(r.prefix_ids), tok.decode(r.target_ids), tok.decode(r.generated_ids),
                 bool(r.exact_match)] for r in results[:20]]
        run.wandb.log_table("samples", ["doc", "prefix", "target", "generated", "exact_match"], rows)
    return {k: stats[k] for k in EXTRACTION_KEYS}

