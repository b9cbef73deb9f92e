"""Compute-time model: a shape-aware GEMM curve, fused attention, memory-bound elementwise work."""
from __future__ import annotations

from typing import Any

from axonn.plan.hardware import Hardware
from axonn.plan.shapes import ModelShape
from axonn.plan.volumes import Grid, block_linears, pair_of


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


def direct_norm(seq: int, out: int, inp: int, input_gram: bool) -> bool:
    """Whether a Linear's per-example weight-gradient norm is formed directly (G^T A: T*in*out
    multiply-adds and an [out, in] block per example, written, squared and summed) rather than from Gram
    matrices (G G^T, plus A A^T unless `input_gram` says a layer reading the same input formed it:
    T^2 * (out [+ in]), and a [T, T] pair per example). Where each fits beside the other (the block no
    larger than the Gram pair, the pair no larger than twice the block) the one with fewer multiply-adds;
    else the one that fits. A block larger than the pair loses on its memory passes even with fewer
    multiply-adds (SmolLM2's gate at T = 512: 0.82x the multiply-adds, 1.17x the time on a CPU;
    llama-1b's at T = 2,048 on an H100 by the planner's prices: benchmarks/bench_ghost_norms.py,
    docs/benchmarks.md). The kernel (axonn/layers/per_example.py) and example_norm_time both decide by it."""
    t2 = seq * seq
    gram = t2 * (out + (0 if input_gram else inp) + 1)
    direct = (seq + 1) * inp * out
    block_fits, pair_fits = inp * out <= 2 * t2, t2 <= inp * out
    if block_fits and pair_fits:
        return direct < gram
    return block_fits


def norm_paths(shape: ModelShape, grid: Grid, seq: int,
               mode: str = "paired") -> list[tuple[tuple[str, int, int], bool, bool]]:
    """One block's Linears in the order the norm pass's hooks see them (backward: the block's last
    Linear first) as ((name, out, in) of this rank's slice, whether the hooks' cache holds its input's
    A A^T, whether `direct_norm` forms G^T A). The cache holds the input of the last Linear that took
    the Gram path: the Linears that read one stream (q, k, v; gate, up: consecutive, not transposed)
    share it, whatever direct Linears come between."""
    linears = [(lin.name, lin.out // grid.dim(lin.out_axis), lin.inp // grid.dim(lin.in_axis))
               for lin in block_linears(shape, grid, mode)]
    transposed = [tr for _, _, _, tr in shape.block_linears()]
    streams, n = [], -1  # which input each Linear reads
    for i, tr in enumerate(transposed):
        n += 1 if tr or i == 0 or transposed[i - 1] else 0
        streams.append(n)
    out, held = [], None
    for lin, stream in reversed(list(zip(linears, streams))):
        direct = direct_norm(seq, lin[1], lin[2], input_gram=held == stream)
        out.append((lin, held == stream, direct))
        if not direct:
            held = stream
    return out


def example_norm_time(shape: ModelShape, grid: Grid, seq: int, micro_batch: int, hw: Hardware,
                      mode: str = "paired", adapters: Any = None) -> float:
    """Seconds of the per-example gradient-norm work of ghost-norm clipping for one micro-batch
    (axonn/layers/per_example.py), beside the backward it rides on: per example and trained Linear
    [out, in] (this rank's slice, T = seq tokens), the Gram matrices G G^T (2 T^2 out flops) and A A^T
    (2 T^2 in, formed once for the Linears that read one input: q, k, v and gate, up) or the
    per-example weight gradient G^T A itself, as `direct_norm` chooses; the LM head likewise, and the
    embedding's dE dE^T against the token-equality matrix. With `adapters` (a memory.Adapters, which
    imports this module) only the rank-r adapters are trained: A [r, in] and B [out, r] of each
    targeted Linear, nothing else."""
    products = 3.0 * 4 * seq * seq / hw.hbm_bw  # the [T, T] Grams multiplied and summed, fp32

    def norm(out: int, inp: int, cached: bool = False) -> float:
        if direct_norm(seq, out, inp, input_gram=cached):  # G^T A written, squared and summed, fp32
            return gemm_time(out, inp, seq, hw) + 3.0 * 4 * out * inp / hw.hbm_bw
        return (0.0 if cached else gemm_time(seq, seq, inp, hw)) + gemm_time(seq, seq, out, hw) + products

    blocks = [(lin.name, lin.out // grid.dim(lin.out_axis), lin.inp // grid.dim(lin.in_axis))
              for lin in block_linears(shape, grid, mode)]
    if adapters is not None:
        r = adapters.rank
        return micro_batch * shape.layers * sum(norm(r, inp) + norm(out, r) for name, out, inp in blocks
                                                if not adapters.targets or name in adapters.targets)
    per_block = 0.0
    for (_, out, inp), cached, direct in norm_paths(shape, grid, seq, mode):
        per_block += norm(out, inp, cached=cached and not direct)
    per_example = shape.layers * per_block
    per_example += norm(shape.vocab // grid.y, shape.hidden // grid.x)  # the LM head (a tied table too)
    per_example += gemm_time(seq, seq, shape.hidden // grid.x, hw) + products
    return micro_batch * per_example


def optimizer_time(local_params: float, hw: Hardware) -> float:
    """AdamW on the local shard: ~28 bytes of HBM traffic per parameter (fp32 master, m, v)."""
    return 28.0 * local_params / hw.hbm_bw
