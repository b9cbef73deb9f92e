"""The one resolved plan of a run: every decision and every refusal, made once, before anything is
built or written.

`plan_run(cfg, data, launch=..., spec=..., out=...)` turns a config, the launch (processes, per node,
hardware: `memorization.train.parallel.Launch`) and, when known, the data into a `RunPlan`: the grid
(`auto` chosen by the planner for this config and launch), the batch split and accumulation, the
checkpoint to resume, DP-SGD's noise multiplier, the membership sets' sizes, the evaluation batch and
the files the run writes. Every entry point takes its decision from it: `start_run` (so `memorize
train`, the demo and every sub-run of an experiment), `memorize run` (every sub-run before anything is
written, again with the prepared data before the first one trains: `check_runs`), `--dry-run`
(memorization/train/dryrun.py prints the plan, for each sub-run) and, through the dry run,
scripts/slurm.py. The constructors after it (the model, LoRA, OpacusPrivacy, the Trainer) take what it
decided and do not decide again. Each refusal is a ConfigError: one line naming the field as the user
writes it, the bad value and the fix; the dry run refuses with the same line as the run because it is
the same call.

What `check_run` (the refusals, given the grid) checks, in order (each section a function below):
1. `check_out`: OUT can take new results; `--resume` names a sealed checkpoint (or `auto`).
2. `check_tokenizer` (memorization.models): a pretrained model's own tokenizer ids.
3. `check_grid`: X*Y*Z*D equals the processes; LoRA's and Opacus' per-sample DP-SGD grids; the grid
   divides heads, KV heads, hidden, FFN and vocab; the batch splits over z*data shards.
4. `check_model`: the model builds (a meta copy, no storage); LoRA's target_modules match modules
   peft can adapt; activation checkpointing is supported; a checkpoint to resume holds every tensor
   of this model with its shape (a LoRA one, saved at a grid of this run's kind: lora.py).
5. `check_dp` (memorization.mitigations.dp_sgd): DP-SGD's settings against the grid and the model (ghost
   clipping sees every parameter) and, once the row count N is known, batch_size <= N, delta < 1/N,
   a reachable target epsilon.
6. `mia_sets` (memorization.train.prepare): with eval.mia, at least 2 members and 2 held-out documents.
"""
from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from axonn import checkpoint
from axonn.compile import resolve as compile_resolve
from axonn.grid import ProcessGrid
from axonn.lm_head import LossHead
from axonn.plan.fits import check_shape
from axonn.trainer import resolve_device, resolve_precision
from data_pipelines import load_tokenizer
from memorization.config import RunConfig
from memorization.mitigations.dp_sgd import check_dp, check_dp_grid
from memorization.mitigations.peft_lora import (
    apply_lora,
    check_lora_resume,
    check_lora_run,
    lora_targets,
    tensor_split,
)
from memorization.models import (
    check_tokenizer,
    is_pretrained,
    meta_model,
    pretrained_config,
    reason,
    resolve_model_dir,
    run_tokenizer,
    run_vocab,
    shallow_config,
    zoo_config,
)
from memorization.models import model_config as memorization_model_config
from memorization.outputs import check_inputs, check_writable, existing_entries
from memorization.train.parallel import (
    Dims,
    Launch,
    check_memory,
    check_run_grid,
    head_setting,
    run_device_type,
    run_dims,
)
from memorization.train.prepare import mia_sets
from memorize_core import ConfigError, fail

RESULT_FILES = ("metrics.jsonl", "run.json", "extraction.jsonl", "sampled.jsonl", "near_verbatim.jsonl",
                "mia.jsonl", "dedup.json", "model", "report.json", "report.md", "report.png", "checkpoints")
CHECKPOINTS = "checkpoints"
# model-config fields a checkpoint must agree on before any work starts
_SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "intermediate_size", "n_embd", "n_layer", "n_head")



