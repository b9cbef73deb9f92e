"""Per-example squared gradient norms without per-example gradients ("ghost" norms), for any layer
of a model, plain or sharded by the engine.

`ExampleNorms(model, grid)` hooks every module that owns a trainable parameter: its forward hook
keeps the module's input and puts a tensor hook on its output, which receives the output gradient
during a backward; from the two it adds each example's squared norm of that module's parameter
gradients to a [rows] vector.  `norms(losses)` runs that backward (autograd.grad of losses.sum()
towards the embeddings' outputs, graph retained) and returns sum_params ||d losses[i] / d p||^2.

How each kind of module's gradient is seen (example i, A_i its inputs [T, in], G_i the gradients of
its outputs [T, out]; the weight gradient is G_i^T A_i):
- linear (nn.Linear, GPT-2 Conv1D, ParallelLinear): ||G_i^T A_i||^2 = <A_i A_i^T, G_i G_i^T> (two
  [T, T] Gram matrices), or G_i^T A_i formed directly, whichever costs fewer flops among the two whose
  transient memory is within twice the other's (`direct_norm`); bias ||sum_t G_i[t]||^2.
- embedding (nn.Embedding, ParallelEmbedding): the weight gradient is onehot(ids_i)^T dE_i, so its
  norm is <dE_i dE_i^T, [ids_s == ids_t]> (the token-id equality trick); padding_idx rows excluded.
- a parameter used by an embedding and a linear layer (tied input/output embeddings): the two
  norms plus the cross term 2 <A_lin dE^T, G_lin[:, ids]>; any other sharing is refused
  (`unsupported`).
- any other module owning parameters (RMSNorm, LayerNorm): its per-example gradients through
  torch.func (vmap of grad of <module(x_i), G_i>): they are as small as the parameters.

Sharded layers (docs/engine.md "Per-example norms"): a ParallelLinear's local GEMM sees its input
slice A and output slice G, i.e. the [out/Y, in/X] block of every local example's gradient (the Z
split of the stored shard is a split of rows of the *batch* here: each example lives on one batch
shard, which sees its whole block).  Each rank adds its blocks' squares, only where it holds a
distinct piece along X and Y (a replicated norm weight or bias counts on the X = Y = 0 rank alone),
and one all-reduce over X and one over Y give every rank the serial norm of its own examples.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from axonn.grid import ProcessGrid
from axonn.layers.layout import ParamSpec
from axonn.layers.modules import ParallelEmbedding, ParallelLinear
from axonn.plan.compute import direct_norm  # the planner prices the same choice

_LINEAR = (nn.Linear, Conv1D, ParallelLinear)
_EMBEDDING = (nn.Embedding, ParallelEmbedding)


@dataclass
class _Tied:
    """What a tied parameter's linear use leaves for its embedding use (the cross term)."""

    a: torch.Tensor  # the linear's input slice [B, T, in]
    g_at_ids: torch.Tensor  # its output gradient at the embedding's token ids [B, T_lin, T_emb]


def _own(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad]


def _owners(model: nn.Module) -> dict[int, list[nn.Module]]:
    """id(parameter) -> the modules that own it (two for tied embeddings)."""
    out: dict[int, list[nn.Module]] = {}
    for m in model.modules():
        for _, p in _own(m):
            out.setdefault(id(p), []).append(m)
    return out


def unsupported(model: nn.Module) -> str | None:
    """Why ghost norms cannot handle `model` (a parameter shared other than by an embedding and a
    linear layer), or None."""
    names: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)  # its first name, as state dicts keep it
    for pid, mods in _owners(model).items():
        if len(mods) == 1:
            continue
        kinds = sorted(type(m).__name__ for m in mods)
        if len(mods) > 2 or not (isinstance(mods[0], _EMBEDDING) != isinstance(mods[1], _EMBEDDING)
                                 and all(isinstance(m, _EMBEDDING + _LINEAR) for m in mods)):
            return f"parameter {names.get(pid, '?')} is shared by {', '.join(kinds)}"
    return None


def _slice(t: torch.Tensor, grid: ProcessGrid, axis: str) -> torch.Tensor:
    p = grid.size(axis)
    if p == 1:
        return t
    n = t.shape[-1] // p
    i = grid.coord(axis)
    return t[..., i * n:(i + 1) * n]


