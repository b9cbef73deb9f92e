"""The swapped nn.Modules of the 3D engine: `ParallelLinear` and `ParallelEmbedding` (functions.py
holds the autograd Functions they call).

ParallelLinear is a drop-in replacement for nn.Linear (and GPT-2's Conv1D) whose weight is a 3D
shard.  Every layer splits its input over one tensor axis and its output over the other: (X, Y) for
easy and head layers; for a paired block (a, b) for the first layer and (b, a) for the second, where
(a, b) = `axonn.pairing.pair_axes` is (x, y) unless X > Y and the model's heads divide by X.
Styles (which collectives wrap the 3D matmul; docs/engine.md):
  easy    full-width in, full-width out: split input over X, matmul, all-gather output over Y
  column  full-width in, output left split over b (first layer of a paired block: heads over b)
  row     input split over b, full-width out: matmul with the transposed layout, all-gather over a
  head    the LM head: like column over (X, Y); logits stay vocab-split over Y (see
          functions.VocabShardedLogits)
  down    an adapter's A [r, in] (axonn/layers/lora.py): input arrives split like its base layer's,
          rank-r output summed over that axis (the base's partial-sum all-reduce), left unsplit
  up      an adapter's B [out, r]: unsplit rank-r input, output left split like its base layer's

ParallelEmbedding is a vocab-parallel nn.Embedding: table [vocab, hidden] cut like an LM-head
weight (so they can tie).  Rows (vocab) are split over Y and then Z, columns (hidden) over X.
Forward: all-gather the block over Z, look up the tokens this Y-rank owns (zeros elsewhere),
all-reduce over Y, all-gather the hidden slices over X -> full-width embeddings on every X/Y rank.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from axonn.grid import ProcessGrid
from axonn.layers.functions import (
    GatherLastDim,
    ParallelMatmul,
    SplitLastDim,
    VocabEmbedding,
    mark_vocab_sharded,
)
from axonn.layers.layout import ParamSpec
from axonn.pairing import PairAxes, layer_axes

STYLES = ("easy", "column", "row", "head", "down", "up")


def weight_spec(grid: ProcessGrid, out_features: int, in_features: int, style: str,
                transposed: bool = False, pair: PairAxes = ("x", "y")) -> ParamSpec:
    """The layout of a weight [out, in] for one style: rows over the output axis, cols over the input."""
    in_axis, out_axis = layer_axes(style, pair)
    return ParamSpec(grid, out_features, in_features, out_axis, in_axis, z_split=True,
                     transposed=transposed)


def bias_spec(grid: ProcessGrid, out_features: int, style: str,
              pair: PairAxes = ("x", "y")) -> ParamSpec | None:
    """A bias follows the output layout: split where the output stays split, else replicated."""
    if style in ("column", "head"):
        return ParamSpec(grid, out_features, None, layer_axes(style, pair)[1], None, z_split=False)
    return None


def _local_param(full: torch.Tensor | None, spec: ParamSpec | None, shape: tuple[int, ...],
                 device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    """This rank's piece: sliced from a real full tensor, or left empty for a meta model."""
    if full is None or full.is_meta:
        data = torch.empty(shape, device="meta", dtype=dtype)
    elif spec is None:
        data = full.detach().to(device=device, dtype=dtype).clone()
    else:
        data = spec.local_from_full(full.detach()).to(device=device, dtype=dtype).clone()
    return nn.Parameter(data)


