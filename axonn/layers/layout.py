"""Where each rank's piece of a parameter lives in the full (serial) tensor, and how to rebuild it.

A 2-D weight [rows, cols] (rows = out features) is cut into [rows/R, cols/C] blocks, R = the size of
the `row_dim` axis and C of the `col_dim` axis ((y, x) normally, (x, y) for the second layer of a
paired block).  Each block is then split by rows over Z (the block flattened and split over Z; rows
padded with zeros to a multiple of Z), so every rank holds a [ceil(rows/R/Z), cols/C] piece: a
contiguous row range and column range of the full tensor, which is what lets `load_pretrained` read
exactly its piece out of a safetensors file.  A 1-D parameter (a bias) is either split over one axis
or replicated.  The swapped module that owns a parameter holds its spec (`ParallelLinear.layouts()`),
and `parallelize` collects them by parameter name into the model's `EngineHandle.layouts`; a
parameter without a spec is replicated on every rank.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from axonn.grid import ProcessGrid

# reads rows [r0, r1) x cols [c0, c1) of the full tensor (cols ignored for 1-D) -> tensor
Reader = Callable[[int, int, int, int], torch.Tensor]


@dataclass(frozen=True, eq=False)
class ParamSpec:
    """How one parameter is sharded over a grid (`EngineHandle.layouts` maps names to these)."""

    grid: ProcessGrid
    rows: int                  # full size of dim 0 (out features / vocab / bias length)
    cols: int | None           # full size of dim 1; None for a 1-D parameter
    row_dim: str | None        # axis splitting rows (None: rows not split over x/y)
    col_dim: str | None        # axis splitting cols (2-D only)
    z_split: bool              # rows further split over Z (3-D weights)
    transposed: bool = False   # the serial tensor is stored [cols, rows] (GPT-2 Conv1D)

    @property
    def shard_dims(self) -> tuple[str, ...]:
        """Axes over which ranks hold different pieces (the others hold copies)."""
        dims = [d for d in (self.row_dim, self.col_dim) if d is not None]
        if self.z_split and self.grid.z > 1:
            dims.append("z")
        return tuple(dims)

    @property
    def grad_group(self) -> str:
        """Group over which `sync_gradients` sums this gradient (Z is already summed by the layer)."""
        return "data" if self.z_split else "batch"

    @property
    def serial_shape(self) -> list[int]:
        """Shape of the full tensor as the serial model stores it ([cols, rows] when transposed)."""
        if self.cols is None:
            return [self.rows]
        return [self.cols, self.rows] if self.transposed else [self.rows, self.cols]

    def _n(self, dim: str | None) -> int:
        return 1 if dim is None else self.grid.size(dim)

    def _i(self, dim: str | None) -> int:
        return 0 if dim is None else self.grid.coord(dim)

    @property
    def block_rows(self) -> int:
        """Rows of this rank's [rows/R, cols/C] block before the Z split."""
        return self.rows // self._n(self.row_dim)

    @property
    def local_rows(self) -> int:
        """Rows of the local piece (padded to a multiple of Z when z_split)."""
        z = self.grid.z if self.z_split else 1
        return -(-self.block_rows // z)

    @property
    def local_cols(self) -> int | None:
        """Columns of the local piece."""
        return None if self.cols is None else self.cols // self._n(self.col_dim)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of the nn.Parameter on this rank."""
        return (self.local_rows,) if self.cols is None else (self.local_rows, self.local_cols)

    def row_range(self) -> tuple[int, int]:
        """Full-tensor rows [r0, r1) this rank holds (r1 - r0 < local_rows where padded)."""
        start = self._i(self.row_dim) * self.block_rows
        if not self.z_split:
            return start, start + self.block_rows
        r0 = min(start + self.grid.z_rank * self.local_rows, start + self.block_rows)
        return r0, min(r0 + self.local_rows, start + self.block_rows)

    def col_range(self) -> tuple[int, int]:
        """Full-tensor columns [c0, c1) this rank holds."""
        if self.cols is None:
            return 0, 0
        c0 = self._i(self.col_dim) * self.local_cols
        return c0, c0 + self.local_cols

    def local_from(self, read: Reader) -> torch.Tensor:
        """This rank's piece, built from a reader of full-tensor ranges (zero-padded rows)."""
        (r0, r1), (c0, c1) = self.row_range(), self.col_range()
        piece = read(r0, r1, c0, c1)
        pad = self.local_rows - (r1 - r0)
        if pad:
            piece = torch.cat([piece, piece.new_zeros((pad,) + tuple(piece.shape[1:]))])
        return piece.contiguous()

    def local_from_full(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a full serial tensor (stored [cols, rows] when `transposed`)."""
        if self.transposed:
            return self.local_from(lambda r0, r1, c0, c1: full[c0:c1, r0:r1].t())
        if self.cols is None:
            return self.local_from(lambda r0, r1, c0, c1: full[r0:r1])
        return self.local_from(lambda r0, r1, c0, c1: full[r0:r1, c0:c1])

    def full_from_local(self, local: torch.Tensor) -> torch.Tensor:
        """Gather every rank's piece into the full serial tensor (a collective over the tensor axes)."""
        comm = self.grid.comm
        t = local
        if self.z_split:
            t = comm.all_gather(t, "z", dim=0)[: self.block_rows]
        if self.row_dim is not None:
            t = comm.all_gather(t, self.row_dim, dim=0)
        if self.col_dim is not None:
            t = comm.all_gather(t, self.col_dim, dim=1)
        return t.t().contiguous() if self.transposed else t

    def counted_here(self, dims: tuple[str, ...] = ("x", "y", "z", "data")) -> bool:
        """True on exactly one rank among those that hold identical copies and differ only along
        `dims` (default: the whole grid; norms pass the tensor axes)."""
        return all(self.grid.coord(d) == 0 for d in dims if d not in self.shard_dims)