def _gram(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.bmm(a, b.transpose(1, 2))


def _diagonal_affine(m: nn.Module, x: torch.Tensor) -> bool:
    """True when `m`'s output is weight * h(x) + bias elementwise over its last dimension (a norm with
    an elementwise affine: its per-example weight gradient is sum_t g_t * h(x_t)), tested on random
    parameters and two rows of `x`."""
    params = dict(m.named_parameters(recurse=False))
    w = dict(_own(m)).get("weight")
    if w is None or not set(params) <= {"weight", "bias"} or w.dim() != 1 or x.shape[-1] != w.numel() \
            or not x.is_floating_point():
        return False
    gen = torch.Generator(device=w.device).manual_seed(0)
    rand = {n: torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype) for n, p in params.items()}
    unit = {n: torch.ones_like(p) if n == "weight" else torch.zeros_like(p) for n, p in params.items()}
    probe = x[:2].detach()
    with torch.no_grad():
        out = torch.func.functional_call(m, rand, (probe,))
        h = torch.func.functional_call(m, unit, (probe,))
    want = rand["weight"] * h + (rand["bias"] if "bias" in rand else 0)
    tol = 1e-12 if out.dtype == torch.float64 else 1e-5 if out.dtype == torch.float32 else 1e-2
    return out.shape == h.shape and torch.allclose(out, want, rtol=tol, atol=tol)