class ParallelLinear(nn.Module):
    """y = x W^T + b with W cut over X, Y, Z; `style` picks the activation layouts (module docstring).

    `weight` is the full serial weight to slice (or a meta tensor: empty shards); `tied_to` is a
    shard with this layout to share instead (the embedding's, for a tied LM head)."""

    def __init__(self, grid: ProcessGrid, in_features: int, out_features: int, *, bias: bool,
                 style: str = "easy", weight: torch.Tensor | None = None,
                 bias_value: torch.Tensor | None = None, conv1d: bool = False,
                 dtype: torch.dtype = torch.float32, pair: PairAxes = ("x", "y"),
                 tied_to: nn.Parameter | None = None, scheduler: Any = None) -> None:
        super().__init__()
        if style not in STYLES:
            raise ValueError(f"style={style!r}: choose one of {', '.join(STYLES)}")
        self.grid, self.style, self.conv1d = grid, style, conv1d
        self.in_axis, self.out_axis = layer_axes(style, pair)
        self.scheduler = scheduler  # the model's axonn.schedule.Scheduler (None: every collective blocks)
        self.in_features, self.out_features = in_features, out_features
        self.spec = weight_spec(grid, out_features, in_features, style, transposed=conv1d, pair=pair)
        if tied_to is not None:
            if tuple(tied_to.shape) != self.spec.local_shape:
                raise ValueError(f"tied_to has shape {tuple(tied_to.shape)}, this layout needs "
                                 f"{self.spec.local_shape}")
            self.weight = tied_to
        else:
            self.weight = _local_param(weight, self.spec, self.spec.local_shape, grid.device, dtype)
        self.bias: nn.Parameter | None = None
        self.bias_spec = bias_spec(grid, out_features, style, pair) if bias else None
        if bias:
            shape = self.bias_spec.local_shape if self.bias_spec is not None else (out_features,)
            self.bias = _local_param(bias_value, self.bias_spec, shape, grid.device, dtype)

    def layouts(self) -> dict[str, ParamSpec]:
        """Layout of each sharded parameter by its name in this module (a replicated bias is absent)."""
        out = {"weight": self.spec}
        if self.bias_spec is not None:
            out["bias"] = self.bias_spec
        return out

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, style={self.style}, "
                f"bias={self.bias is not None}, local={tuple(self.weight.shape)}")

    def _plain(self) -> bool:
        """No tensor split and no GEMM tuning: the whole weight is here and nothing is communicated
        in the layer, so torch's own linear (and autograd) is the fastest path. Inside a compiled
        block the compiler picks the GEMM (the tuner's layouts would break the graph)."""
        g, sched = self.grid, self.scheduler
        split = g.comm.size(self.in_axis) > 1 or g.comm.size(self.out_axis) > 1 or g.z > 1
        untuned = sched is None or not sched.gemm.enabled or torch.compiler.is_compiling()
        return not split and untuned

    def local_input(self, x: torch.Tensor) -> torch.Tensor:
        """`x` as this rank's GEMM takes it: split over the input axis (a row or down layer's input
        arrives split; an up layer's is unsplit)."""
        g = self.grid
        if self.style in ("row", "down") or g.comm.size(self.in_axis) == 1:
            return x
        return SplitLastDim.apply(x, g.comm, self.in_axis, g.coord(self.in_axis))

    def local_output(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's GEMM on a local input: the output split over the output axis, summed over the input
        axis (before the style's gather, bias and vocab marker: `finish`)."""
        if self._plain():
            return F.linear(x, self.weight)
        return ParallelMatmul.apply(x, self.weight, self.grid.comm, self.in_axis, self.out_axis,
                                    self.spec.block_rows, self.scheduler, id(self), torch.is_grad_enabled())

    def gather(self, y: torch.Tensor) -> torch.Tensor:
        """A local output gathered over the output axis where the style is full-width out."""
        g = self.grid
        if self.style in ("easy", "row") and g.comm.size(self.out_axis) > 1:
            y = GatherLastDim.apply(y, g.comm, self.out_axis, g.coord(self.out_axis))
        return y

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        """The layer's output from a local one: gathered where the style is full-width out, plus bias."""
        return self._epilogue(self.gather(y))

    def _epilogue(self, y: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)  # as nn.Linear under autocast: output in the GEMM dtype
        if self.style == "head":
            y = mark_vocab_sharded(y, self.grid)
        return y

    def _sharded(self, x: torch.Tensor) -> torch.Tensor:
        """The communicating path: this style's slice of the input, the 3D matmul, its gather."""
        return self.gather(self.local_output(self.local_input(x)))

    # Collectives, the scheduler's prefetch/deferred reductions and the byte counters stay out of
    # torch.compile's graph: a compiled block breaks cleanly around this call (axonn/compile.py).
    _sharded_outside_graph = torch.compiler.disable(_sharded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the layer; input/output layouts depend on the style (module docstring)."""
        if self._plain():
            return self._epilogue(F.linear(x, self.weight))
        if torch.compiler.is_compiling():  # tracing a compiled block: a clean graph break here
            return self._epilogue(self._sharded_outside_graph(x))
        return self._epilogue(self._sharded(x))  # eager: no disable wrapper (it costs ~4 us a call)


class ParallelEmbedding(nn.Module):
    """Token embedding whose table is sharded over X, Y and Z (the same layout as the LM head)."""

    def __init__(self, grid: ProcessGrid, num_embeddings: int, embedding_dim: int, *,
                 padding_idx: int | None = None, weight: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.float32, scheduler: Any = None) -> None:
        super().__init__()
        self.grid = grid
        self.scheduler = scheduler  # the model's axonn.schedule.Scheduler (None: every collective blocks)
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.spec = weight_spec(grid, num_embeddings, embedding_dim, "easy")
        self.weight = _local_param(weight, self.spec, self.spec.local_shape, grid.device, dtype)

    def layouts(self) -> dict[str, ParamSpec]:
        """Layout of the table shard by its name in this module."""
        return {"weight": self.spec}

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}, "
                f"local={tuple(self.weight.shape)}")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Full-width embeddings of `ids` (identical on the X/Y ranks of a batch shard)."""
        g = self.grid
        rows = self.spec.block_rows
        out = VocabEmbedding.apply(ids, self.weight, g.comm, "y", rows, g.y_rank * rows, self.padding_idx,
                                   self.scheduler, id(self), torch.is_grad_enabled())
        return GatherLastDim.apply(out, g.comm, "x", g.x_rank) if g.x > 1 else out
