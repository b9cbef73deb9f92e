"""What one training step does on one rank: the GEMMs and collectives of the engine's 3D matmul.

Mirrors axonn/layers (docs/planning.md has the derivation). Activations between layers are
full-width and batch-sharded over Z x data (T = local tokens of a micro-batch). A weight [out, in]
is cut into a block [out/B, in/A] (A, B = the layer's input and output axes: X, Y for easy layers
and the head; (a, b) for a paired block's `column` layer and (b, a) for its `row` layer, where
(a, b) = axonn.pairing.pair_axes, i.e. (Y, X) when X > Y and X divides the heads, else (X, Y)), whose
rows are padded to a multiple of Z and split over Z; W = z*ceil(rows/z)*cols is the gathered block.
Per Linear:
  fwd: all-gather W over Z; GEMM; all-reduce T*out/B over A; row and easy: all-gather T*out over B
  bwd: all-gather W over Z; dX GEMM + all-reduce T*in/A over B (overlaps the dW GEMM); dW GEMM +
       reduce-scatter W over Z; easy/column/head: all-gather the dX slices, T*in, over A
Paired mode makes q/k/v/gate/up `column` and o/down `row` layers; easy mode makes every Linear
`easy`. Embedding: all-gather W over Z, lookup, all-reduce T*H/X over Y, all-gather T*H over X;
backward reduce-scatters W over Z. The LM head is a `column`-like `head`; the vocab-parallel loss
all-reduces 3 fp32 values per token over Y. Once per step: gradients of Z-split weights over
`data`, of replicated parameters (norms, biases, positions) over `batch` (Z x data).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from axonn.pairing import layer_axes, pair_axes
from axonn.plan.shapes import ModelShape, load_shape
from memorize_core import fail

MODES = ("paired", "easy")


@dataclasses.dataclass(frozen=True)
class Grid:
    """A 4D grid (x, y, z, data); rank layout X fastest."""

    x: int
    y: int
    z: int
    data: int

    @property
    def size(self) -> int:
        """Number of ranks."""
        return self.x * self.y * self.z * self.data

    def dim(self, group: str) -> int:
        """Size of a named group: x, y, z, data, batch (z*data), tensor, world."""
        named = {"batch": self.z * self.data, "tensor": self.x * self.y * self.z,
                 "world": self.size}
        return named[group] if group in named else getattr(self, group)


@dataclasses.dataclass(frozen=True)
class Gemm:
    """A GEMM [m, k] x [k, n] run `count` times per micro-batch."""

    name: str
    phase: str  # fwd | bwd
    role: str  # fwd | dgrad | wgrad | recompute
    m: int
    n: int
    k: int
    count: int


@dataclasses.dataclass(frozen=True)
class Comm:
    """A collective on an `elems`-element buffer (full gathered / pre-scatter / reduced size)."""

    name: str
    phase: str  # fwd | bwd | step
    kind: str  # all_reduce | all_gather | reduce_scatter
    group: str  # x | y | z | data | batch
    elems: int
    count: int
    hide: str  # blocking | prefetch | wgrad | background | step
    elem_bytes: int | None = None  # None: the run's dtype (bf16); the loss reduces fp32


def default_mode(shape: ModelShape) -> str:
    """paired where the engine can pair the block's Linears, else easy."""
    return "paired" if shape.pairable else "easy"


def pair_of(shape: ModelShape, grid: Grid, mode: str) -> tuple[str, str]:
    """(input axis, output axis) of a paired block's first layer, as the engine picks them."""
    if mode != "paired":
        return "x", "y"
    return pair_axes(grid.x, grid.y, {"num_attention_heads": shape.heads,
                                      "num_key_value_heads": shape.kv_heads,
                                      "intermediate_size": shape.ffn, "hidden_size": shape.hidden})


