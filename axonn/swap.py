"""`parallelize`: swap a model's linear layers, token embedding and LM head for 3D-parallel ones.

easy    every nn.Linear / GPT-2 Conv1D becomes an `easy` ParallelLinear: activations between layers
        stay full-width (identical on X and Y ranks) and batch-sharded over Z x data, so any Hugging
        Face causal LM built from these layers runs unchanged.
paired  in Llama-family blocks (q/k/v/o_proj attention, gate/up/down_proj MLP) q, k, v, gate and up
        become `column` layers and o, down `row` layers, so the pair runs without re-layout between
        them: heads (and the FFN width) are split over Y, or over X when X > Y (`grid.pair_axes`:
        the orientation that moves fewer bytes).  Other linears stay easy.
The LM head becomes a vocab-parallel `head` layer and the input embedding a ParallelEmbedding with the
same layout, so tied embeddings stay one shared parameter.  A model built on the meta device gets
empty shards (fill them with `axonn.load_pretrained`); a real model is sliced locally.
"""
from __future__ import annotations

import torch
from torch import nn

from axonn.engine import EngineHandle, grad_groups, is_parallel, module_layouts, set_engine
from axonn.grid import ProcessGrid, init, model_dims, validate_grid_for_model
from axonn.layers.modules import ParallelEmbedding, ParallelLinear
from axonn.pairing import layer_axes, pair_axes
from axonn.schedule import Bucketer, EngineOptions, Scheduler, grad_buckets
from memorize_core import fail

MODES = ("easy", "paired")
_COLUMN = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
_ROW = {"o_proj", "down_proj"}
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def _is_conv1d(m: nn.Module) -> bool:
    # GPT-2's transformers.pytorch_utils.Conv1D: y = x @ W + b with W stored [in, out].
    return type(m).__name__ == "Conv1D" and hasattr(m, "nf") and hasattr(m, "nx")


