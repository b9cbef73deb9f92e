"""From `--grid X,Y,Z,D` (or `auto`) to the run's ProcessGrid, validated before any collective.

A run's grid is decided here, the same way for the launched run, its dry run, `memorize eval` and the
Slurm writer: `Launch` is where the job runs (processes, processes per node, hardware preset: the
current launch's from its environment, or the dry run's `--world/--gpus-per-node/--hardware`);
`run_dims` reads the grid a caller passes in, else the `--grid` text (`grid_spec`: it wins over the
config's `grid` key), and `auto` is `choose_grid`: the planner's predicted-fastest grid that runs this
config as written (its micro-batch, activation checkpointing, parallel mode and precision) and fits
the launch's hardware. memorization.train.run_plan.plan_run checks those X,Y,Z,D against the model and the
launch (no collective), and `resolve_grid` makes the ProcessGrid: a single process that asks for no
split trains on `ProcessGrid.serial()` (the 1x1x1x1 grid: no process group, every collective a no-op);
anything else initialises torch.distributed.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

import axonn
from axonn.grid import ProcessGrid, model_dims, parse_grid, validate_grid_for_model
from axonn.launch import launch_env
from axonn.plan import get_hardware, load_shape
from axonn.plan.choose import Inference, Train, train_cost
from axonn.plan.choose import choose_grid as choose
from axonn.plan.evaluation import eval_memory
from axonn.plan.hardware import PRESETS
from axonn.plan.volumes import Grid, default_mode
from axonn.trainer import resolve_device, resolve_precision
from memorization.mitigations.dp_sgd import check_dp_grid
from memorization.mitigations.peft_lora import check_lora_grid, planner_adapters
from memorization.models import meta_model
from memorize_core import ConfigError, fail

if TYPE_CHECKING:
    from memorization.config import RunConfig

SERIAL = ("", "1,1,1,1", "1,1,1", "1")


def launched_world_size() -> int:
    """World size announced by torchrun / srun / MPI (1 when started as a plain process)."""
    return launch_env().world_size


def wants_grid(spec: str | None) -> bool:
    """True when the run must go through the engine (a grid that splits, or a multi-process launch;
    `auto` in one process is the 1x1x1x1 grid: serial)."""
    return (spec or "") not in (*SERIAL, "auto") or launched_world_size() > 1


def grid_spec(arg: str | None, cfg: RunConfig) -> str:
    """The run's grid as written: `--grid` (`arg`) wins over the config's `grid` key."""
    return cfg.grid if arg is None else arg


Dims = tuple[int, int, int, int]


def detect_hardware() -> str:
    """The hardware preset of this process's accelerator: `local` (this machine, calibrated) without
    CUDA; else the preset of the same GPU and memory (H100 80 GB -> h100, GH200's 96 GB -> alps-h100,
    A100 -> perlmutter-a100, MI250X -> frontier-mi250x); any other GPU by its name (auto refuses it)."""
    if not torch.cuda.is_available():
        return "local"
    props = torch.cuda.get_device_properties(0)
    name, gib = props.name.upper(), props.total_memory / 2**30
    if "MI250" in name:
        return "frontier-mi250x"
    if "A100" in name:
        return "perlmutter-a100"
    if "H100" in name or "H200" in name:
        return "alps-h100" if gib > 88 else "h100"
    return props.name


@dataclass(frozen=True)
class Launch:
    """Where a job runs: its processes, processes per node and hardware preset (axonn.plan), with the
    memory headroom the planner keeps free. The launched run reads it from its environment
    (`Launch.current`); a dry run states it (`--world`, `--gpus-per-node`, `--hardware`)."""

    world: int
    gpus_per_node: int
    hardware: Any  # a preset name, "local", or an axonn.plan Hardware
    headroom: float = 0.1

    @classmethod
    def current(cls) -> Launch:
        """This process's launch (torchrun / srun / MPI, or one plain process) on this machine."""
        world = launched_world_size()
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("SLURM_NTASKS_PER_NODE", world)))
        return cls(world, max(1, per_node), detect_hardware())

    def hw(self) -> Any:
        """The planner's Hardware for this launch."""
        if isinstance(self.hardware, str) and self.hardware != "local" and self.hardware not in PRESETS:
            raise fail("--grid", "auto", f"no hardware preset for the GPU {self.hardware!r}; pass an "
                       "explicit --grid X,Y,Z,D (a dry run with --hardware NAME sizes one)")
        return get_hardware(self.hardware)


