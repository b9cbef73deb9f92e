"""Per-GPU memory: sharded weights, gradients and AdamW states, Z buffers, and activations."""
from __future__ import annotations

from axonn.plan.compute import head_split
from axonn.plan.shapes import ModelShape
from axonn.plan.volumes import Grid, block_linears, default_mode, replicated_params, z_block

# bf16 weight (2) + bf16 gradient (2) + fp32 master, Adam m and v (12).
BYTES_PER_PARAM = 16


def local_params(shape: ModelShape, grid: Grid, mode: str | None = None) -> float:
    """Parameters one rank stores: 1/(x*y*z) of every matrix (rows padded) plus full copies of
    norms, biases and positions."""
    mode = mode or default_mode(shape)
    mats = sum(lin.block(grid) for lin in block_linears(shape, grid, mode)) * shape.layers
    mats += z_block(shape.vocab // grid.y, shape.hidden // grid.x, grid.z) * (1 if shape.tied else 2)
    return mats / grid.z + replicated_params(shape, grid, mode)


def block_activation_bytes(shape: ModelShape, grid: Grid, tokens: int,
                           mode: str | None = None) -> float:
    """Bytes one block saves for backward on one rank (bf16).

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
    return 2.0 * tokens * width + 4.0 * tokens * shape.heads / s


def memory_breakdown(shape: ModelShape, grid: Grid, seq: int, micro_batch: int,
                     checkpoint: bool, prefetch: bool = True,
                     mode: str | None = None) -> dict[str, float]:
    """Peak bytes per GPU by category for one micro-batch of `micro_batch` rows per rank.

    activations: every block's saved tensors, or with checkpointing only each block's full-width
    input [T, H] plus one re-materialised block; one more block of gradient buffers in flight; and
    the [T, V/Y] logits (bf16) with their fp32 softmax and gradient. z_buffers: the largest
    gathered weight block (twice when the next one is prefetched) and its unscattered gradient.
    """
    mode = mode or default_mode(shape)
    tokens = micro_batch * seq
    local = local_params(shape, grid, mode)
    block = block_activation_bytes(shape, grid, tokens, mode)
    if checkpoint:
        stored = shape.layers * 2.0 * tokens * shape.hidden + block
    else:
        stored = shape.layers * block
    logits = 10.0 * tokens * shape.vocab / grid.y
    largest = max([o * i for _, o, i, _ in shape.block_linears()] + [shape.vocab * shape.hidden])
    gathered = largest / (grid.x * grid.y)
    z_buffers = 0.0 if grid.z == 1 else 2.0 * gathered * ((2 if prefetch else 1) + 1)
    return {
        "weights": 2.0 * local,
        "gradients": 2.0 * local,
        "optimizer": 12.0 * local,
        "z_buffers": z_buffers,
        "activations": stored + block + logits,
    }


def memory_bytes(shape: ModelShape, grid: Grid, seq: int, micro_batch: int, checkpoint: bool,
                 prefetch: bool = True, mode: str | None = None) -> float:
    """Total predicted peak bytes per GPU."""
    return sum(memory_breakdown(shape, grid, seq, micro_batch, checkpoint, prefetch,
                                mode).values())
