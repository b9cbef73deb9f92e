"""Per-GPU memory: sharded weights, gradients and AdamW states, Z buffers, and activations.

This is the project's one model of memory: `axonn-plan` applies it to a shape, the dry run
(`memorize train --dry-run`, memorization/train/dryrun.py) to the parameter count of the sharded model it
builds. It describes the trainer as it runs: fp32 parameters (the master copy), fp32 gradients and
AdamW's two fp32 moments per local parameter -- 16 bytes, whatever the compute precision -- with
activations in bf16 under autocast ("bf16") or fp32 ("fp32").
"""
from __future__ import annotations

import dataclasses
import math

from axonn.plan.compute import direct_norm, head_split
from axonn.plan.shapes import ModelShape
from axonn.plan.volumes import Grid, block_linears, default_mode, replicated_params, z_block
from memorize_core import fail


@dataclasses.dataclass(frozen=True)
class Precision:
    """Bytes per local parameter (weight, gradient, optimizer state) and per activation element."""

    name: str
    weight: int
    grad: int
    optimizer: int  # AdamW exp_avg + exp_avg_sq, in the parameter dtype
    activation: int  # saved activations and the Z-gathered weight (cast before the gather)


# bf16 = the trainer's autocast on GPUs: parameters stay fp32, matmuls and their saved inputs run in
# bf16, weight gradients are reduce-scattered in the parameter dtype (docs/engine.md).
PRECISIONS = {
    "bf16": Precision("bf16", weight=4, grad=4, optimizer=8, activation=2),
    "fp32": Precision("fp32", weight=4, grad=4, optimizer=8, activation=4),
}
BYTES_PER_PARAM = 16  # weight + gradient + optimizer, the same in both precisions


def get_precision(name: str | Precision) -> Precision:
    """A precision by name (bf16 or fp32)."""
    if isinstance(name, Precision):
        return name
    if name not in PRECISIONS:
        raise fail("precision", name, f"choose one of {', '.join(PRECISIONS)}")
    return PRECISIONS[name]


@dataclasses.dataclass(frozen=True)
class Adapters:
    """A frozen base with rank-r adapters on some of each block's Linears (axonn/layers/lora.py): only
    the adapters have gradients and optimizer state; the base weights keep their load dtype."""

    rank: int
    targets: tuple[str, ...] = ()  # block-Linear names (q_proj, ..., down_proj); empty: every one
    frozen_bytes: int = 4  # bytes per frozen weight: 2 when the base is loaded in bf16, 4 in fp32