def hardware_device(hardware: Any) -> str:
    """The device type of a hardware preset (a name or an axonn.plan Hardware): the CPU profile
    `local` (and its calibrated variants) is cpu, every other preset a GPU."""
    return "cpu" if str(getattr(hardware, "name", hardware)).startswith("local") else "cuda"


def precision_for(trainer_precision: str, hw: Any) -> str:
    """The activation precision a run on hardware preset `hw` computes in (axonn.trainer's rule: auto is
    bf16 on GPUs, fp32 on the CPU profile)."""
    return resolve_precision(trainer_precision, hardware_device(hw))


def run_device_type(cfg: RunConfig, launch: Launch, here: bool) -> str:
    """The device type the run computes on: this machine's trainer.device for a launch here, else the
    launch's hardware."""
    return resolve_device(cfg.trainer.device).type if here else hardware_device(launch.hardware)


def memory_fix(t: Any, state: float = 0.0, usable: float = float("inf")) -> str:
    """What to change when memory does not fit (`state`: weights + gradients + optimizer bytes)."""
    if state > usable:
        return (f"the parameters, gradients and optimizer state alone need {state / 2**30:.1f} GiB: split "
                "them over more GPUs (a larger x*y*z) or add nodes")
    if not t.activation_checkpointing:
        return "set trainer.activation_checkpointing=true, lower trainer.micro_batch or add nodes"
    return "lower trainer.micro_batch, add nodes, or pick a grid with a larger z"


def run_adapters(cfg: RunConfig, model_config: Any, precision: str) -> Any:
    """The planner's view of the run's LoRA adapters (axonn.plan.memory.Adapters; None without LoRA)."""
    lora = cfg.model.lora
    return planner_adapters(lora, meta_model(model_config), precision) if lora.enabled else None


def eval_bytes(cfg: RunConfig, shape: Any, g: Any, mode: str, precision: str, local: float | None = None,
               adapters: Any = None) -> float:
    """Peak bytes per rank while the run scores its model in place (axonn.plan.evaluation): 0 when it
    scores nothing. MIA scores whole blocks (full-sequence logits), extraction's verify pass the suffix."""
    e = cfg.eval
    if not (e.extraction or e.mia):
        return 0.0
    return sum(eval_memory(shape, g, batch=e.batch_size, context=e.prefix, new=e.suffix,
                           seq=cfg.data.block_len if e.mia else e.suffix, mode=mode, precision=precision,
                           local=local, adapters=adapters).values())


def head_setting(cfg: RunConfig) -> int | str:
    """The LM-head setting the trainer runs with: trainer.loss_chunk, except that a DP-SGD hook watches
    the head as a module (per-example hooks), so its run keeps the full logits (axonn.lm_head)."""
    return "off" if cfg.trainer.dp.enabled else cfg.trainer.loss_chunk


def example_norms(cfg: RunConfig) -> bool | str:
    """How the run forms per-example gradient norms, as the planner prices them (axonn.plan.model.predict's
    `example_norms`): "ghost" for DP-SGD's ghost clipping (a norm pass, norm buffers), "materialized" for
    Opacus' per-sample gradients (one gradient per row and parameter), False without DP-SGD."""
    dp = cfg.trainer.dp
    if not dp.enabled:
        return False
    return "ghost" if dp.clipping == "ghost" else "materialized"


def _train_objective(cfg: RunConfig, model_config: Any, shape: Any, precision: str) -> Train:
    """The chooser's training objective of this config as written (its in-place scoring included)."""
    t, mode = cfg.trainer, cfg.parallel_mode
    adapters = run_adapters(cfg, model_config, precision)
    return Train(seq=cfg.data.block_len, batch=t.batch_size,
                 micro_batch=lambda g: t.accumulation(g.z * g.data)[1],
                 checkpoint=t.activation_checkpointing, precision=precision, adapters=adapters,
                 loss_chunk=head_setting(cfg), example_norms=example_norms(cfg),
                 extra_bytes=lambda g: eval_bytes(cfg, shape, g, mode, precision, adapters=adapters))


