"""Low-rank adapters on the engine's sharded linear layers: a frozen base plus a trainable side path.

`LoraLinear` wraps a `ParallelLinear` (the frozen base, `base_layer`) with two more ParallelLinear
layers, the factors of delta W = scale * B A (A: [r, in], B: [out, r]), cut the way Megatron/NeMo cut
tensor-parallel LoRA and built from the same autograd Functions as every other layer:

  lora_A  style `down`: columns (in) split over the base's input axis, rows (r) over Z; its GEMM takes
          the base's local input and all-reduces the rank-r partial sums over that axis -- where the
          base sums its own partial products -- so the rank-r intermediate h is whole on every rank
  lora_B  style `up`: rows (out) split over the base's output axis and then Z, like the base's rows;
          its GEMM maps the whole h to this rank's output slice, added to the base's local output
          before the base's own output gather (no extra collective on the forward path)

Backward mirrors it: dh is all-reduced over the output axis (lora_B's input gradient), lora_A's
input gradient is this rank's slice of dx (summed with the base's before the base's input split
mirrors it back), and dA / dB are reduce-scattered over Z like any weight gradient, so the engine's
gradient sync, norms, checkpoints and state dicts treat the factors as ordinary sharded weights
(their layouts come from `ParallelLinear.layouts`).  The base weight keeps its dtype and has
requires_grad False: no gradient, no Z reduce-scatter, no optimizer state.  State-dict names follow
peft's (`base_layer.weight`, `lora_A.weight`, `lora_B.weight`).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from axonn.layers.functions import gather_weight
from axonn.layers.modules import ParallelLinear


def adapter_dtype(base: torch.dtype) -> torch.dtype:
    """Adapters train in fp32 over a 16-bit base (as peft's autocast_adapter_dtype), else in the base's."""
    return torch.float32 if base in (torch.float16, torch.bfloat16) else base


def peft_init(in_features: int, out_features: int, r: int, dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Full A [r, in] and B [out, r] drawn from the global RNG exactly as peft's default init draws them
    (nn.Linear(in, r) and nn.Linear(r, out) are built, then A is re-drawn kaiming-uniform, B zeroed), so
    a seeded sharded run starts from the serial peft run's adapters."""
    # drawn in torch's default dtype, where peft's nn.Linear draws them, then cast (as peft moves the
    # adapter to its base's dtype): the same numbers whatever the base dtype
    a = torch.empty(r, in_features)
    b = torch.empty(out_features, r)
    nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # nn.Linear(in, r).reset_parameters
    nn.init.kaiming_uniform_(b, a=math.sqrt(5))  # nn.Linear(r, out).reset_parameters
    nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # peft's reset_lora_parameters
    return a.to(dtype), b.zero_().to(dtype)


class LoraLinear(nn.Module):
    """y = base(x) + scale * B A dropout(x), with base a frozen ParallelLinear and A, B sharded like it."""

    def __init__(self, base: ParallelLinear, r: int, alpha: float, *, dropout: float = 0.0,
                 lora_a: torch.Tensor | None = None, lora_b: torch.Tensor | None = None) -> None:
        super().__init__()
        if r < 1:
            raise ValueError(f"r={r}: the adapter rank must be >= 1")
        base.requires_grad_(False)
        self.base_layer = base
        self.r, self.alpha, self.scale = r, alpha, alpha / r
        dtype = adapter_dtype(base.weight.dtype)
        if base.weight.is_meta:  # a model without storage (sized, not run): empty factors, no draws
            lora_a = torch.empty(r, base.in_features, device="meta")
            lora_b = torch.empty(base.out_features, r, device="meta")
        elif lora_a is None or lora_b is None:
            lora_a, lora_b = peft_init(base.in_features, base.out_features, r, dtype)
        pair = (base.in_axis, base.out_axis)
        self.lora_A = ParallelLinear(base.grid, base.in_features, r, bias=False, style="down", weight=lora_a,
                                     dtype=dtype, pair=pair, scheduler=base.scheduler)
        self.lora_B = ParallelLinear(base.grid, r, base.out_features, bias=False, style="up", weight=lora_b,
                                     dtype=dtype, pair=pair, scheduler=base.scheduler)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def extra_repr(self) -> str:
        return f"r={self.r}, alpha={self.alpha}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The base layer's output plus the adapter's, in the base layer's output layout."""
        base = self.base_layer
        xl = base.local_input(x)
        y = base.local_output(xl)
        h = self.lora_A(self.dropout(xl.to(self.lora_A.weight.dtype)))
        delta = self.lora_B(h) * self.scale
        return base.finish(y + delta.to(y.dtype))

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """This rank's piece of scale * B A in the base weight's local layout ([out rows, in cols], Z-split
        rows like the base's; padding rows zero) -- a collective over Z (A's rows are gathered)."""
        a = gather_weight(self.base_layer.grid.comm, self.lora_A.weight, self.r)
        return (self.lora_B.weight @ a) * self.scale

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """This rank's piece of W + scale * B A in the base's dtype (as peft merges: delta cast, added)."""
        w = self.base_layer.weight
        return w + self.delta_weight().to(w.dtype)