def adapter_params(shape: ModelShape, grid: Grid, adapters: Adapters, mode: str | None = None) -> float:
    """Adapter parameters one rank stores: per targeted Linear, A [r, in] split like its input (rows
    over Z) and B [out, r] like its output (then Z)."""
    mode = mode or default_mode(shape)
    r, total = adapters.rank, 0
    for lin in block_linears(shape, grid, mode):
        if adapters.targets and lin.name not in adapters.targets:
            continue
        total += -(-r // grid.z) * (lin.inp // grid.dim(lin.in_axis))
        total += -(-(lin.out // grid.dim(lin.out_axis)) // grid.z) * r
    return float(total * shape.layers)


def local_params(shape: ModelShape, grid: Grid, mode: str | None = None) -> float:
    """Parameters one rank stores: 1/(x*y*z) of every matrix (rows padded) plus full copies of
    norms, biases and positions."""
    mode = mode or default_mode(shape)
    mats = sum(lin.block(grid) for lin in block_linears(shape, grid, mode)) * shape.layers
    mats += z_block(shape.vocab // grid.y, shape.hidden // grid.x, grid.z) * (1 if shape.tied else 2)
    return mats / grid.z + replicated_params(shape, grid, mode)


def block_activation_bytes(shape: ModelShape, grid: Grid, tokens: int,
                           mode: str | None = None, act_bytes: int = 2) -> float:
    """Bytes one block saves for backward on one rank.

    Both modes: the two norm inputs on the full-width stream (2*H) and each Linear's input slice
    over its input axis (in/A; a row layer's input is already the split activation). Then the
    attention side: q/k/v outputs and the attention output, and the MLP's pre-activations and
    product (gate, up, act*up: 3*F; GPT's fc1 output and GELU: 2*F), split over the heads' axis in
    paired mode and full in easy mode; plus the fp32 flash-attention log-sum-exp per local head.
    """
    mode = mode or default_mode(shape)
    s = head_split(shape, grid, mode)
    inputs = sum(lin.inp / grid.dim(lin.in_axis) for lin in block_linears(shape, grid, mode)
                 if lin.style != "row")
    qkv = shape.hidden + 2 * shape.kv_dim
    mlp = (3 if shape.gated_mlp else 2) * shape.ffn
    width = 2 * shape.hidden + inputs + (qkv + shape.hidden + mlp) / s
    return float(act_bytes) * tokens * width + 4.0 * tokens * shape.heads / s


AUTO_ELEMENTS = 2 ** 26  # logits elements per rank above which `loss_chunk: auto` chunks (256 MiB in fp32)


def auto_chunk(vocab_local: int) -> int:
    """Tokens per chunk for `auto`: a power of two whose [chunk, vocab/Y] fp32 block is <= AUTO_ELEMENTS."""
    return max(64, 2 ** int(math.log2(max(1, AUTO_ELEMENTS // max(1, vocab_local)))))


def head_chunk(setting: int | str, vocab_local: int, tokens: int) -> int:
    """Tokens per chunk the trainer's LM head uses (trainer.loss_chunk: auto, off or a size) for a
    micro-batch of `tokens` predicted tokens on a rank holding `vocab_local` vocab rows; 0: full logits."""
    if setting in ("off", 0, None):
        return 0
    if setting == "auto":
        chunk = auto_chunk(vocab_local)
        return chunk if tokens > chunk else 0  # a single chunk saves no memory
    return int(setting)


def activation_bytes(shape: ModelShape, grid: Grid, seq: int, micro_batch: int, checkpoint: bool,
                     mode: str | None = None, precision: str | Precision = "bf16",
                     loss_chunk: int = 0) -> float:
    """Peak activation bytes of one micro-batch of `micro_batch` rows per rank.

    Every block's saved tensors, or with checkpointing only each block's full-width input [T, H]
    plus one re-materialised block; one more block of gradient buffers in flight; and the
    [T, V/Y] logits with their fp32 softmax and gradient -- or, with the chunked head
    (`loss_chunk` tokens per chunk), one chunk's logits, the per-token log-sum-exp and loss (fp32)
    and the head's fp32 weight-gradient accumulator [V/Y, H/X].
    """
    a = get_precision(precision).activation
    tokens = micro_batch * seq
    block = block_activation_bytes(shape, grid, tokens, mode, a)
    stored = shape.layers * a * tokens * shape.hidden + block if checkpoint else shape.layers * block
    if loss_chunk:
        logits = ((a + 8.0) * min(loss_chunk, tokens) * shape.vocab / grid.y + 8.0 * tokens
                  + 4.0 * shape.vocab / grid.y * shape.hidden / grid.x)
    else:
        logits = (a + 8.0) * tokens * shape.vocab / grid.y
    return stored + block + logits


def z_buffer_bytes(shape: ModelShape, grid: Grid, prefetch: bool = True,
                   precision: str | Precision = "bf16", checkpoint: bool = False,
                   mode: str | None = None) -> float:
    """The largest gathered weight block (twice when the next is prefetched) and its unscattered
    gradient (in the parameter dtype).

    Without a Z split nothing is gathered, but under bf16 every matmul keeps its block cast to bf16
    from forward to backward (as autocast's weight cache does; a Z-split block is re-gathered
    instead): every block's matrices and the output table, or with checkpointing one block's (its
    recompute) and the table."""
    p = get_precision(precision)
    if grid.z == 1:
        if p.activation >= p.weight:
            return 0.0  # fp32: the matmuls use the parameters themselves
        mode = mode or default_mode(shape)
        block = sum(lin.block(grid) for lin in block_linears(shape, grid, mode))
        table = z_block(shape.vocab // grid.y, shape.hidden // grid.x, 1)
        return float(p.activation) * ((1 if checkpoint else shape.layers) * block + table)
    largest = max([o * i for _, o, i, _ in shape.block_linears()] + [shape.vocab * shape.hidden])
    gathered = largest / (grid.x * grid.y)
    return gathered * (p.activation * (2 if prefetch else 1) + p.grad)


def example_norm_bytes(shape: ModelShape, grid: Grid, seq: int, micro_batch: int,
                       mode: str | None = None) -> float:
    """Per-example gradient norm buffers (axonn/layers/per_example.py, for per-example clipping)
    of one micro-batch on one rank: the largest layer's transient per-row pair of fp32 [T, T] Gram
    matrices or its [out, in] per-row gradient block, as `compute.direct_norm` chooses (a layer whose
    input's A A^T is not held yet), plus a tied table's [T, T] cross
    term and one more [T, T] token-equality matrix held to the embedding's backward.  The captured
    inputs are tensors autograd saves anyway; the graph kept for the second backward is the
    activations already counted."""
    mode = mode or default_mode(shape)
    t2 = float(seq) * seq
    blocks = [(lin.out // grid.dim(lin.out_axis), lin.inp // grid.dim(lin.in_axis))
              for lin in block_linears(shape, grid, mode)]
    blocks.append((shape.vocab // grid.y, shape.hidden // grid.x))
    largest = max(float(o * i) if direct_norm(seq, o, i, input_gram=False) else 2 * t2 for o, i in blocks)
    return 4.0 * micro_batch * (largest + 2 * t2)


EXAMPLE_NORMS = ("ghost", "materialized")  # how per-example gradient norms are formed (None: not at all)


def norm_kind(example_norms: bool | str | None) -> str | None:
    """The planner's `example_norms` argument as one of EXAMPLE_NORMS or None: False / None off, True or
    "ghost" the ghost-norm pass (axonn/layers/per_example.py), "materialized" per-example gradients held
    whole (one per row and trained parameter, as per-sample hooks form them); ConfigError otherwise."""
    if example_norms is None or example_norms is False:
        return None
    if example_norms is True:
        return "ghost"
    if example_norms in EXAMPLE_NORMS:
        return example_norms
    raise fail("example_norms", example_norms, "pass False, True or 'ghost' (norms by a ghost-norm pass), or "
               "'materialized' (per-example gradients held whole)")


def memory_breakdown(shape: ModelShape, grid: Grid, seq: int, micro_batch: int,
                     checkpoint: bool, prefetch: bool = True,
                     mode: str | None = None, *, local: float | None = None,
                     precision: str | Precision = "bf16", loss_chunk: int | str = 0,
                     example_norms: bool | str = False, adapters: Adapters | None = None,
                     trained: float | None = None) -> dict[str, float]:
    """Peak bytes per GPU by category for one micro-batch of `micro_batch` rows per rank.

    `local` is the parameter count of one rank (default: `local_params` of the shape); the dry run
    passes the count of the sharded model it built. `loss_chunk`: the trainer's LM-head setting
    (auto, off/0: full logits, or tokens per chunk; resolved for this grid by head_chunk).
    `example_norms` (norm_kind) adds per-example clipping's buffers: True / "ghost" the norm buffers
    (`example_norm_bytes`), "materialized" one gradient per row of the micro-batch and trained parameter
    (`example_grads`, in the gradients' dtype). With `adapters` those `local` parameters are
    frozen (their load dtype, no gradient or optimizer state) and only the adapters' -- `trained`,
    default `adapter_params` -- have all three.
    """
    mode = mode or default_mode(shape)
    p = get_precision(precision)
    loss_chunk = head_chunk(loss_chunk, -(-shape.vocab // grid.y), micro_batch * (seq - 1))
    n = local_params(shape, grid, mode) if local is None else float(local)
    weights = p.weight * n
    z_buffers = z_buffer_bytes(shape, grid, prefetch, p, checkpoint, mode)
    if adapters is not None:
        frozen = n
        n = adapter_params(shape, grid, adapters, mode) if trained is None else float(trained)
        weights = adapters.frozen_bytes * frozen + p.weight * n
        if grid.z == 1 and adapters.frozen_bytes <= p.activation:
            z_buffers = 0.0  # a base already in the compute dtype is used as it is: no cast copy kept
    out = {
        "weights": weights,
        "gradients": p.grad * n,
        "optimizer": p.optimizer * n,
        "z_buffers": z_buffers,
        "activations": activation_bytes(shape, grid, seq, micro_batch, checkpoint, mode, p, loss_chunk),
    }
    kind = norm_kind(example_norms)
    if kind == "ghost":
        out["example_norms"] = example_norm_bytes(shape, grid, seq, micro_batch, mode)
    elif kind == "materialized":
        out["example_grads"] = p.grad * micro_batch * n
    return out


def memory_bytes(shape: ModelShape, grid: Grid, seq: int, micro_batch: int, checkpoint: bool,
                 prefetch: bool = True, mode: str | None = None,
                 precision: str | Precision = "bf16", loss_chunk: int | str = 0,
                 adapters: Adapters | None = None, example_norms: bool | str = False) -> float:
    """Total predicted peak bytes per GPU (`loss_chunk`: the trainer's setting, see head_chunk;
    `adapters`: a LoRA run's frozen base and trained adapters; `example_norms`: per-example clipping's
    buffers, memory_breakdown)."""
    return sum(memory_breakdown(shape, grid, seq, micro_batch, checkpoint, prefetch,
                                mode, precision=precision, loss_chunk=loss_chunk, adapters=adapters,
                                example_norms=example_norms).values())
