"""The parallel plan: which module of a model becomes which parallel layer, declared before any swap.

A `ParallelPlan` is an ordered mapping module name (as `model.named_modules()` spells it) -> style,
plus the orientation of the paired blocks.  `parallelize` applies one; it never decides a style
itself.  Styles (the layouts are docs/engine.md's table):

embedding  an nn.Embedding -> ParallelEmbedding, the table cut [V/Y, H/X]
head       an nn.Linear LM head -> vocab-parallel `head` layer (same layout: tied stays one parameter)
column     first layer of a paired block: its output (heads, FFN width) stays split
row        second layer of a paired block: takes the split activation, returns it full-width
easy       any other nn.Linear / GPT-2 Conv1D: full-width in, full-width out

A module the plan does not name stays as it is (replicated on every rank).  `plan_for(model, grid,
mode)` builds the plan of a Hugging Face causal LM from its structure, once: its input embedding
and LM head (`get_input_embeddings` / `get_output_embeddings`); in paired mode every Llama-family
attention block (q/k/v_proj columns -> o_proj row) and MLP block (gate/up_proj columns ->
down_proj row) whose columns read and whose row writes the same width; every other linear easy.
A model with other names gets its own plan (`ParallelPlan({...})`, or `plan_for(...).override`).
`plan.check(model, grid)` refuses, with one ConfigError line and before anything is touched, a name
that is no module, a style the module cannot take, a column without its row, and every size the grid
does not divide; `parallelize` runs it on any plan it is given.  `plan.describe()` is what the dry
run prints.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from torch import nn

from axonn.grid import ProcessGrid, model_dims, validate_grid_for_model
from axonn.pairing import PairAxes, layer_axes, pair_axes
from memorize_core import fail

MODES = ("easy", "paired")
STYLES = ("embedding", "head", "column", "row", "easy")
ORIENTATIONS = (("x", "y"), ("y", "x"))


@dataclass(frozen=True)
class Block:
    """A paired block recognised by its children: columns -> rows (a Llama-family convention)."""

    columns: tuple[str, ...]
    rows: tuple[str, ...]


# the blocks plan_for pairs: Llama, Mistral, Qwen2 and their kin name their layers so
BLOCKS = (Block(("q_proj", "k_proj", "v_proj"), ("o_proj",)), Block(("gate_proj", "up_proj"), ("down_proj",)))


def is_conv1d(m: nn.Module) -> bool:
    """GPT-2's transformers.pytorch_utils.Conv1D: y = x @ W + b with W stored [in, out]."""
    return type(m).__name__ == "Conv1D" and hasattr(m, "nf") and hasattr(m, "nx")