def check_memory(cfg: RunConfig, model_config: Any, dims: Dims, launch: Launch) -> None:
    """An explicit grid launched on a known GPU preset fits its memory (the planner's estimate, as for
    `auto`); ConfigError naming --grid otherwise. On the CPU (`local`) there is nothing to check."""
    if not (isinstance(launch.hardware, str) and launch.hardware in PRESETS):
        return
    hw = launch.hw()
    shape = dataclasses.replace(load_shape(model_config), name=cfg.model.name)
    objective = _train_objective(cfg, model_config, shape, precision_for(cfg.trainer.precision, hw))
    _, need = train_cost(shape, Grid(*dims), hw, objective, mode=cfg.parallel_mode,
                         gpus_per_node=min(launch.gpus_per_node, launch.world), headroom=launch.headroom)
    usable = hw.memory_bytes * (1.0 - launch.headroom)
    if need > usable:
        raise fail("--grid", ",".join(map(str, dims)), f"needs {need / 2**30:.1f} GiB per GPU but {hw.name} "
                   f"has {usable / 2**30:.1f} GiB usable ({launch.headroom:.0%} headroom); "
                   f"{memory_fix(cfg.trainer)}")


def check_run_grid(cfg: RunConfig, dims: Dims, model_config: Any) -> tuple[int, int]:
    """Every refusal of grid `dims` that depends on the grid alone (run_plan.check_grid adds the process
    count): adapter dropout or Opacus' per-sample gradients on a weight split, a grid that does not divide
    the model's heads, KV heads, hidden, FFN and vocab, a batch it cannot split; returns (micro-batches
    per step, rows per rank per micro-batch)."""
    if cfg.model.lora.enabled:  # a switch's module is entered only when on (tests/test_decision_walk)
        check_lora_grid(cfg.model.lora, dims)
    if cfg.trainer.dp.enabled:
        check_dp_grid(cfg.trainer.dp, dims)
    validate_grid_for_model(dims, model_config, cfg.parallel_mode)
    return cfg.trainer.accumulation(dims[2] * dims[3])


def grid_check(cfg: RunConfig, model_config: Any) -> Callable[[Any], None]:
    """check_run_grid as a check of a planner Grid: `grid: auto` and the dry run's suggestion weigh only
    the grids the run accepts."""
    def check(g: Any) -> None:
        check_run_grid(cfg, (g.x, g.y, g.z, g.data), model_config)
    return check


def choose_grid(cfg: RunConfig, model_config: Any, launch: Launch) -> Dims:
    """`grid: auto`: the planner's one chooser (axonn.plan.choose) with the training objective: the
    predicted-fastest grid of `launch.world` processes that runs this config as written (micro-batch,
    activation checkpointing, parallel mode, precision, LoRA, the LM head) and fits in memory, its
    in-place scoring included."""
    t, mode = cfg.trainer, cfg.parallel_mode
    hw = launch.hw()
    shape = dataclasses.replace(load_shape(model_config), name=cfg.model.name)
    precision = precision_for(t.precision, hw)

    objective = _train_objective(cfg, model_config, shape, precision)
    try:
        return choose(shape, launch.world, launch.gpus_per_node, hw, objective, mode=mode,
                      headroom=launch.headroom, check=grid_check(cfg, model_config)).grid
    except ConfigError as e:
        if "memory" in str(e):  # the trainer's own ways out of memory
            raise fail("--grid", "auto", f"{str(e).split(': ', 1)[-1]}; {memory_fix(t)}") from None
        raise


def inference_dims(config: Any, launch: Launch, *, batch: int, width: int, suffix: int, mode: str,
                   windows: int = 1000) -> tuple[Dims, str]:
    """`--grid auto` of `memorize eval` and `memorize scan`: the one chooser with the inference objective
    (weights and activations, no optimizer state), so both pick the same grid for the same model,
    launch and batch; (X,Y,Z,D, what chose it)."""
    hw = launch.hw()
    shape = load_shape(config)
    mode = mode if mode != "auto" else default_mode(shape)
    objective = Inference(batch=batch, width=width, suffix=suffix, windows=windows,
                          precision=precision_for("auto", hw))
    got = choose(shape, launch.world, launch.gpus_per_node, hw, objective, mode=mode,
                 headroom=launch.headroom,
                 check=lambda g: validate_grid_for_model((g.x, g.y, g.z, g.data), config, mode))
    return got.grid, f"{got.chosen_by} on {hw.name}"