@dataclass(frozen=True)
class RunPlan:
    """A run's whole decision: the grid and what chose it, the launch, the model's config, how the batch
    splits (micro-batches per step x rows per rank), the checkpoint to resume from (None: start
    fresh), DP-SGD's noise multiplier (None: DP off or N unknown), the membership sets' sizes (None:
    eval.mia off or data unknown), the evaluation batch and the entries it writes under OUT."""

    dims: Dims
    model_config: Any
    micro_batches: int
    micro_batch: int
    checkpoint: Path | None = None
    noise_multiplier: float | None = None
    chosen_by: str = "--grid"
    launch: Launch | None = None
    mia_sizes: tuple[int, int] | None = None
    eval_batch: int = 0
    files: tuple[str, ...] = ()
    data_checked: bool = False
    distributed: bool = False  # through the engine: several processes, a grid that splits, or a given one
    # how the run is built (start_run reads these and decides nothing again)
    # the effective TrainerConfig: goldfish's budget; precision (bf16 or fp32: auto on the launch's
    # device), compile and the LM head's setting (full logits under a DP-SGD hook) resolved
    trainer: Any = None
    sharded_lora: bool = False  # LoRA on the engine's sharded layers (a tensor split), else peft's
    lora_targets: tuple[str, ...] = ()  # the modules LoRA adapts (serial names), when LoRA is on
    engine: bool = False  # the model's layers swapped for the engine's (parallelize) on its grid
    stream_weights: bool = False  # pretrained weights stream from safetensors into each rank's shards



def run_files(cfg: RunConfig) -> tuple[str, ...]:
    """The entries a run writes under OUT (what --overwrite replaces)."""
    optional = (("extraction.jsonl", cfg.eval.extraction), ("sampled.jsonl", cfg.eval.extraction),
                ("near_verbatim.jsonl", cfg.eval.extraction and cfg.eval.near_verbatim > 0),
                ("mia.jsonl", cfg.eval.mia), ("dedup.json", cfg.data.dedup.enabled))
    skip = {name for name, on in optional if not on}
    return tuple(name for name in RESULT_FILES if name not in skip)


def plan_run(cfg: RunConfig, data: Any = None, *, launch: Launch | None = None, spec: str | None = None,
             grid: ProcessGrid | None = None, model_config: Any = None, out: str | Path | None = None,
             overwrite: bool = False, resume: str | None = None,
             model: torch.nn.Module | None = None, here: bool | None = None) -> RunPlan:
    """The run's plan on `launch` (default: this process's launch, which also checks what only this
    machine answers, e.g. whether torch.compile can run here; `here` says so for a given launch):
    the grid (`grid`, an initialised
    ProcessGrid, as given; else `spec`, the --grid text, or cfg.grid; `auto` chosen by the planner)
    and every refusal (check_run); ConfigError on the first.

    `data`: the run's PreparedData, a row count, or None (the data-dependent checks wait).
    `model_config`: the HF config the run builds (default: from the data's tokenizer, else planned)."""
    here = launch is None if here is None else here
    launch = launch or Launch.current()
    if grid is not None:
        launch = replace(launch, world=grid.world_size)
    if model_config is None:
        _, tok = _rows(data)
        vocab = None if tok is None else run_vocab(cfg.model.name, cfg.data.tokenizer, cfg.data.vocab_size,
                                                   len(tok))
        model_config = (planned_model_config(cfg)[0] if tok is None else
                        memorization_model_config(cfg.model.name, vocab_size=vocab,
                                                  overrides=cfg.model.overrides))
    dims, chosen_by = run_dims(cfg, model_config, spec=spec, grid=grid, launch=launch)
    if here and chosen_by == "--grid":  # an explicit grid launched here must fit a known GPU (auto does)
        check_memory(cfg, model_config, dims, launch)
    checked = check_run(cfg, data, dims, world=launch.world, model_config=model_config, out=out,
                        overwrite=overwrite, resume=resume, model=model)
    distributed = grid.distributed if grid is not None else launch.world > 1 or dims != (1, 1, 1, 1)
    return replace(checked, chosen_by=chosen_by, launch=launch, distributed=distributed,
                   eval_batch=cfg.eval.batch_size, files=run_files(cfg),
                   data_checked=data is not None and not isinstance(data, int),
                   **build_plan(cfg, dims, model_config, distributed=distributed,
                                device_type=run_device_type(cfg, launch, here), here=here))


