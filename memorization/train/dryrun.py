"""`memorize train|run CONFIG --dry-run --world N`: prove that a job fits before it is queued.

The dry run is the run's plan printed: it calls the run's own `memorization.train.run_plan.plan_run` for
every sub-run (each arm of an experiment) on the stated launch (`--world`, `--gpus-per-node`,
`--hardware`), so it shows the grid the launch will take and refuses with the run's line. No process
group and no weights; the data only where the plan depends on it (DP-SGD's rows, eval.mia's sets:
`plan_data`). The model is built on the meta device and sharded exactly as rank 0 of the grid shards
it (`axonn.ProcessGrid.virtual` + `axonn.parallelize`; its parallel plan is reported); the parameter
count of that sharded model goes through the planner's memory and performance models (`axonn.plan`),
so the project has one model of memory. On top of the plan: memory against the hardware preset, the
in-place evaluation's memory and, for a local weights folder, the safetensors headers against the
sharded model. The text report is memorization/train/dryrun_report.py.
"""
from __future__ import annotations

import dataclasses
import json
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

import axonn
from axonn.grid import ProcessGrid
from axonn.lm_head import LossHead
from axonn.plan import get_hardware, load_shape, plan, predict
from axonn.plan.evaluation import eval_memory, eval_time
from axonn.plan.memory import Adapters, local_params, memory_breakdown
from axonn.plan.search import check_inputs
from axonn.plan.volumes import Grid
from axonn.state import check_pretrained
from axonn.swap import parallelize, trainable
from data_pipelines.corpora import CORPORA
from memorization.config import RunConfig, load_run_config
from memorization.experiments import load_experiment
from memorization.mitigations.peft_lora import apply_sharded_lora
from memorization.models import meta_model
from memorization.train.dryrun_report import format_report
from memorization.train.parallel import Launch, example_norms, grid_check, memory_fix, run_adapters
from memorization.train.prepare import prepare_data
from memorization.train.run_plan import plan_run, planned_model_config
from memorize_core import ConfigError, fail

GiB = 2**30
CLUSTERS_FILE = Path(__file__).resolve().parents[1] / "configs" / "clusters.yaml"


def _check_corpus(field: str, spec: str) -> None:
    """A corpus that is a file path must exist (names and hub ids are resolved at run time)."""
    if spec and (spec.endswith((".txt", ".jsonl", ".parquet")) or spec.startswith(("/", "./", "~")))\
            and not spec.startswith("hf:") and not Path(spec).expanduser().exists():
        raise fail(field, spec, "no such file or folder; pass an existing corpus path or a corpus name")


def _cluster_for(hw_name: str) -> str:
    """The cluster in configs/clusters.yaml whose hardware preset this is (else generic)."""
    if CLUSTERS_FILE.is_file():
        for name, entry in (yaml.safe_load(CLUSTERS_FILE.read_text()) or {}).items():
            if isinstance(entry, dict) and entry.get("hardware") == hw_name and name != "generic":
                return name
    return "generic"