class ExampleNorms:
    """Per-example squared gradient norms of every trainable parameter of `model` (module docstring)."""

    def __init__(self, model: nn.Module, grid: ProcessGrid, layouts: dict[int, ParamSpec | None]) -> None:
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"ghost norms: {why}")
        self.grid, self.layouts = grid, layouts  # id(parameter) -> its layout (None: replicated)
        self._owners = _owners(model)
        self._active = False  # tensor hooks add norms only during norms()' backward
        self._inside = False  # forward hooks ignore the module calls torch.func makes
        self._sq: torch.Tensor | None = None
        self._anchors: list[torch.Tensor] = []
        self._ids: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(param) -> embedding ids, mask
        self._tied: dict[int, _Tied] = {}
        self._seen: set[int] = set()
        self._x: dict[int, torch.Tensor | None] = {}  # id(module) -> its input in this forward
        self._gram: tuple[torch.Tensor, torch.Tensor] | None = None  # the last linear input and A A^T
        self._affine: dict[int, bool] = {}  # id(module) -> whether its output is weight * h(x) + bias
        self._waiting: dict[int, torch.Tensor] = {}  # id(module) -> output gradient awaiting the input
        # each forward of the whole model starts afresh (one whose loss was never measured, e.g. a
        # callback's, leaves nothing behind)
        root = model.register_forward_pre_hook(lambda *_: None if self._inside else self.reset())
        hooked = [m for m in model.modules() if _own(m)]
        self._handles = [m.register_forward_hook(self._forward) for m in hooked] \
            + [m.register_forward_pre_hook(self._recomputed) for m in hooked] + [root]

    def remove(self) -> None:
        """Take the hooks off the model."""
        for h in self._handles:
            h.remove()

    # -- capture ------------------------------------------------------------------------------
    def _recomputed(self, module: nn.Module, args: tuple) -> None:
        """Activation checkpointing recomputes a block inside backward: keep the input this module's
        tensor hook (set in the first forward) will see. A pre-hook, as the recomputation stops
        once the block's last saved tensor is back, before the module's forward returns."""
        if torch._C._current_graph_task_id() != -1 and id(module) in self._seen and args \
                and isinstance(args[0], torch.Tensor):
            x = args[0].detach()
            g = self._waiting.pop(id(module), None)
            if g is None:
                self._x[id(module)] = x
            else:  # its output gradient came first (the block's last layers)
                self._norm(module, x, g)

    def _forward(self, module: nn.Module, args: tuple, out: Any) -> None:
        if self._inside or not torch.is_grad_enabled() or not isinstance(out, torch.Tensor) \
                or not out.requires_grad or not args or not isinstance(args[0], torch.Tensor):
            return
        if torch._C._current_graph_task_id() != -1:
            return  # a recomputation (_recomputed took its input)
        x = args[0].detach()
        if id(module) in self._seen:
            raise RuntimeError(f"ghost norms: {type(module).__name__} ran twice in one forward; a module's "
                               "examples must be seen once per backward")
        self._seen.add(id(module))
        # under checkpointing's forward (saved-tensor hooks active) the recomputation brings the input
        # back; keeping it here would hold every block's inputs and undo the checkpointing
        recomputed = torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
        self._x[id(module)] = None if recomputed and not isinstance(module, _EMBEDDING) else x
        if isinstance(module, _EMBEDDING):
            self._anchors.append(out)  # its input (token ids) needs no gradient: the backward goes here
            self._ids[id(module.weight)] = self._local_ids(module, x)
        out.register_hook(lambda g, m=module: self._backward(m, g))

    def _local_ids(self, m: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(row of each token in this rank's table block, whether this block holds it)."""
        if isinstance(m, ParallelEmbedding):
            rows = m.spec.block_rows
            local = ids - self.grid.y_rank * rows
            mask = (local >= 0) & (local < rows)
        else:
            local, mask = ids, torch.ones_like(ids, dtype=torch.bool)
        if m.padding_idx is not None:  # never updated, as in nn.Embedding
            mask = mask & (ids != m.padding_idx)
        return torch.where(mask, local, torch.zeros_like(local)), mask

    def _backward(self, module: nn.Module, g: torch.Tensor) -> None:
        if not self._active:
            return
        x = self._x.pop(id(module), None)
        if x is None:  # a checkpointed block not recomputed yet: wait for its input
            self._waiting[id(module)] = g.detach()
            return
        self._norm(module, x, g)

    def _norm(self, module: nn.Module, x: torch.Tensor, g: torch.Tensor) -> None:
        g = g.detach()
        dtype = torch.float64 if g.dtype == torch.float64 else torch.float32
        g, x = g.to(dtype), (x if not x.is_floating_point() else x.to(dtype))
        if isinstance(module, _LINEAR):
            self._linear(module, x, g)
        elif isinstance(module, _EMBEDDING):
            self._embedding(module, g)
        else:
            self._functional(module, x, g)

    def _add(self, p: nn.Parameter, sq: torch.Tensor, module: nn.Module) -> None:
        """Add a [rows] vector of squares where this rank holds a distinct piece of `p` along X, Y."""
        spec = self.layouts.get(id(p))
        here = spec.counted_here(("x", "y")) if spec is not None else \
            self.grid.x_rank == 0 and self.grid.y_rank == 0
        if self._sq is None:
            self._sq = torch.zeros(sq.shape[0], dtype=torch.float64, device=sq.device)
        if sq.shape[0] != self._sq.shape[0]:
            raise RuntimeError(f"ghost norms: {type(module).__name__} sees {sq.shape[0]} examples, other "
                               f"layers {self._sq.shape[0]}: each layer's input must hold one row per "
                               "example (a broadcast position embedding does not); use per-sample "
                               "gradients for this model")
        if here:
            self._sq += sq.double()

    # -- the three kinds ----------------------------------------------------------------------
    def _linear(self, m: nn.Module, x: torch.Tensor, g: torch.Tensor) -> None:
        bias = m.bias if m.bias is not None and m.bias.requires_grad else None
        if bias is not None:
            self._add(bias, g.reshape(g.shape[0], -1, g.shape[-1]).sum(1).pow(2).sum(-1), m)
        if not m.weight.requires_grad:
            return
        a, gl = x, g
        if isinstance(m, ParallelLinear):  # the slices the local GEMM multiplies
            if m.style != "row":
                a = _slice(x, self.grid, m.in_axis)
            if m.style in ("easy", "row"):
                gl = _slice(g, self.grid, m.out_axis)
        a = a.reshape(a.shape[0], -1, a.shape[-1])
        gl = gl.reshape(gl.shape[0], -1, gl.shape[-1])
        t = a.shape[1]
        if direct_norm(t, gl.shape[-1], a.shape[-1], input_gram=self._holds_gram(a)):
            sq = torch.bmm(gl.transpose(1, 2), a).pow(2).sum((1, 2))
        else:
            sq = (self._input_gram(a) * _gram(gl, gl)).sum((1, 2))
        self._add(m.weight, sq, m)
        if len(self._owners.get(id(m.weight), ())) > 1:  # tied to an embedding, which runs its backward later
            local, mask = self._ids[id(m.weight)]
            at_ids = gl.gather(2, local.reshape(local.shape[0], 1, -1).expand(-1, t, -1))
            self._tied[id(m.weight)] = _Tied(a, at_ids * mask.reshape(mask.shape[0], 1, -1))

    def _holds_gram(self, a: torch.Tensor) -> bool:
        """Whether the cached A A^T (_input_gram) is this input's."""
        last = self._gram
        return last is not None and last[0].data_ptr() == a.data_ptr() and last[0].shape == a.shape \
            and last[0].stride() == a.stride() and last[0].dtype == a.dtype

    def _input_gram(self, a: torch.Tensor) -> torch.Tensor:
        """A A^T of a linear layer's input, computed once for consecutive layers that read the same
        tensor (q, k and v read one normed stream, gate and up another; their backward hooks run one
        after another). The last input is held with its Gram, so its memory cannot be reused by
        another tensor while the cache names it."""
        if self._holds_gram(a):
            return self._gram[1]
        gram = _gram(a, a)
        self._gram = (a, gram)
        return gram

    def _embedding(self, m: nn.Module, g: torch.Tensor) -> None:
        local, mask = self._ids[id(m.weight)]
        if isinstance(m, ParallelEmbedding):
            g = _slice(g, self.grid, "x")  # the output is gathered over X: this rank's columns
        de = g.reshape(g.shape[0], -1, g.shape[-1]) * mask.reshape(mask.shape[0], -1, 1)
        ids = local.reshape(local.shape[0], -1)
        same = (ids.unsqueeze(2) == ids.unsqueeze(1)).to(de.dtype)
        sq = (_gram(de, de) * same).sum((1, 2))
        tied = self._tied.pop(id(m.weight), None)
        if tied is not None:  # 2 <G_lin^T A_lin, onehot^T dE> = 2 sum_{s,t} G_lin[s, id_t] <A_lin[s], dE[t]>
            sq = sq + 2 * (_gram(tied.a, de) * tied.g_at_ids).sum((1, 2))
        elif len(self._owners.get(id(m.weight), ())) > 1:
            raise RuntimeError("ghost norms: the tied linear layer's backward did not run before the "
                               "embedding's")
        self._add(m.weight, sq, m)

    def _functional(self, m: nn.Module, x: torch.Tensor, g: torch.Tensor) -> None:
        """Per-example gradients of a small module (a norm's weight): for one whose output is
        weight * h(x) (+ bias), checked when first seen (RMSNorm, LayerNorm), from h(x) = its output
        with unit weight and zero bias; any other through torch.func."""
        if id(m) not in self._affine:
            self._affine[id(m)] = _diagonal_affine(m, x)
        if self._affine[id(m)]:
            own = dict(_own(m))
            unit = {n: torch.ones_like(p) if n == "weight" else torch.zeros_like(p)
                    for n, p in m.named_parameters(recurse=False)}
            self._inside = True
            try:
                with torch.no_grad():
                    h = torch.func.functional_call(m, unit, (x,)).to(g.dtype)
            finally:
                self._inside = False
            rows, width = g.shape[0], own["weight"].numel()
            self._add(own["weight"], (g * h).reshape(rows, -1, width).sum(1).pow(2).sum(1), m)
            if "bias" in own:
                self._add(own["bias"], g.reshape(rows, -1, width).sum(1).pow(2).sum(1), m)
            return
        params = {n: p.detach() for n, p in _own(m)}

        def inner(ps: dict, xi: torch.Tensor, gi: torch.Tensor) -> torch.Tensor:
            out = torch.func.functional_call(m, ps, (xi.unsqueeze(0),))
            return (out.to(gi.dtype) * gi.unsqueeze(0)).sum()

        self._inside = True
        try:
            grads = torch.func.vmap(torch.func.grad(inner), in_dims=(None, 0, 0))(params, x, g)
        finally:
            self._inside = False
        for name, p in _own(m):
            self._add(p, grads[name].reshape(g.shape[0], -1).pow(2).sum(1), m)

    # -- one norm pass ------------------------------------------------------------------------
    def norms(self, losses: torch.Tensor) -> torch.Tensor:
        """Each example's squared gradient norm of `losses` [rows] (every rank's own rows), over all
        of the model's trainable parameters; the graph is kept for the caller's backward."""
        anchors = [a for a in self._anchors if a.requires_grad] or [losses]
        self._active = True
        try:
            # towards the embeddings' outputs only: no parameter's .grad is touched, and the weight
            # GEMMs are skipped (the engine's Functions ask autograd whether dW is wanted)
            torch.autograd.grad(losses.sum(), anchors, retain_graph=True, allow_unused=True)
            if self._waiting:
                raise RuntimeError(f"ghost norms: {len(self._waiting)} module(s) got an output gradient but "
                                   "their input was never recomputed")
        finally:
            self._active = False
            sq, self._sq = self._sq, None
            self.reset()
        if sq is None:
            sq = torch.zeros(losses.shape[0], dtype=torch.float64, device=losses.device)
        for axis in ("x", "y"):
            if self.grid.size(axis) > 1:
                self.grid.comm.all_reduce(sq, axis)
        return sq

    def reset(self) -> None:
        """Forget what a forward captured (a forward whose loss is not backpropagated)."""
        self._anchors, self._ids, self._tied, self._seen, self._x = [], {}, {}, set(), {}
        self._waiting, self._gram = {}, None