def _features(m: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of a Linear or Conv1D."""
    return (m.nx, m.nf) if _is_conv1d(m) else (m.in_features, m.out_features)


def _paired_parents(model: nn.Module) -> set[str]:
    """Names of attention / MLP modules whose children form column->row pairs."""
    out = set()
    for name, m in model.named_modules():
        for group in (_ATTN, _MLP):
            if all(isinstance(getattr(m, c, None), nn.Linear) for c in group):
                out.add(name)
    return out


def _style(name: str, paired_parents: set[str]) -> str:
    parent, _, leaf = name.rpartition(".")
    if parent in paired_parents and leaf in _COLUMN:
        return "column"
    if parent in paired_parents and leaf in _ROW:
        return "row"
    return "easy"


def _check_divides(grid: ProcessGrid, name: str, size: int, dim: str, what: str) -> None:
    n = grid.size(dim)
    if size % n:
        raise fail(f"grid.{dim}", n, f"must divide {name}.{what}={size}; choose a {dim} dividing {size}")


def model_pair_axes(model: nn.Module, grid: ProcessGrid) -> tuple[str, str]:
    """The paired blocks' orientation for this model on this grid (`axonn.grid.pair_axes`)."""
    config = getattr(model, "config", None)
    if config is None or not (hasattr(config, "hidden_size") and hasattr(config, "num_attention_heads")):
        return pair_axes(grid.x, grid.y)
    return pair_axes(grid.x, grid.y, model_dims(config))


def _plan(model: nn.Module, grid: ProcessGrid, mode: str,
          pair: tuple[str, str] = ("x", "y")) -> list[tuple[str, nn.Module, str]]:
    """(name, module, style) for every module to swap; raises ConfigError before touching anything."""
    if not (hasattr(model, "get_input_embeddings") and hasattr(model, "get_output_embeddings")):
        raise fail("model", type(model).__name__, "parallelize takes a Hugging Face PreTrainedModel "
                   "(get_input_embeddings / get_output_embeddings); wrap other models' layers in "
                   "axonn.ParallelLinear / ParallelEmbedding directly")
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if not isinstance(emb, nn.Embedding):
        raise fail("model", type(model).__name__, "needs an nn.Embedding input embedding "
                   "(get_input_embeddings()) to parallelize")
    if emb.max_norm is not None or emb.sparse:
        raise fail("model.embedding", "max_norm/sparse", "not supported by the parallel embedding")
    paired = _paired_parents(model) if mode == "paired" else set()
    if mode == "paired" and not paired:
        raise fail("mode", mode, f"{type(model).__name__} has no Llama-family q/k/v/o_proj or "
                   "gate/up/down_proj blocks; use mode='easy'")
    plan = []
    for name, m in model.named_modules():
        if m is emb:
            _check_divides(grid, name, m.num_embeddings, "y", "num_embeddings")
            _check_divides(grid, name, m.embedding_dim, "x", "embedding_dim")
            plan.append((name, m, "embedding"))
        elif m is head:
            if not isinstance(m, nn.Linear):
                raise fail("model.lm_head", type(m).__name__, "the LM head must be an nn.Linear")
            _check_divides(grid, name, m.out_features, "y", "out_features (vocab)")
            _check_divides(grid, name, m.in_features, "x", "in_features")
            plan.append((name, m, "head"))
        elif isinstance(m, nn.Linear) or _is_conv1d(m):
            style = _style(name, paired)
            fin, fout = _features(m)
            in_dim, out_dim = layer_axes(style, pair)
            _check_divides(grid, name, fin, in_dim, "in_features")
            _check_divides(grid, name, fout, out_dim, "out_features")
            plan.append((name, m, style))
    plan.sort(key=lambda item: item[2] != "embedding")  # a tied head reuses the embedding's shard
    return plan


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
    if options.bucket_grads:
        params = trainable(model)
        groups = grad_groups(model)
        buckets = grad_buckets(params, lambda p: groups[id(p)], grid.sizes, options.bucket_mb)
        bucketer = Bucketer(grid.comm, buckets)
        deferred = {id(w) for w, _ in sched._layers.values()} if sched.defers_grads() else set()
        bucketer.hook(params, deferred)
        sched.bucketer = bucketer


def parallelize(model: nn.Module, grid: ProcessGrid | None = None, mode: str = "easy",
                options: EngineOptions | None = None) -> nn.Module:
    """Swap the model's linears, embedding and LM head for 3D-parallel ones in place; returns it.

    `options` switches overlap and GEMM tuning (default: `EngineOptions()`; numbers are identical
    with any setting)."""
    if mode not in MODES:
        raise fail("mode", mode, "choose easy or paired")
    if is_parallel(model):
        raise fail("model", type(model).__name__, "is already parallelized")
    if not isinstance(grid, ProcessGrid):
        grid = init()  # no grid given: plain data parallelism over the whole world
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "hidden_size") and hasattr(config, "num_attention_heads"):
        validate_grid_for_model(grid, config, mode)
    pair = model_pair_axes(model, grid)
    plan = _plan(model, grid, mode, pair)  # every check first: errors come before any change

    options = options or EngineOptions()
    sched = Scheduler(grid.comm, options, grid.device)  # every swapped layer is built with it
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is emb.weight
    new_emb: ParallelEmbedding | None = None
    for name, m, style in plan:
        if style == "embedding":
            new_emb = ParallelEmbedding(grid, m.num_embeddings, m.embedding_dim, padding_idx=m.padding_idx,
                                        weight=m.weight, dtype=m.weight.dtype, scheduler=sched)
            new: nn.Module = new_emb
        else:
            fin, fout = _features(m)
            new = ParallelLinear(grid, fin, fout, bias=m.bias is not None, style=style, weight=m.weight,
                                 bias_value=m.bias, conv1d=_is_conv1d(m), dtype=m.weight.dtype,
                                 pair=pair, tied_to=new_emb.weight if style == "head" and tied else None,
                                 scheduler=sched)
        _swap(model, name, new)
    if any(t.is_meta for t in list(model.parameters()) + list(model.buffers())):
        _materialize_meta(model, grid.device)
    model.to(grid.device)
    set_engine(model, EngineHandle(grid=grid, mode=mode, pair_axes=pair if mode == "paired" else None,
                                   options=options, scheduler=sched, layouts=module_layouts(model)))
    _enrol(model, sched, grid, options)
    return model