def _launch(command: str, config_path: str, dims: Sequence[int], overrides: Sequence[str], world: int,
            gpn: int, hw_name: str) -> dict[str, str]:
    """The exact command lines that start this job."""
    grid = ",".join(map(str, dims))
    tail = " ".join(shlex.quote(o) for o in overrides)
    args = f"{command} {shlex.quote(config_path)} --grid {grid}" + (f" {tail}" if tail else "")
    nodes = max(1, world // gpn)
    out = {"srun": f"srun --nodes={nodes} --ntasks-per-node={min(world, gpn)} python -m memorization {args}",
           "slurm": f"python scripts/slurm.py --cluster {_cluster_for(hw_name)} --nodes {nodes} "
                    f"--config {shlex.quote(config_path)} --grid {grid}" + (f" -- {tail}" if tail else "")}
    if world <= gpn:
        out["torchrun"] = f"torchrun --nproc-per-node {world} -m memorization {args}"
    return out


def _not_here(cfg: RunConfig) -> str | None:
    """Why the run's data cannot be read on this machine (None: it can)."""
    for field, spec in (("data.corpus", cfg.data.corpus), ("data.held_out", cfg.data.held_out)):
        if spec and spec not in CORPORA and not Path(spec).expanduser().exists():
            return f"{field}={spec} is not on this machine"
    return None


_PREPARED: dict[str, Any] = {}


def _prepared(cfg: RunConfig) -> Any:
    """prepare_data, once per data setting in this process (an experiment's sub-runs share their data)."""
    key = repr((cfg.data, cfg.model.name, cfg.model.overrides, cfg.seed))
    if key not in _PREPARED:
        _PREPARED[key] = prepare_data(cfg)
    return _PREPARED[key]


def plan_data(cfg: RunConfig, data: Any = None) -> tuple[Any, str]:
    """(the run's prepared data, or None; what the dry run says of it). The data is prepared as the run
    prepares it when the plan depends on it and it is on this machine: DP-SGD (delta < 1/N, batch <= N,
    the noise for a target epsilon) and eval.mia (at least 2 members and 2 held-out documents). A zoo
    shape's vocabulary needs no data: a corpus BPE's model has data.vocab_size rows (models.run_vocab)."""
    needs = [why for why, on in (("DP-SGD", cfg.trainer.dp.enabled), ("eval.mia", cfg.eval.mia)) if on]
    if not needs:
        return None, "not needed"
    if data is not None:
        return data, f"checked ({len(data.train)} rows; {', '.join(needs)})"
    missing = _not_here(cfg)
    if missing:
        return None, f"not checked: data not on this machine ({missing}; {', '.join(needs)} wait for it)"
    data = _prepared(cfg)
    return data, f"checked ({len(data.train)} rows; {', '.join(needs)})"


def dry_run(cfg: RunConfig, *, world: int, gpus_per_node: int | None = None, grid: str | None = None,
            hardware: Any = "h100", headroom: float = 0.1, command: str = "train",
            config_path: str = "CONFIG", overrides: Sequence[str] = (), out: str | Path | None = None,
            overwrite: bool = False, resume: str | None = None, data: Any = None) -> dict[str, Any]:
    """Check and size one run on `world` GPUs as rank 0 would see it; ConfigError on any problem.

    The checks are the run's own (memorization.train.run_plan.check_run); `out`, `overwrite` and `resume`
    are the run's --out, --overwrite and --resume (OUT is checked only when given); `data` the
    run's prepared rows, where an experiment prepares its own (else counted here when needed)."""
    hw = get_hardware(hardware)
    gpn = hw.gpus_per_node if gpus_per_node is None else gpus_per_node
    t, seq, mode = cfg.trainer, cfg.data.block_len, cfg.parallel_mode
    if isinstance(world, int) and world > gpn > 0 and world % gpn:
        raise fail("--world", world, f"past one node the job has whole nodes: a multiple of "
                   f"--gpus-per-node={gpn}")
    check_inputs(world, gpn, seq, t.batch_size, headroom)
    _check_corpus("data.corpus", cfg.data.corpus)
    _check_corpus("data.held_out", cfg.data.held_out)
    data, data_note = plan_data(cfg, data)
    hf_config, weights, vocab_source = planned_model_config(cfg)
    shape = dataclasses.replace(load_shape(hf_config), name=cfg.model.name)
    serial = meta_model(hf_config)
    # the run's own plan (memorization.train.run_plan.plan_run): the grid the launch takes, every refusal the
    # launched run would make, with the same line
    run_plan = plan_run(cfg, data, launch=Launch(world, gpn, hardware, headroom), spec=grid,
                        model_config=hf_config, out=out, overwrite=overwrite, resume=resume, model=serial)
    dims, chosen_by, precision = run_plan.dims, run_plan.chosen_by, run_plan.trainer.precision
    accum, mb = run_plan.micro_batches, run_plan.micro_batch  # batch over Z x data, micro-batches
    g = Grid(*dims)

    virtual = ProcessGrid.virtual(*dims, rank=0)
    model = parallelize(serial, virtual, mode=mode)
    handle = axonn.engine_of(model)  # just parallelized: the handle is there
    pair, planned = handle.pair_axes, handle.plan  # which module became which parallel layer
    params = trainable(model)
    local = sum(p.numel() for p in params)  # fp32, as the trainer keeps them (meta_model)
    weights_info = check_pretrained(model, weights) if weights is not None else None
    adapters, trained = run_adapters(cfg, hf_config, precision), None
    if adapters is not None:  # the run's adapters on this grid's shards: what the rank trains
        trained = sum(p.numel() for p in trainable(apply_sharded_lora(model, cfg.model.lora,
                                                                       run_plan.lora_targets)))

    norms = example_norms(cfg)  # DP-SGD: ghost clipping's norm pass and buffers, or per-sample gradients
    # the LM head as the launched trainer runs it (the plan's loss_chunk; a model whose
    # head the chunked path does not apply to keeps full logits, an explicit size is refused there)
    head = run_plan.trainer.loss_chunk
    chunk = head if LossHead(model, virtual, head).head is not None else "off"
    mem = {ck: memory_breakdown(shape, g, seq, mb, ck, mode=mode, local=local, precision=precision,
                                example_norms=norms, adapters=adapters, trained=trained, loss_chunk=chunk)
           for ck in (False, True)}
    used = mem[t.activation_checkpointing]
    total, usable = sum(used.values()), hw.memory_bytes * (1.0 - headroom)
    if total > usable:
        raise fail("--grid", ",".join(map(str, dims)), f"needs {total / GiB:.1f} GiB per GPU but "
                   f"{hw.name} has {usable / GiB:.1f} GiB usable ({hw.memory_bytes / GiB:.0f} GiB, "
                   f"{headroom:.0%} headroom); "
                   f"{memory_fix(t, used['weights'] + used['gradients'] + used['optimizer'], usable)}")
    p = predict(shape, g, seq, t.batch_size, hw, gpus_per_node=gpn, micro_batch=mb,
                checkpoint=t.activation_checkpointing, headroom=headroom, mode=mode,
                precision=precision, local=local, adapters=adapters, loss_chunk=chunk, example_norms=norms)
    try:
        accepts = grid_check(cfg, hf_config)  # only grids the run accepts (per-sample DP-SGD: 1,1,1,D)

        def accepted(q: Any) -> bool:
            try:
                accepts(Grid(*q.grid))
            except ConfigError:
                return False
            return True

        top = next(q for q in plan(shape, world, gpn, seq, t.batch_size, hw, strict=True, mode=mode,
                                   precision=precision, loss_chunk=chunk, example_norms=norms,
                                   adapters=adapters) if accepted(q))
        best = {"grid": list(top.grid), "micro_batch": top.micro_batch, "step_s": top.time_s,
                "activation_checkpointing": top.checkpoint_activations}
    except (ConfigError, StopIteration):
        best = None
    tokens = t.batch_size * seq
    evaluation = _evaluation(cfg, shape, g, hw, gpn, mode, precision, local, usable, adapters, trained)
    return {
        "command": command, "config": config_path, "name": cfg.name,
        "model": {"name": cfg.model.name, "params": shape.params, "layers": shape.layers,
                  "hidden": shape.hidden, "heads": shape.heads, "kv_heads": shape.kv_heads,
                  "ffn": shape.ffn, "vocab": shape.vocab, "vocab_source": vocab_source, "mode": mode,
                  "pair_axes": list(pair or ())},
        "grid": {"x": dims[0], "y": dims[1], "z": dims[2], "data": dims[3], "world": world,
                 "nodes": max(1, world // gpn), "gpus_per_node": gpn, "chosen_by": chosen_by},
        "plan": {**planned.summary(), "lines": planned.describe()},
        "hardware": {"name": hw.name, "memory_bytes": hw.memory_bytes, "usable_bytes": usable,
                     "headroom": headroom},
        "batch": {"global": t.batch_size, "seq": seq, "tokens_per_step": tokens, "micro_batch": mb,
                  "micro_batches": accum, "rows_per_rank": mb * accum},
        "precision": precision, "activation_checkpointing": t.activation_checkpointing,
        "rank0": {"params": local, "planner_params": int(local_params(shape, g, mode)),
                  "param_bytes": int(used["weights"]), "grad_bytes": int(used["gradients"]),
                  "optimizer_bytes": int(used["optimizer"]), "z_buffer_bytes": int(used["z_buffers"]),
                  "example_norm_bytes": int(used.get("example_norms", 0)),
                  "example_grad_bytes": int(used.get("example_grads", 0)),
                  "trained_params": local if trained is None else trained,
                  "activation_bytes": {"checkpointing": int(mem[True]["activations"]),
                                       "no_checkpointing": int(mem[False]["activations"])},
                  "total_bytes": int(total), "fits": True},
        "predicted": {"step_s": p.time_s, "tokens_per_s": tokens / p.time_s, "mfu": p.pct_peak / 100,
                      "tflops_per_gpu": p.tflops_per_gpu, "exposed_comm_s": p.exposed_comm_s},
        "planner_best": best, "weights": weights_info, "evaluation": evaluation,
        "checks": ["the run's plan (memorization.train.run_plan.plan_run): OUT and --resume when given, "
                   "tokenizer, LoRA, DP-SGD, activation checkpointing", f"data: {data_note}",
                   "grid product = GPUs", f"grid divides heads, KV heads, hidden, FFN, vocab ({mode})",
                   f"batch {t.batch_size} = {accum} micro-batches x {mb} rows x {dims[2] * dims[3]} "
                   "batch shards (z*data)", f"memory fits {hw.name}"]
        + (["weights: every tensor present with the model's shape"] if weights_info else []),
        "launch": _launch(command, config_path, dims, overrides, world, gpn, hw.name),
    }


def _evaluation(cfg: RunConfig, shape: Any, g: Grid, hw: Any, gpn: int, mode: str, precision: str,
                local: int, usable: float, adapters: Adapters | None = None,
                trained: int | None = None) -> dict[str, Any] | None:
    """Rank 0 while the run scores its model in place (axonn.plan.evaluation): memory of the weight
    shards, AdamW state, KV cache at eval.batch_size, gathered buffers, logits; decode time. A batch
    that does not fit is refused with the largest that does."""
    e = cfg.eval
    if not (e.extraction or e.mia):
        return None
    # full-sequence fp32 logits: MIA scores whole blocks, extraction's verify pass only the suffix
    kw = dict(context=e.prefix, new=e.suffix, seq=cfg.data.block_len if e.mia else e.suffix, mode=mode,
              precision=precision, local=local, adapters=adapters, trained=trained)

    def need(batch: int, keep: bool = False) -> float:
        return sum(eval_memory(shape, g, batch=batch, keep_gathered=keep, **kw).values())

    total = need(e.batch_size)
    if total > usable:
        fits = [b for b in range(e.batch_size - 1, 0, -1) if need(b) <= usable][:1]
        fix = (f"lower it to {fits[0]}" if fits else "no batch fits: use a grid with a larger tensor "
               "split (x, y, z), or turn eval.extraction off and score the export with memorize eval --grid")
        raise fail("eval.batch_size", e.batch_size, f"scoring the trained model needs {total / GiB:.1f} GiB "
                   f"per GPU at this batch but {hw.name} has {usable / GiB:.1f} GiB usable; {fix}")
    docs = 1000
    timing = eval_time(shape, g, hw, docs=docs, batch=e.batch_size, context=e.prefix, new=e.suffix,
                       gpus_per_node=gpn, mode=mode, precision=precision)
    mia = eval_time(shape, g, hw, docs=2 * docs, batch=e.batch_size, context=cfg.data.block_len, new=0,
                    gpus_per_node=gpn, mode=mode, precision=precision)["seconds"] if e.mia else None
    return {"batch": e.batch_size, "prefix": e.prefix, "suffix": e.suffix, "mia_per_1000_pairs_s": mia,
            "bytes": {k: int(v) for k, v in eval_memory(shape, g, batch=e.batch_size, **kw).items()},
            "total_bytes": int(total), "keep_gathered_bytes": int(need(e.batch_size, True)),
            "keep_gathered_fits": need(e.batch_size, True) <= usable,
            "per_1000_docs_s": timing["seconds"], "decode_tokens_per_s": timing["tokens_per_s"],
            "step_s": timing["step_s"]}


def run_configs(command: str, config_path: str, overrides: Sequence[str]) -> tuple[list[RunConfig],
                                                                                   list[RunConfig]]:
    """(the RunConfigs to report: the one of `train`, or an experiment's distinct models; every sub-run
    the command trains, each of which the dry run checks as the run will)."""
    if command == "train":
        rc = load_run_config(config_path, list(overrides))
        return [rc], [rc]
    module, exp = load_experiment(config_path, overrides)
    subs = list(module.run_configs(exp))
    if any(rc.trainer.dp.enabled for rc in subs) and hasattr(module, "run_data"):
        # rows as the experiment prepares them (an injected corpus): DP-SGD's checks count them
        subs = [(rc, d) for rc, d in zip(subs, module.run_data(exp))]
    runs = [dataclasses.replace(exp.base, name=exp.name)]  # names the job and its folder
    # every distinct job a sub-run trains (a family of sizes: each one; an arm whose adapters, DP-SGD
    # or batch change what a rank holds) is reported too
    runs += [sub[0] if isinstance(sub, tuple) else sub for sub in subs]
    seen, out = set(), []
    for rc in runs:
        t = rc.trainer
        key = (rc.model.name, repr(sorted(rc.model.overrides.items())),
               repr(rc.model.lora) if rc.model.lora.enabled else None,
               (t.dp.enabled, t.dp.clipping if t.dp.enabled else None), t.batch_size, t.micro_batch)
        if key not in seen:
            seen.add(key)
            out.append(rc)
    return out, subs


def dry_run_command(command: str, config_path: str, overrides: Sequence[str], *, world: int,
                    gpus_per_node: int | None = None, grid: str | None = None,
                    hardware: Any = "h100", headroom: float = 0.1, configs: Sequence[RunConfig] | None = None,
                    **run: Any) -> list[dict[str, Any]]:
    """Dry-run every model `memorize <command> CONFIG` would train, after checking every sub-run it
    trains (each arm of an experiment) as the run checks it; ConfigError on the first problem.

    `configs` replaces the loaded train config (the CLI's, with --steps applied); `run` passes the
    run's out / overwrite / resume to the checks."""
    reported, subs = run_configs(command, config_path, overrides)
    if configs is not None:
        reported, subs = list(configs), list(configs)
    kw = dict(world=world, gpus_per_node=gpus_per_node, grid=grid, hardware=hardware, headroom=headroom,
              command=command, config_path=config_path, overrides=overrides)
    if command != "train":
        for sub in subs:  # the run checks every sub-run before the first trains: so does its dry run
            rc, data = sub if isinstance(sub, tuple) else (sub, None)
            dry_run(rc, **kw, data=data)
    return [dry_run(rc, **kw, **run) for rc in reported]


def cli_dry_run(args: Any, command: str, cfg: RunConfig | None = None) -> int:
    """`memorize train|run CONFIG --dry-run --world N ...`: print the report(s); 0, or ConfigError.

    `cfg`: the train command's config as the run would train it (--steps, --checkpoint-every)."""
    if not args.dry_run:
        used = "--world" if args.world is not None else "--gpus-per-node/--hardware/--json"
        raise fail(used, args.world, "sizes a job without running it; add --dry-run")
    if args.world is None or args.world < 1:
        raise fail("--world", args.world, "--dry-run needs the job's GPU count, e.g. --world 64")
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        raise fail("--gpus-per-node", args.gpus_per_node, "must be >= 1")
    run = {}
    if command == "train":  # the run's OUT and --resume are checked as the run checks them
        out = args.out or f"runs/{cfg.name}"
        run = {"out": out, "overwrite": args.overwrite, "resume": args.resume}
    reports = dry_run_command(command, args.config, list(args.overrides), world=args.world,
                              gpus_per_node=args.gpus_per_node, grid=args.grid,
                              hardware=args.hardware or "h100",
                              configs=None if cfg is None else [cfg], **run)
    if args.json:
        print(json.dumps(reports[0] if command == "train" else reports, indent=1))
    else:
        print("\n\n".join(format_report(r) for r in reports))
    return 0
