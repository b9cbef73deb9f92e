"""Which tensor axes a paired block (column layer -> row layer) splits over; torch-free (used by the
engine, its grid validation and the planner alike)."""
from __future__ import annotations

PAIRED_FIELDS = ("num_attention_heads", "num_key_value_heads", "intermediate_size")
PairAxes = tuple[str, str]  # (axis splitting a layer's input features, axis splitting its output)


def pair_axes(x: int, y: int, sizes: dict[str, int] | None = None) -> PairAxes:
    """(input axis, output axis) of the first layer of a paired block; the second layer is transposed.

    Either orientation is a valid 3D matmul; splitting the first layer's (wider) output over the
    larger of X and Y moves fewer bytes whenever X != Y (its partial-sum all-reduce runs over the
    smaller axis on a smaller buffer), so X > Y flips the pair: grid 2,1,1,1 runs Megatron's column
    -> row split over X, exactly as 1,2,1,1 does over Y.  The flip needs `sizes` (`model_dims` of the
    model) to show that X divides the heads, KV heads and FFN width and Y the hidden size; without
    them, or when they do not divide, and on ties the pair keeps (x, y)."""
    if x <= y or sizes is None:
        return "x", "y"
    if any(sizes[f] % x for f in PAIRED_FIELDS):
        return "x", "y"
    return ("x", "y") if sizes["hidden_size"] % y else ("y", "x")


def layer_axes(style: str, pair: PairAxes = ("x", "y")) -> tuple[str | None, str | None]:
    """(axis splitting a layer's input features, axis splitting its output features) for a style:
    `pair` for a paired block's first (column) layer, reversed for its second (row) layer, and
    (x, y) for easy layers, the LM head and the embedding.  The low-rank factors of an adapter take
    their base layer's (input axis, output axis) as `pair`: `down` ([r, in]) keeps the input split
    and the rank unsplit, `up` ([out, r]) the reverse (None: not split)."""
    if style == "column":
        return pair
    if style == "row":
        return pair[1], pair[0]
    if style == "down":
        return pair[0], None
    if style == "up":
        return None, pair[1]
    return "x", "y"
