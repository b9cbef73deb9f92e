"""`parallelize`: swap a model's linear layers, token embedding and LM head for 3D-parallel ones, as
its parallel plan says (axonn/parallel_plan.py: module name -> style, built once by `plan_for` or
given by the caller).

easy    (plan_for's easy mode) every nn.Linear / GPT-2 Conv1D becomes an `easy` ParallelLinear:
        activations between layers stay full-width (identical on X and Y ranks) and batch-sharded
        over Z x data, so any Hugging Face causal LM built from these layers runs unchanged.
paired  in Llama-family blocks (q/k/v/o_proj attention, gate/up/down_proj MLP) q, k, v, gate and up
        are planned `column` layers and o, down `row` layers, so the pair runs without re-layout
        between them: heads (and the FFN width) are split over Y, or over X when X > Y
        (`axonn.pairing.pair_axes`: the orientation that moves fewer bytes).  Other linears stay easy.
The LM head becomes a vocab-parallel `head` layer and the input embedding a ParallelEmbedding with the
same layout, so tied embeddings stay one shared parameter.  A model built on the meta device gets
empty shards (fill them with `axonn.load_pretrained`); a real model is sliced locally.
"""
from __future__ import annotations

import torch
from torch import nn

from axonn.engine import EngineHandle, grad_groups, is_parallel, module_layouts, set_engine
from axonn.grid import ProcessGrid, init
from axonn.layers.modules import ParallelEmbedding, ParallelLinear
from axonn.parallel_plan import MODES, ParallelPlan, features, is_conv1d, plan_for
from axonn.schedule import Bucketer, EngineOptions, Scheduler, grad_buckets
from memorize_core import fail


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, new)


def _materialize_meta(model: nn.Module, device: torch.device) -> None:
    """Give meta parameters/buffers real (uninitialised) storage, keeping tied ones shared."""
    memo: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                if id(p) not in memo:
                    new = torch.empty_like(p, device=device)
                    memo[id(p)] = nn.Parameter(new, requires_grad=p.requires_grad)
                module._parameters[key] = memo[id(p)]
        for key, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[key] = torch.zeros_like(b, device=device)
    # Non-persistent buffers (rotary inv_freq) are never in a checkpoint: recompute them the way
    # transformers does after its own meta-device loading.
    init_weights = getattr(model, "_init_weights", None)
    if callable(init_weights):
        with torch.no_grad():
            for module in model.modules():
                if module._non_persistent_buffers_set and not any(True for _ in module.parameters(False)):
                    init_weights(module)


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The model's distinct trainable parameters, in registration order."""
    seen: set[int] = set()
    out = []
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _enrol(model: nn.Module, sched: Scheduler, grid: ProcessGrid, options: EngineOptions) -> None:
    """Register every parallel layer's final weight with the scheduler the layer was built with;
    gradient hooks if bucketing (the groups come from the model's handle, so it is set first)."""
    for m in model.modules():
        if isinstance(m, (ParallelLinear, ParallelEmbedding)) and m.scheduler is sched:
            sched.register(m, m.weight, m.spec.block_rows)
    enrol_buckets(model, sched, grid, options)


def enrol_buckets(model: nn.Module, sched: Scheduler, grid: ProcessGrid, options: EngineOptions) -> None:
    """(Re)build the gradient buckets and their hooks over the model's trainable parameters (again after
    they change, e.g. adapters added and the base frozen)."""
    if sched.bucketer is not None:
        sched.bucketer.unhook()
        sched.bucketer = None
    if options.bucket_grads:
        params = trainable(model)
        groups = grad_groups(model)
        buckets = grad_buckets(params, lambda p: groups[id(p)], grid.sizes, options.bucket_mb)
        bucketer = Bucketer(grid.comm, buckets)
        deferred = {id(w) for w, _ in sched._layers.values()} if sched.defers_grads() else set()
        bucketer.hook(params, deferred)
        sched.bucketer = bucketer


def parallelize(model: nn.Module, grid: ProcessGrid | None = None, mode: str | None = None,
                options: EngineOptions | None = None, plan: ParallelPlan | None = None) -> nn.Module:
    """Swap the model's modules for 3D-parallel ones in place, as `plan` says; returns the model.

    `plan` defaults to `plan_for(model, grid, mode)` (a Hugging Face causal LM: `mode` easy, the
    default, or paired); a plan given is checked against the model and grid first (`plan.check`), so
    every refusal comes before any change, and `mode` may then be left out (it is the plan's).
    `options` switches overlap and GEMM tuning (default: `EngineOptions()`; numbers are identical
    with any setting).  The plan is kept in the model's handle (`engine_of(model).plan`)."""
    if mode is not None and mode not in MODES:
        raise fail("mode", mode, "choose easy or paired")
    if plan is not None and not isinstance(plan, ParallelPlan):
        raise fail("plan", type(plan).__name__, "pass an axonn.ParallelPlan (or leave it out for plan_for's)")
    if plan is not None and mode is not None and mode != plan.mode:
        raise fail("mode", mode, f"the plan given is {plan.mode}; leave mode out when passing a plan")
    if is_parallel(model):
        raise fail("model", type(model).__name__, "is already parallelized")
    if not isinstance(grid, ProcessGrid):
        grid = init()  # no grid given: plain data parallelism over the whole world
    if plan is None:
        plan = plan_for(model, grid, mode or "easy")  # built and checked: errors before any change
    else:
        plan.check(model, grid)
    modules = dict(model.named_modules())
    # every module looked up before the first swap; embeddings first: a tied head reuses their shard
    targets = [(name, modules[name], style) for name, style in
               sorted(plan.styles.items(), key=lambda item: item[1] != "embedding")]

    options = options or EngineOptions()
    sched = Scheduler(grid.comm, options, grid.device)  # every swapped layer is built with it
    embeddings: dict[int, ParallelEmbedding] = {}  # id(serial table) -> its parallel embedding
    for name, m, style in targets:
        if style == "embedding":
            new: nn.Module = ParallelEmbedding(grid, m.num_embeddings, m.embedding_dim,
                                               padding_idx=m.padding_idx, weight=m.weight,
                                               dtype=m.weight.dtype, scheduler=sched)
            embeddings[id(m.weight)] = new
        else:
            fin, fout = features(m)
            tied = embeddings.get(id(m.weight)) if style == "head" else None
            new = ParallelLinear(grid, fin, fout, bias=m.bias is not None, style=style, weight=m.weight,
                                 bias_value=m.bias, conv1d=is_conv1d(m), dtype=m.weight.dtype,
                                 pair=plan.pair_axes, tied_to=tied.weight if tied is not None else None,
                                 scheduler=sched)
        _swap(model, name, new)
    if any(t.is_meta for t in list(model.parameters()) + list(model.buffers())):
        _materialize_meta(model, grid.device)
    model.to(grid.device)
    set_engine(model, EngineHandle(grid=grid, mode=plan.mode,
                                   pair_axes=plan.pair_axes if plan.mode == "paired" else None, plan=plan,
                                   options=options, scheduler=sched, layouts=module_layouts(model)))
    _enrol(model, sched, grid, options)
    return model