def features(m: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of a Linear or Conv1D."""
    return (m.nx, m.nf) if is_conv1d(m) else (m.in_features, m.out_features)


def _is_linear(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or is_conv1d(m)


@dataclass(frozen=True, eq=False)
class ParallelPlan:
    """Module name -> style (in the model's order), and the (input, output) axes of a paired block's
    column layer (its row layer is transposed; `axonn.pairing.pair_axes`)."""

    styles: Mapping[str, str]
    pair_axes: PairAxes = ("x", "y")
    _order: tuple[tuple[str, str], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.styles, Mapping):
            raise fail("plan", type(self.styles).__name__, "give a mapping of module name -> style")
        for name, style in self.styles.items():
            if not isinstance(name, str):
                raise fail("plan", name, "module names are strings, as model.named_modules() gives them")
            if style not in STYLES:
                raise fail(f"plan[{name!r}]", style, f"choose one of {', '.join(STYLES)}")
        pair = tuple(self.pair_axes)
        if pair not in ORIENTATIONS:
            raise fail("plan.pair_axes", self.pair_axes, "choose ('x', 'y') or ('y', 'x')")
        object.__setattr__(self, "pair_axes", pair)
        object.__setattr__(self, "_order", tuple(self.styles.items()))
        object.__setattr__(self, "styles", MappingProxyType(dict(self._order)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ParallelPlan) and (self._order, self.pair_axes) == (other._order,
                                                                                     other.pair_axes)

    def __hash__(self) -> int:
        return hash((self._order, self.pair_axes))

    @property
    def mode(self) -> str:
        """paired if any block is paired (column/row layers), else easy."""
        return "paired" if any(s in ("column", "row") for s in self.styles.values()) else "easy"

    def modules(self, style: str) -> list[str]:
        """The names planned as `style`, in order."""
        return [n for n, s in self._order if s == style]

    def override(self, styles: Mapping[str, str]) -> ParallelPlan:
        """This plan with some modules' styles changed (or added), same orientation."""
        return ParallelPlan({**dict(self._order), **dict(styles)}, self.pair_axes)

    def summary(self, first: int = 3) -> dict[str, Any]:
        """{mode, pair_axes (paired only), styles: {style: {count, first names}}} (the dry run's key)."""
        return {"mode": self.mode, "pair_axes": list(self.pair_axes) if self.mode == "paired" else None,
                "styles": {s: {"count": len(names), "first": names[:first]}
                           for s in STYLES if (names := self.modules(s))}}

    def describe(self, first: int = 3) -> list[str]:
        """Lines for a human: the mode and orientation, then per style its count and first names."""
        s = self.summary(first)
        head = f"{s['mode']} mode, " + (f"paired blocks split ({self.pair_axes[0]} in, {self.pair_axes[1]} "
                                        "out)" if s["pair_axes"] else "no paired blocks")
        counts = ", ".join(f"{k} {v['count']}" for k, v in s["styles"].items())
        lines = [f"{head}: {counts}" if counts else f"{head}: nothing to shard"]
        for style, v in s["styles"].items():
            more = v["count"] - len(v["first"])
            lines.append(f"{style:<9} {', '.join(v['first'])}" + (f", ... (+{more})" if more else ""))
        return lines

    def check(self, model: nn.Module, grid: ProcessGrid) -> None:
        """ConfigError (one line) unless this plan can shard `model` on `grid`; touches nothing.

        A Hugging Face model's sizes are checked first against its config (`validate_grid_for_model`
        in this plan's mode: heads, KV heads, hidden, FFN, vocab); then every planned module: it
        exists, takes its style, and the grid divides its features along the style's axes."""
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "hidden_size") and hasattr(config, "num_attention_heads"):
            validate_grid_for_model(grid, config, self.mode)
        kind = type(model).__name__
        modules = dict(model.named_modules())
        for name, style in self._order:
            m = modules.get(name)
            if m is None:
                raise fail("plan", name, f"{kind} has no such module; name modules as "
                           "model.named_modules() does")
            if style == "embedding":
                if not isinstance(m, nn.Embedding):
                    raise fail(f"plan[{name!r}]", style, f"needs an nn.Embedding, not {type(m).__name__}")
                if m.max_norm is not None or m.sparse:
                    raise fail("model.embedding", "max_norm/sparse",
                               "not supported by the parallel embedding")
                _check_divides(grid, name, m.num_embeddings, "y", "num_embeddings")
                _check_divides(grid, name, m.embedding_dim, "x", "embedding_dim")
                continue
            if style == "head" and not isinstance(m, nn.Linear):
                raise fail("model.lm_head", type(m).__name__, "the LM head must be an nn.Linear")
            if not _is_linear(m):
                raise fail(f"plan[{name!r}]", style, f"needs an nn.Linear (or GPT-2 Conv1D), not "
                           f"{type(m).__name__}")
            fin, fout = features(m)
            in_dim, out_dim = layer_axes(style, self.pair_axes)
            what = "out_features (vocab)" if style == "head" else "out_features"
            if style == "head":  # the vocab first, as the embedding it shares a layout with
                _check_divides(grid, name, fout, out_dim, what)
                _check_divides(grid, name, fin, in_dim, "in_features")
            else:
                _check_divides(grid, name, fin, in_dim, "in_features")
                _check_divides(grid, name, fout, out_dim, what)
        self._check_pairs()

    def _check_pairs(self) -> None:
        """Every block with a column layer has a row layer beside it, and the reverse: a column's
        output stays split, only a row takes it back."""
        blocks: dict[str, set[str]] = {}
        for name, style in self._order:
            if style in ("column", "row"):
                blocks.setdefault(name.rpartition(".")[0], set()).add(style)
        for parent, styles in blocks.items():
            if styles != {"column", "row"}:
                (has,) = styles
                need = "row" if has == "column" else "column"
                raise fail("plan", parent or "<model>", f"has {has} layers but no {need} layer: a paired "
                           f"block needs both (or make its layers easy)")


def _check_divides(grid: ProcessGrid, name: str, size: int, dim: str, what: str) -> None:
    n = grid.size(dim)
    if size % n:
        raise fail(f"grid.{dim}", n, f"must divide {name}.{what}={size}; choose a {dim} dividing {size}")


def model_pair_axes(model: nn.Module, grid: ProcessGrid) -> PairAxes:
    """The paired blocks' orientation for this model on this grid (`axonn.pairing.pair_axes`)."""
    config = getattr(model, "config", None)
    if config is None or not (hasattr(config, "hidden_size") and hasattr(config, "num_attention_heads")):
        return pair_axes(grid.x, grid.y)
    return pair_axes(grid.x, grid.y, model_dims(config))


def paired_blocks(model: nn.Module, blocks: Iterable[Block] = BLOCKS) -> dict[str, str]:
    """{name: column|row} of every child of a recognised block: a module holding each of a `Block`'s
    children as an nn.Linear, whose columns all read the width its rows write."""
    out: dict[str, str] = {}
    for name, m in model.named_modules():
        for block in blocks:
            kids = [getattr(m, c, None) for c in block.columns + block.rows]
            if not all(isinstance(k, nn.Linear) for k in kids):
                continue
            cols, rows = kids[:len(block.columns)], kids[len(block.columns):]
            if {c.in_features for c in cols} != {r.out_features for r in rows}:
                continue
            prefix = f"{name}." if name else ""
            out.update({prefix + c: "column" for c in block.columns})
            out.update({prefix + r: "row" for r in block.rows})
    return out


def plan_for(model: nn.Module, grid: ProcessGrid, mode: str = "easy") -> ParallelPlan:
    """The plan of a Hugging Face causal LM on `grid` in `mode` (module docstring), checked."""
    if mode not in MODES:
        raise fail("mode", mode, "choose easy or paired")
    if not (hasattr(model, "get_input_embeddings") and hasattr(model, "get_output_embeddings")):
        raise fail("model", type(model).__name__, "plan_for reads a Hugging Face PreTrainedModel "
                   "(get_input_embeddings / get_output_embeddings); pass parallelize a "
                   "plan=axonn.ParallelPlan({module name: style}) for other models")
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if not isinstance(emb, nn.Embedding):
        raise fail("model", type(model).__name__, "needs an nn.Embedding input embedding "
                   "(get_input_embeddings()) to parallelize")
    if emb.max_norm is not None or emb.sparse:
        raise fail("model.embedding", "max_norm/sparse", "not supported by the parallel embedding")
    paired = paired_blocks(model) if mode == "paired" else {}
    if mode == "paired" and not paired:
        raise fail("mode", mode, f"{type(model).__name__} has no Llama-family q/k/v/o_proj or "
                   "gate/up/down_proj blocks; use mode='easy'")
    styles: dict[str, str] = {}
    for name, m in model.named_modules():
        if m is emb:
            styles[name] = "embedding"
        elif m is head:
            if not isinstance(m, nn.Linear):
                raise fail("model.lm_head", type(m).__name__, "the LM head must be an nn.Linear")
            styles[name] = "head"
        elif _is_linear(m):
            styles[name] = paired.get(name, "easy")
    plan = ParallelPlan(styles, model_pair_axes(model, grid))
    plan.check(model, grid)
    return plan