def run_dims(cfg: RunConfig, model_config: Any, *, spec: str | None = None, grid: ProcessGrid | None = None,
             launch: Launch | None = None) -> tuple[Dims, str]:
    """(the run's X,Y,Z,D, what chose them) before anything is built: `grid`'s; else `spec` (the --grid
    text, or cfg.grid) parsed, `auto` asking the planner (choose_grid) about this config on `launch`
    (default: this process's). Whether it fits the model and the launch is memorization.train.run_plan'
    question."""
    if isinstance(grid, ProcessGrid):
        return grid.dims, "the given process grid"
    text = grid_spec(spec, cfg)
    if text == "auto":
        launch = launch or Launch.current()
        return choose_grid(cfg, model_config, launch), f"the performance model ({launch.hw().name})"
    return ((1, 1, 1, 1) if text in SERIAL else parse_grid(text)), "--grid"


def resolve_grid(cfg: RunConfig, dims: Dims, *, distributed: bool,
                 grid: ProcessGrid | None = None) -> ProcessGrid:
    """The run's ProcessGrid once its plan is made (run_plan.plan_run: `dims`, whether it is
    `distributed`): `grid` as given; else the serial grid on cfg.trainer.device; else torch.distributed
    initialised on `dims` (every collective bounded by trainer.collective_timeout_s)."""
    if isinstance(grid, ProcessGrid):
        return grid
    if not distributed:
        return ProcessGrid.serial(device=resolve_device(cfg.trainer.device))
    return init_grid(dims, timeout_s=cfg.trainer.collective_timeout_s)


def init_grid(dims: Dims, timeout_s: float | None = None) -> ProcessGrid:
    """torch.distributed initialised on `dims` (every collective bounded by `timeout_s`, default
    axonn's); gloo ranks that share the CPU get one thread each unless the user said otherwise."""
    if not torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local)))
    return axonn.init(*dims) if timeout_s is None else axonn.init(*dims, timeout_s=timeout_s)


def eval_mode(mode: str, config: Any) -> str:
    """An evaluation's parallel mode: `mode`, with auto = the planner's default for the model (paired
    where its blocks pair: heads split, a KV cache of local heads; else easy)."""
    return mode if mode != "auto" else default_mode(load_shape(config))


@dataclass(frozen=True)
class InferencePlan:
    """An evaluation's decision, made once before any process group or weight exists (`memorize eval`,
    `memorize scan` and the scan's dry run take it): the grid and what chose it, the parallel mode, and
    whether it goes through the engine (several processes or a split)."""

    dims: Dims
    chosen_by: str
    mode: str
    distributed: bool


def plan_inference(config: Any, *, spec: str | None, model: str, batch: int, width: int,
                   suffix: int | None = None, mode: str = "auto", launch: Launch | None = None,
                   windows: int = 1000) -> InferencePlan:
    """The evaluation's plan on `launch` (default: this process's): `--grid spec` (`auto`: the one
    chooser with the inference objective, so eval and scan pick the same grid for the same model, launch
    and batch), checked against the model's shapes and the processes; ConfigError naming --grid."""
    launch = launch or Launch.current()
    try:
        model_dims(config)
    except (AttributeError, TypeError, ValueError):
        raise fail("--grid", spec, "needs a transformer config with hidden_size and num_attention_heads; "
                   f"{model} has model_type {getattr(config, 'model_type', None)!r}") from None
    mode = eval_mode(mode, config)
    if spec == "auto":
        dims, chosen_by = inference_dims(config, launch, batch=batch, width=width, suffix=suffix or width,
                                         mode=mode, windows=windows)
    elif (spec or "") in SERIAL:
        dims, chosen_by = (1, 1, 1, 1), "--grid"
    else:
        dims, chosen_by = parse_grid(spec), "--grid"
    n = dims[0] * dims[1] * dims[2] * dims[3]
    if n != launch.world:
        raise fail("--grid", ",".join(map(str, dims)), f"x*y*z*data={n} but the job has {launch.world} "
                   f"process(es); launch {n} (torchrun --nproc-per-node {n}) or change the grid")
    validate_grid_for_model(dims, config, mode)  # heads, KV heads, hidden, FFN, vocab
    return InferencePlan(dims, chosen_by, mode, launch.world > 1 or dims != (1, 1, 1, 1))


def inference_grid(plan: InferencePlan) -> ProcessGrid:
    """The ProcessGrid an evaluation scores on, from its plan: serial, else torch.distributed on its dims."""
    if not plan.distributed:
        return ProcessGrid.serial(device="cuda" if torch.cuda.is_available() else "cpu")
    return init_grid(plan.dims)


def is_main_process() -> bool:
    """Rank 0 of the launch (or a plain process): the one that writes reports."""
    return launch_env().rank == 0