def build_plan(cfg: RunConfig, dims: Dims, model_config: Any, *, distributed: bool, device_type: str,
               here: bool) -> dict[str, Any]:
    """How the run is built on its grid (RunPlan's build fields): precision, compile, the LM head's
    setting, LoRA's kind and targets, whether the engine's layers and streamed weights are used."""
    t, lora = cfg.trainer, cfg.model.lora
    precision = resolve_precision(t.precision, device_type)
    compile_ = t.compile
    if here:  # what only this machine answers; a DP-SGD hook keeps auto eager (the Trainer's rule)
        compile_ = compile_resolve(t.compile if not t.dp.enabled or t.compile is True else False,
                                   resolve_device(t.device))
    per_sample = t.dp.enabled and t.dp.clipping == "per_sample"
    sharded = lora.enabled and tensor_split(dims)
    # peft's LoRA at 1,1,1,D and Opacus' per-sample DP-SGD keep the plain HF modules, data parallel
    engine = distributed and (not lora.enabled or sharded) and not per_sample
    chunk = head_setting(cfg)  # a DP-SGD hook watches the head as a module: full logits
    return {"trainer": replace(effective_trainer(cfg), precision=precision, compile=compile_,
                               loss_chunk=chunk),
            "sharded_lora": sharded,
            "lora_targets": tuple(lora_targets(meta_model(model_config), lora)) if lora.enabled else (),
            "engine": engine,
            # a pretrained model on the engine's layers loads shard by shard: no rank holds it whole
            "stream_weights": engine and not cfg.model.random_init and is_pretrained(cfg.model.name)}


def effective_trainer(cfg: RunConfig):
    """The trainer config, stretched by k/(k-1) when goldfish trains on a supervised-token budget."""
    t = cfg.trainer
    g = cfg.goldfish
    if g.enabled and g.token_budget:
        factor = g.k / (g.k - 1)
        if t.max_steps:
            return replace(t, max_steps=math.ceil(t.max_steps * factor))
        return replace(t, epochs=math.ceil(t.epochs * factor))
    return t


def check_run(cfg: RunConfig, data: Any, dims: Sequence[int], *, world: int, model_config: Any,
              out: str | Path | None = None, overwrite: bool = False, resume: str | None = None,
              model: torch.nn.Module | None = None) -> RunPlan:
    """Every refusal of the run `cfg` on grid `dims` over `world` processes; ConfigError on the first
    (plan_run's refusals once the grid is known).

    `data` is the run's PreparedData (its rows and tokenizer), a row count, or None when the rows are
    not known (the row-dependent DP-SGD checks wait for them: call again with the data). `model_config`
    is the HF config of the model the run builds (memorization.models.model_config); `model`, if given,
    is a serial meta model of it to inspect (else one is built when needed). `out`/`resume`: the
    run's OUT and --resume (None: not checked, e.g. a dry run without --out).
    """
    rows, tokenizer = _rows(data)
    dims = tuple(dims)
    ckpt = check_out(out, overwrite=overwrite, resume=resume) if out is not None else None
    if out is not None:
        check_out_inputs(cfg, out)
    if tokenizer is not None:
        check_tokenizer(tokenizer, cfg.model.name, spec=cfg.data.tokenizer)  # before any weights load
    accum, micro = check_grid(cfg, dims, world=world, model_config=model_config)
    check_model(cfg, model_config, checkpoint=ckpt, model=model, dims=dims)
    if not run_schemes(cfg) and cfg.eval.extraction and cfg.eval.near_verbatim:
        raise fail("eval.near_verbatim", cfg.eval.near_verbatim, "needs a sampling scheme to bound (greedy "
                   "emits one continuation); set eval.sampling, e.g. t=1.0, or eval.near_verbatim=0")
    sigma = check_dp(effective_trainer(cfg), rows, dims, model_config) if cfg.trainer.dp.enabled else None
    mia = None
    if cfg.eval.mia and tokenizer is not None:  # at least 2 members and 2 held-out documents
        members, nonmembers = mia_sets(cfg, data)
        mia = (len(members), len(nonmembers))
    return RunPlan(dims, model_config, accum, micro, checkpoint=ckpt, noise_multiplier=sigma, mia_sizes=mia)


def run_schemes(cfg: RunConfig) -> tuple[Any, ...]:
    """eval.sampling's decoding schemes (evals.sampling.Scheme); ConfigError naming eval.sampling."""
    from evals.sampling import parse_schemes  # deferred: evals +3.2 s import, and the plan runs once

    try:
        return parse_schemes(cfg.eval.sampling)
    except ConfigError as e:
        raise fail("eval.sampling", cfg.eval.sampling, str(e).split(": ", 1)[-1]) from None