@dataclasses.dataclass(frozen=True)
class Linear:
    """One Linear of a block: features, style and the axes splitting its input and output."""

    name: str
    out: int
    inp: int
    style: str  # easy | column | row | head
    in_axis: str
    out_axis: str

    def block(self, grid: Grid) -> int:
        """Elements of the gathered (Z-padded) weight block."""
        return z_block(self.out // grid.dim(self.out_axis), self.inp // grid.dim(self.in_axis), grid.z)


def rows_per_rank(grid: Grid, global_batch: int) -> int:
    """Sequences the busiest rank holds: data splits the batch evenly, Z possibly unevenly."""
    return -(-(global_batch // grid.data) // grid.z)


def z_block(rows: int, cols: int, z: int) -> int:
    """Elements of a gathered block whose rows are padded to a multiple of z."""
    return -(-rows // z) * z * cols


def grid_problems(shape: ModelShape, grid: Grid, global_batch: int, strict: bool = False,
                  mode: str | None = None) -> list[str]:
    """Why a grid cannot run this model (empty list: it can).

    X and Y must split whole heads and features exactly (what axonn.grid validates); Z rows are
    padded, so Z only needs one row of the batch per rank unless `strict`, which asks z*data to
    divide the global batch as the engine's batch sharding does today.
    """
    x, y, z, d = grid.x, grid.y, grid.z, grid.data
    mode = mode or default_mode(shape)
    bad = []
    if mode == "paired":  # the same checks as axonn.grid.validate_grid_for_model
        a, b = pair_of(shape, grid, mode)
        need = [("x", x, "hidden", shape.hidden), (a, grid.dim(a), "hidden", shape.hidden),
                (b, grid.dim(b), "heads", shape.heads), (b, grid.dim(b), "kv heads", shape.kv_heads),
                (b, grid.dim(b), "ffn", shape.ffn)]
    else:
        need = [("x", x, "hidden", shape.hidden), ("y", y, "hidden", shape.hidden),
                ("x", x, "ffn", shape.ffn), ("y", y, "ffn", shape.ffn),
                ("y", y, "kv width", shape.kv_dim)]
    need.append(("y", y, "vocab", shape.vocab))
    bad += [f"{what} {size} must divide by {dim}" for dim, n, what, size in need if size % n]
    if global_batch % d:
        bad.append(f"global batch {global_batch} must divide by data")
    elif global_batch // d < z:
        bad.append(f"global batch {global_batch} must give every (z, data) rank a row")
    elif strict and global_batch % (z * d):
        bad.append(f"global batch {global_batch} must divide by z*data")
    return bad


def check_grid(shape: ModelShape, grid: Grid, global_batch: int, strict: bool = False,
               mode: str | None = None) -> None:
    """Raise ConfigError naming the first reason the grid does not fit the model."""
    bad = grid_problems(shape, grid, global_batch, strict, mode)
    if bad:
        g = (grid.x, grid.y, grid.z, grid.data)
        raise fail("grid", g, f"{bad[0]} ({shape.name}); choose another (x, y, z, data)")


def _linear(lin: Linear, tokens: int, g: Grid, count: int,
            checkpoint: bool) -> tuple[list[Gemm], list[Comm]]:
    name, out, inp, style = lin.name, lin.out, lin.inp, lin.style
    a, b = lin.in_axis, lin.out_axis
    rows, cols = out // g.dim(b), inp // g.dim(a)
    w = lin.block(g)
    fwd = [Comm(name, "fwd", "all_gather", "z", w, count, "prefetch"),
           Comm(name, "fwd", "all_reduce", a, tokens * rows, count, "blocking")]
    if style in ("row", "easy"):
        fwd.append(Comm(name, "fwd", "all_gather", b, tokens * out, count, "blocking"))
    bwd = [Comm(name, "bwd", "all_gather", "z", w, count, "prefetch"),
           Comm(name, "bwd", "all_reduce", b, tokens * cols, count, "wgrad"),
           Comm(name, "bwd", "reduce_scatter", "z", w, count, "background")]
    if style != "row":
        bwd.append(Comm(name, "bwd", "all_gather", a, tokens * inp, count, "blocking"))
    gemms = [Gemm(name, "fwd", "fwd", tokens, rows, cols, count),
             Gemm(name, "bwd", "dgrad", tokens, cols, rows, count),
             Gemm(name, "bwd", "wgrad", rows, cols, tokens, count)]
    if checkpoint:  # the block's forward runs again inside the backward
        gemms.append(Gemm(name, "bwd", "recompute", tokens, rows, cols, count))
        bwd += [dataclasses.replace(c, name=name + ".recompute", phase="bwd") for c in fwd]
    return gemms, fwd + bwd


def block_linears(shape: ModelShape, grid: Grid, mode: str) -> list[Linear]:
    """One block's Linears with the engine's styles and split axes for this grid."""
    if mode not in MODES:
        raise fail("mode", mode, f"choose one of {', '.join(MODES)}")
    pair = pair_of(shape, grid, mode)
    out = []
    for n, o, i, tr in shape.block_linears():
        style = ("row" if tr else "column") if mode == "paired" else "easy"
        out.append(Linear(n, o, i, style, *layer_axes(style, pair)))
    return out


def step_ops(shape: ModelShape, grid: Grid, seq: int, micro_batch: int, checkpoint: bool,
             mode: str | None = None) -> tuple[list[Gemm], list[Comm], list[Comm]]:
    """(gemms, comms) of one micro-batch and the once-per-step comms, for one rank."""
    mode = mode or default_mode(shape)
    tokens = micro_batch * seq
    h, v = shape.hidden, shape.vocab
    gemms: list[Gemm] = []
    comms: list[Comm] = []
    for lin in block_linears(shape, grid, mode):
        gs, cs = _linear(dataclasses.replace(lin, name=f"layers.{lin.name}"), tokens, grid,
                         shape.layers, checkpoint)
        gemms += gs
        comms += cs
    gs, cs = _linear(Linear("lm_head", v, h, "head", "x", "y"), tokens, grid, 1, False)
    gemms += gs
    comms += cs
    w_emb = z_block(v // grid.y, h // grid.x, grid.z)
    comms += [Comm("embed", "fwd", "all_gather", "z", w_emb, 1, "prefetch"),
              Comm("embed", "fwd", "all_reduce", "y", tokens * h // grid.x, 1, "blocking"),
              Comm("embed", "fwd", "all_gather", "x", tokens * h, 1, "blocking"),
              Comm("embed", "bwd", "reduce_scatter", "z", w_emb, 1, "background"),
              # targets are shifted: the loss sees seq - 1 positions of each row
              Comm("loss", "fwd", "all_reduce", "y", micro_batch * (seq - 1), 1, "blocking",
                   elem_bytes=4),
              Comm("loss", "fwd", "all_reduce", "y", 2 * micro_batch * (seq - 1), 1, "blocking",
                   elem_bytes=4)]
    step = [Comm("grads", "step", "all_reduce", "data", sharded_matrix_params(shape, grid, mode),
                 1, "step"),
            Comm("grads", "step", "all_reduce", "batch", replicated_params(shape, grid, mode), 1,
                 "step")]
    return gemms, comms, step


def sharded_matrix_params(shape: ModelShape, grid: Grid, mode: str | None = None) -> int:
    """Elements of the Z-split weight pieces one rank owns (padded rows; a tied table once)."""
    z = grid.z
    n = shape.layers * sum(lin.block(grid) for lin in block_linears(shape, grid, mode or default_mode(shape)))
    n += z_block(shape.vocab // grid.y, shape.hidden // grid.x, z) * (1 if shape.tied else 2)
    return n // z


def replicated_params(shape: ModelShape, grid: Grid, mode: str | None = None) -> int:
    """Elements each rank holds of parameters that are not Z-split (norms, biases, positions).

    Biases of column layers follow their split output; all others are full copies.
    """
    mode = mode or default_mode(shape)
    n = shape.norm_params() + shape.positions * shape.hidden
    if shape.bias:
        for lin in block_linears(shape, grid, mode):
            n += shape.layers * (lin.out // grid.dim(lin.out_axis) if lin.style == "column" else lin.out)
    return n


def collective_counts(shape: Any, seq: int, global_batch: int, x: int, y: int, z: int,
                      data: int, dtype_bytes: int = 2, *, micro_batch: int | None = None,
                      checkpoint: bool = False,
                      mode: str | None = None) -> dict[tuple[str, str], tuple[int, int]]:
    """(calls, bytes) per rank per step for each (kind, group); see collective_volumes."""
    shape = load_shape(shape)
    grid = Grid(x, y, z, data)
    check_grid(shape, grid, global_batch, mode=mode)
    rows = rows_per_rank(grid, global_batch)
    mb = rows if micro_batch is None else micro_batch
    if mb < 1 or rows % mb:
        raise fail("micro_batch", micro_batch, f"must divide the {rows} rows each rank gets")
    _, comms, step = step_ops(shape, grid, seq, mb, checkpoint, mode)
    out: dict[tuple[str, str], tuple[int, int]] = {}
    for c, reps in [(c, rows // mb) for c in comms] + [(c, 1) for c in step]:
        if grid.dim(c.group) > 1 and c.elems > 0:
            calls, nbytes = out.get((c.kind, c.group), (0, 0))
            n = c.count * reps
            out[(c.kind, c.group)] = (calls + n, nbytes + n * c.elems * (c.elem_bytes or dtype_bytes))
    return out


def collective_volumes(shape: Any, seq: int, global_batch: int, x: int, y: int, z: int,
                       data: int, dtype_bytes: int = 2, *, micro_batch: int | None = None,
                       checkpoint: bool = False, mode: str | None = None) -> dict[tuple[str, str], int]:
    """Bytes per rank per step for each (collective kind, group), e.g. ("all_gather", "z").

    Counted like axonn.comm.CommStats: the full buffer of each call (all-reduce: the tensor;
    all-gather: the gathered output; reduce-scatter: the unscattered input); groups of size 1 are
    skipped. The once-per-step gradient all-reduces are one flat buffer per group here (the engine
    buckets them: same bytes, more calls). `micro_batch` is rows per rank per micro-batch (default:
    all at once); with an uneven Z split the busiest rank is reported. `collectives.wire_bytes`
    turns a buffer size into bytes sent on a ring.
    """
    counts = collective_counts(shape, seq, global_batch, x, y, z, data, dtype_bytes,
                               micro_batch=micro_batch, checkpoint=checkpoint, mode=mode)
    return {k: b for k, (_, b) in counts.items()}
