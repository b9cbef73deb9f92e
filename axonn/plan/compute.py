"""Compute-time model: a shape-aware GEMM curve, fused attention, memory-bound elementwise work."""
from __future__ import annotations

from axonn.plan.hardware import Hardware
from axonn.plan.shapes import ModelShape
from axonn.plan.volumes import Grid, pair_of


def shape_factor(m: int, n: int, k: int, half: float) -> float:
    """Fraction of the GEMM ceiling a shape reaches: product of d/(d + half) over its three dims.

    Small dims starve the tensor cores (tile quantization, short K loops); with half = 32 a
    8192^3 GEMM keeps 99% of the ceiling, 1024 x 1024 x 128 about 75%.
    """
    f = 1.0
    for d in (m, n, k):
        f *= d / (d + half)
    return f


def gemm_time(m: int, n: int, k: int, hw: Hardware) -> float:
    """Seconds for one bf16 GEMM [m, k] x [k, n]: max(compute at the shaped ceiling, HBM) + launch."""
    if min(m, n, k) <= 0:
        return 0.0
    flops = 2.0 * m * n * k
    t_compute = flops / (hw.peak_flops * hw.gemm_eff * shape_factor(m, n, k, hw.gemm_half_dim))
    t_memory = 2.0 * (m * k + k * n + m * n) / hw.hbm_bw
    return max(t_compute, t_memory) + hw.launch_s


def head_split(shape: ModelShape, grid: Grid, mode: str) -> int:
    """How many ways a rank's attention heads (and FFN width) are split: the paired blocks' output
    axis (Y, or X when the engine flips the pair) in paired mode, else 1."""
    return grid.dim(pair_of(shape, grid, mode)[1]) if mode == "paired" else 1


def attention_flops_fwd(shape: ModelShape, grid: Grid, seq: int, micro_batch: int,
                        mode: str = "paired") -> float:
    """Causal attention core (QK^T and PV) on the rank's heads: 2*s^2*head_dim per head.

    Paired mode runs heads/B heads per rank (B: the pair's output axis), but Q, K, V are identical
    on the ranks of the other axis, which repeat that work; easy mode runs all heads on every X and
    Y rank.
    """
    heads = shape.heads // head_split(shape, grid, mode)
    return 2.0 * seq * seq * shape.head_dim * heads * micro_batch


def attention_time(shape: ModelShape, grid: Grid, seq: int, micro_batch: int, hw: Hardware,
                   checkpoint: bool, mode: str = "paired") -> tuple[float, float]:
    """(forward, backward) seconds of the attention cores of all layers for one micro-batch.

    Flash-attention backward does ~2.5x the forward matmul work; checkpointing re-runs the forward.
    """
    flops = attention_flops_fwd(shape, grid, seq, micro_batch, mode)
    fwd = flops / (hw.peak_flops * hw.attn_eff)
    bwd = 2.5 * fwd + (fwd if checkpoint else 0.0)
    return shape.layers * fwd, shape.layers * bwd


def elementwise_time(shape: ModelShape, grid: Grid, seq: int, micro_batch: int, hw: Hardware,
                     checkpoint: bool, mode: str = "paired", loss_chunk: int = 0) -> tuple[float, float]:
    """(forward, backward) seconds of memory-bound work: norms, residuals, RoPE, activations, loss.

    Per token and block the forward streams about 12*H (two norms and two residual adds on the
    full-width stream, repeated on every X and Y rank) + 2*(qkv width)/s (RoPE) + 3*F/s
    (activation) bf16 values, s = head_split; backward ~2x. The loss reads/writes the [T, V/Y]
    logits in fp32 about five times over forward and backward (20 bytes per logit); the chunked
    head (`loss_chunk` > 0 tokens per chunk, axonn/layers/chunked_ce.py) forms the summed loss's
    gradient in forward: it writes each chunk's bf16 logits, reads them in the fused statistics
    kernel, and reads them again in the fused softmax-gradient kernel, which writes the bf16
    gradient: 2 + 2 + 2 + 2 bytes, all in forward (its backward only scales dh and dW).
    """
    tokens = micro_batch * seq
    qkv = shape.hidden + 2 * shape.kv_dim
    s = head_split(shape, grid, mode)
    per_token = 2.0 * (12 * shape.hidden + (2 * qkv + 3 * shape.ffn) / s)
    fwd = shape.layers * tokens * per_token / hw.hbm_bw
    logit = tokens * shape.vocab / grid.y / hw.hbm_bw  # seconds per byte per logit
    loss_f, loss_b = (8.0 * logit, 0.0) if loss_chunk else (10.0 * logit, 10.0 * logit)
    bwd = 2 * fwd + (fwd if checkpoint else 0.0)
    return fwd + loss_f, bwd + loss_b


def optimizer_time(local_params: float, hw: Hardware) -> float:
    """AdamW on the local shard: ~28 bytes of HBM traffic per parameter (fp32 master, m, v)."""
    return 28.0 * local_params / hw.hbm_bw