def planned_model_config(cfg: RunConfig) -> tuple[Any, Path | None, str]:
    """(HF config of the model the run will build, its weights folder or None, where the vocab comes
    from), before any data is prepared: for the dry run and an experiment's checks of every sub-run.

    Mirrors memorization.models (build_model, run_tokenizer, check_tokenizer): a zoo shape takes the
    tokenizer's vocabulary (a corpus BPE's target size, data.vocab_size); a pretrained folder keeps
    its own, and a tokenizer that is not the model's is refused here as the run refuses it before it
    loads any weight."""
    name, spec = cfg.model.name, cfg.data.tokenizer
    local = resolve_model_dir(name)
    if local is None:
        if spec in ("auto", "bpe"):  # trained on the corpus at run time: its target size is known
            vocab, source = cfg.data.vocab_size, "data.vocab_size: the corpus BPE's rows (run_vocab)"
        else:
            vocab, source = len(load_tokenizer(spec)), f"tokenizer {spec}"
        return zoo_config(name, vocab, cfg.model.overrides), None, source
    config = pretrained_config(name, cfg.model.overrides)
    run_tokenizer(spec, name, texts=[], vocab_size=cfg.data.vocab_size)  # refuses a foreign tokenizer
    return config, None if cfg.model.random_init else local, f"{local}/config.json"


def check_runs(configs: Sequence[RunConfig], data: Any = None, *, spec: str | None = None) -> None:
    """plan_run for every sub-run of an experiment before the first one trains (`memorize run`).

    Without `data` (before any is prepared) each model's vocabulary is the planned one
    (planned_model_config) and the row-dependent DP-SGD checks wait; an experiment calls it again with
    its prepared data (PreparedData, or a list of one per config) before its first sub-run trains.
    `spec` is the --grid text (None: each config's grid)."""
    many = isinstance(data, (list, tuple))
    launch = Launch.current()
    for i, rc in enumerate(configs):
        plan_run(rc, data[i] if many else data, launch=launch, spec=spec)


def _rows(data: Any) -> tuple[int | None, Any]:
    if data is None or isinstance(data, int):
        return data, None
    return len(data.train), data.tokenizer


# -- 1. OUT and --resume ---------------------------------------------------------------------------
def check_out_dir(out: str | Path, overwrite: bool) -> list[str]:
    """Raise unless `out` can take new results; return the result entries overwrite would replace."""
    check_writable("--out", out)  # before any work: permission, read-only, not a folder, no space
    taken = existing_entries(out, RESULT_FILES)  # a dangling symlink counts (writing would follow it)
    if taken and not overwrite:
        raise fail("--out", str(out), f"already holds results ({', '.join(taken)}); choose a new "
                   "folder or pass --overwrite")
    return taken


def check_out_inputs(cfg: RunConfig, out: str | Path) -> None:
    """OUT is not, and does not lie inside, a folder the run reads (a local model, corpus or tokenizer),
    and none of those lies inside a result entry --overwrite would replace (OUT/model, ...)."""
    d = cfg.data
    inputs = {"model.name": resolve_model_dir(cfg.model.name), "data.corpus": d.corpus,
              "data.held_out": d.held_out or None, "data.tokenizer": d.tokenizer}
    check_inputs("--out", out, inputs, entries=RESULT_FILES)


def resolve_resume(resume: str | None, out: str | Path) -> Path | None:
    """'auto' -> the newest sealed checkpoint in OUT/checkpoints (None: start fresh); else a sealed path."""
    if not resume:
        return None
    if resume == "auto":
        found = checkpoint.latest_complete(Path(out) / CHECKPOINTS)
        if found is None:
            print(f"[resume] no complete checkpoint in {Path(out) / CHECKPOINTS}; starting from step 0",
                  file=sys.stderr)
    else:
        found = Path(resume)
    if found is not None:  # sealed, parseable, every shard's sha256 right: before any work starts
        checkpoint.read_meta(found, verify=True)
    return found


def check_out(out: str | Path, *, overwrite: bool = False, resume: str | None = None) -> Path | None:
    """OUT can take the run's results (a resume keeps them); the checkpoint to resume from, if any."""
    check_out_dir(out, overwrite or bool(resume))
    return resolve_resume(resume, out)


# -- 3. the grid -----------------------------------------------------------------------------------
def check_grid(cfg: RunConfig, dims: Dims, *, world: int, model_config: Any) -> tuple[int, int]:
    """X*Y*Z*D = the processes, LoRA / DP-SGD grids, the model's shapes, the batch split; returns
    (micro-batches per step, rows per rank per micro-batch)."""
    x, y, z, d = dims
    # what the config cannot do on this grid is named before the launch's process count
    if cfg.model.lora.enabled:  # dropout on a tensor split, or an adapter export without a base on disk
        check_lora_run(cfg, dims)
    if cfg.trainer.dp.enabled:  # DP-SGD: per_sample serial or 1,1,1,D only
        check_dp_grid(cfg.trainer.dp, dims)
    if x * y * z * d != world:
        raise fail("--grid", ",".join(map(str, dims)), f"x*y*z*data={x * y * z * d} but the job has {world} "
                   f"process(es); launch {x * y * z * d} (torchrun --nproc-per-node {x * y * z * d}, or "
                   f"--world {x * y * z * d} in a dry run) or change the grid")
    return check_run_grid(cfg, dims, model_config)  # LoRA / DP-SGD grids, the model's shapes, the batch


# -- 4. the model ----------------------------------------------------------------------------------
def check_model(cfg: RunConfig, model_config: Any, *, checkpoint: Path | None = None,
                model: torch.nn.Module | None = None, dims: Dims | None = None) -> None:
    """What only the model's structure answers (on a meta copy: no weights, no storage); `dims` is the
    run's grid (a LoRA checkpoint resumes at a grid of its own kind)."""
    lora, t = cfg.model.lora, cfg.trainer
    check_shape("model.name", cfg.model.name, model_config)  # before a meta build of 10^9 layers
    if model is None:
        model = _meta(cfg, model_config)
    if t.activation_checkpointing and not getattr(model, "supports_gradient_checkpointing", False):
        raise fail("trainer.activation_checkpointing", True, f"{type(model).__name__} does not support "
                   "gradient checkpointing; use a Hugging Face causal LM or set it to false")
    trains = model  # what the Trainer receives: peft's model where peft adapts it (not on a tensor split)
    if lora.enabled:  # peft's own refusals, on a fresh meta copy (peft wraps the model it is given)
        # peft's check is structural (which modules its targets name), and wrapping a 405B model takes
        # a minute: two blocks answer it, unless a checkpoint must be matched tensor by tensor
        shape = model_config if checkpoint is not None else shallow_config(model_config)
        with warnings.catch_warnings(), torch.device("meta"):  # a throwaway copy, adapters on meta too
            warnings.simplefilter("ignore", FutureWarning)  # its FutureWarnings would precede our line
            model = apply_lora(_meta(cfg, shape), lora, seed=cfg.seed)
        if dims is None or not tensor_split(dims):
            trains = model
    check_trainer(cfg, trains)
    if checkpoint is not None:
        check_resume_fits(checkpoint, model, dims=dims if lora.enabled else None)


def check_trainer(cfg: RunConfig, model: torch.nn.Module) -> None:
    """The Trainer's own refusal, made here so that it comes before OUT is touched (and in a dry run):
    the chunked LM head on this model and hook (compile's: build_plan)."""
    t = cfg.trainer
    # a DP-SGD hook watches the head as a module (per-example hooks): the Trainer's hook_ok
    LossHead(model, ProcessGrid.serial(device="cpu"), t.loss_chunk, hook_ok=not t.dp.enabled)


def _meta(cfg: RunConfig, model_config: Any) -> torch.nn.Module:
    try:
        return meta_model(model_config)
    except Exception as e:  # e.g. a negative size passes the config but not the layers
        raise fail("model.overrides", cfg.model.overrides, f"cannot build a {cfg.model.name} model "
                   f"({reason(e)}); fix or drop the override") from None


def check_resume_fits(ckpt: Path, model: torch.nn.Module, dims: Dims | None = None) -> None:
    """ConfigError when the checkpoint is of another model (shapes, or LoRA on / off): every tensor the
    trainer will load is in it with its shape, the refusal axonn.checkpoint.load would make later.
    With `dims` (a LoRA run's grid; `model` its meta peft copy) the LoRA rules: check_lora_resume."""
    meta = checkpoint.read_meta(ckpt, verify=False)
    saved = meta.get("model_config") or {}
    mine = model.config.to_dict()
    for key in _SHAPE_KEYS:
        if key in saved and saved[key] != mine.get(key):
            raise fail("--resume", str(ckpt), f"was saved from a model with {key}={saved[key]}, this run "
                       f"builds {key}={mine.get(key)}; resume with the same model and data config")
    if dims is not None:
        check_lora_resume(ckpt, meta, model, dims)
    else:
        checkpoint.check_fits(ckpt, meta, model)


__all__ = ["RunPlan", "check_grid", "check_model", "check_out", "check_out_dir", "check_out_inputs",
           "check_resume_fits", "check_run", "check_runs", "check_trainer", "effective_trainer", "plan_run",
           "planned_model_config", "resolve_resume", "run_files", "run_schemes"]
