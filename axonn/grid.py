"""The 4D process grid (X, Y, Z tensor dimensions x data), its process groups, and `init`.

Rank layout: X fastest, then Y, Z, data:  rank = x + X*(y + Y*(z + Z*d)).  X is innermost so the
X collectives (the forward all-reduces of every layer) stay inside a node.  The grid is built once
and passed explicitly.  The one module-level state is the cache of process groups (`_GROUPS`, at the
end), shared by every grid of the process because torch cannot safely destroy and recreate them.
Where this process sits in the job (torchrun, Slurm, MPI) is axonn/launch.py.
"""
from __future__ import annotations

import datetime
import itertools
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from axonn.comm import Comm, CommStats
from axonn.launch import launch_env
from axonn.pairing import pair_axes
from memorize_core import fail

DIMS = ("x", "y", "z", "data")
# Named groups -> the grid dimensions that vary inside them.  "batch" holds the ranks that see
# different samples of the global batch (Z shards the batch inside a layer, data across replicas).
GROUP_DIMS = {
    "x": ("x",), "y": ("y",), "z": ("z",), "data": ("data",),
    "batch": ("z", "data"), "tensor": ("x", "y", "z"), "world": DIMS,
}


def parse_grid(text: str) -> tuple[int, int, int, int]:
    """Parse "X,Y,Z,D" (e.g. "2,2,1,2") into four positive integers."""
    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) != 4:
        raise fail("grid", text, "write four comma-separated integers X,Y,Z,D, e.g. --grid 2,2,1,2")
    dims = []
    for name, p in zip(DIMS, parts):
        try:
            v = int(p)
        except ValueError:
            raise fail(f"grid.{name}", p, "must be a positive integer, e.g. --grid 2,2,1,2") from None
        if v < 1:
            raise fail(f"grid.{name}", v, "must be a positive integer (1 means not split)")
        dims.append(v)
    return tuple(dims)  # type: ignore[return-value]


def _check_dims(dims: Sequence[Any]) -> tuple[int, ...]:
    out = []
    for name, v in zip(DIMS, dims):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise fail(f"grid.{name}", v, "must be a positive integer (1 means not split)")
        out.append(v)
    return tuple(out)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def model_dims(hf_config: Any) -> dict[str, int]:
    """The sizes the grid must divide, read from a Hugging Face config (any family)."""
    hidden = int(hf_config.hidden_size)
    heads = int(hf_config.num_attention_heads)
    kv = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or hidden // heads)
    ffn = getattr(hf_config, "intermediate_size", None) or getattr(hf_config, "n_inner", None)
    return {
        "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv,
        "q_size": heads * head_dim, "kv_size": kv * head_dim,
        "intermediate_size": int(ffn or 4 * hidden), "vocab_size": int(hf_config.vocab_size),
    }


def validate_grid_for_model(grid_dims: Any, hf_config: Any, mode: str = "easy") -> None:
    """Raise ConfigError (naming the field) if the grid cannot split this model; runs no collective."""
    if isinstance(grid_dims, ProcessGrid):
        grid_dims = grid_dims.dims
    dims = list(grid_dims)
    if len(dims) not in (3, 4):
        raise fail("grid", tuple(dims), "give X,Y,Z or X,Y,Z,D")
    x, y = _check_dims(dims)[:2]
    if mode not in ("easy", "paired"):
        raise fail("mode", mode, "choose easy or paired")
    m = model_dims(hf_config)
    # (grid dim, its size, model field): every Linear splits its input over X and its output over Y
    # (easy); paired mode splits the first layer of each pair's input over axis a and its output
    # (heads, ffn) over b (pair_axes), and transposes the second; embedding and LM head stay X/Y.
    if mode == "easy":
        needs = [("x", x, "hidden_size"), ("y", y, "hidden_size"), ("x", x, "intermediate_size"),
                 ("y", y, "intermediate_size"), ("x", x, "q_size"), ("y", y, "q_size"),
                 ("y", y, "kv_size"), ("y", y, "vocab_size")]
    else:
        size = {"x": x, "y": y}
        a, b = pair_axes(x, y, m)
        needs = [("x", x, "hidden_size"), (a, size[a], "hidden_size"),
                 (b, size[b], "num_attention_heads"), (b, size[b], "num_key_value_heads"),
                 (b, size[b], "intermediate_size"), ("y", y, "vocab_size")]
    for dim, size, field in needs:
        if m[field] % size:
            raise fail(f"grid.{dim}", size, f"must divide {field}={m[field]} ({mode} mode); "
                       f"choose one of {_divisors(m[field])}")


def resolve_dims(x: int, y: int, z: int, data: int | None, world_size: int) -> tuple[int, int, int, int]:
    """Fill in `data` and check X*Y*Z*D == world size (ConfigError otherwise, no collective)."""
    x, y, z = _check_dims((x, y, z))
    tensor = x * y * z
    if data is None:
        if world_size % tensor:
            raise fail("grid", f"{x},{y},{z}", f"x*y*z={tensor} must divide the world size "
                       f"{world_size}; pick dimensions whose product divides {world_size}")
        data = world_size // tensor
    (data,) = _check_dims((1, 1, 1, data))[3:]
    if tensor * data != world_size:
        raise fail("grid", f"{x},{y},{z},{data}", f"x*y*z*data={tensor * data} but the world size "
                   f"is {world_size}; make the product equal the number of processes")
    return x, y, z, data


def init(x: int = 1, y: int = 1, z: int = 1, data: int | None = None,
         *, timeout_s: float = 1800.0) -> ProcessGrid:
    """Initialise torch.distributed from the launcher's environment if needed and build the grid."""
    if dist.is_available() and dist.is_initialized():
        dims = resolve_dims(x, y, z, data, dist.get_world_size())
        return ProcessGrid(*dims)
    env = launch_env()
    dims = resolve_dims(x, y, z, data, env.world_size)  # before any rendezvous: fails everywhere alike
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    backend = "nccl" if cuda else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if env.world_size == 1 and env.master_addr is None:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        dist.init_process_group(backend, init_method=f"tcp://{env.master_addr}:{env.master_port}",
                                rank=env.rank, world_size=env.world_size, timeout=timeout)
    return ProcessGrid(*dims, local_rank=env.local_rank)


class ProcessGrid:
    """X x Y x Z x data ranks over the initialised default group, with one process group per axis."""

    def __init__(self, x: int, y: int, z: int, data: int, *, local_rank: int | None = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise fail("grid", f"{x},{y},{z},{data}", "torch.distributed is not initialised; "
                       "call axonn.init(...) instead")
        world = dist.get_world_size()
        self._place(resolve_dims(x, y, z, data, world), dist.get_rank())
        self.backend = str(dist.get_backend())
        if "nccl" in self.backend and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        if local_rank is None:
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.local_rank = local_rank
        self.comm = Comm(self._build_groups(), self.sizes)
        self._frozen = True

    @classmethod
    def virtual(cls, x: int, y: int, z: int, data: int, *, rank: int = 0,
                device: str | torch.device = "meta") -> ProcessGrid:
        """Rank `rank`'s view of an X x Y x Z x data grid with no process group (for dry runs).

        Coordinates, group sizes and layouts are exactly those of the real grid, so `parallelize`
        shards a (meta) model as that rank would; every collective raises instead of running."""
        dims = _check_dims((x, y, z, data))
        world = dims[0] * dims[1] * dims[2] * dims[3]
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
            raise fail("rank", rank, f"must be within 0..{world - 1} for a grid of {world} ranks")
        self = cls.__new__(cls)
        self._place(dims, rank)
        self.backend = "virtual"
        self.device = torch.device(device)
        self.local_rank = 0
        self.comm = _VirtualComm(self.sizes)
        self._frozen = True
        return self

    @classmethod
    def serial(cls, *, device: str | torch.device = "cpu") -> ProcessGrid:
        """The 1 x 1 x 1 x 1 grid of a single process: what a serial run trains on.

        Every group has size 1, so every `Comm` call returns its input (or does nothing) without
        touching torch.distributed: it works with or without an initialised process group."""
        self = cls.__new__(cls)
        self._place((1, 1, 1, 1), 0)
        self.backend = "serial"
        self.device = torch.device(device)
        self.local_rank = 0
        self.comm = Comm({}, self.sizes)  # all sizes 1: no collective ever reaches a group
        self._frozen = True
        return self

    @property
    def distributed(self) -> bool:
        """True for a grid over torch.distributed process groups; False for the serial and virtual grids."""
        return self.backend not in ("serial", "virtual")

    def _place(self, dims: Sequence[int], rank: int) -> None:
        """Set the dimensions, this rank's coordinates and the group sizes."""
        self.x, self.y, self.z, self.data = dims
        self.world_size = self.x * self.y * self.z * self.data
        self.rank = r = rank
        self.x_rank = r % self.x
        self.y_rank = (r // self.x) % self.y
        self.z_rank = (r // (self.x * self.y)) % self.z
        self.data_rank = r // (self.x * self.y * self.z)
        self.sizes = {name: self._size(axes) for name, axes in GROUP_DIMS.items()}

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_frozen", False):
            raise AttributeError("ProcessGrid is immutable; build a new one with axonn.init")
        super().__setattr__(name, value)

    def __deepcopy__(self, memo: dict) -> ProcessGrid:
        return self  # a handle on process groups: copies of a model share it

    def __repr__(self) -> str:
        return (f"ProcessGrid(x={self.x}, y={self.y}, z={self.z}, data={self.data}, rank={self.rank}, "
                f"coords=({self.x_rank},{self.y_rank},{self.z_rank},{self.data_rank}), {self.backend})")

    @property
    def dims(self) -> tuple[int, int, int, int]:
        """(x, y, z, data)."""
        return (self.x, self.y, self.z, self.data)

    @property
    def stats(self) -> CommStats:
        """Bytes and calls of every collective run through this grid."""
        return self.comm.stats

    def coord(self, dim: str) -> int:
        """This rank's index along one of x, y, z, data."""
        return {"x": self.x_rank, "y": self.y_rank, "z": self.z_rank, "data": self.data_rank}[dim]

    def size(self, name: str) -> int:
        """Number of ranks along a dimension or in a named group (x, y, z, data, batch, tensor, world)."""
        return self.sizes[name]

    @property
    def batch_shards(self) -> int:
        """Into how many contiguous equal slices the global batch is cut (Z x data)."""
        return self.z * self.data

    @property
    def batch_shard_index(self) -> int:
        """Which slice this rank takes; X and Y neighbours take the same one."""
        return self.data_rank * self.z + self.z_rank

    def _size(self, dims: Sequence[str]) -> int:
        n = 1
        for d in dims:
            n *= dict(zip(DIMS, self.dims))[d]
        return n

    def _rank_of(self, c: dict[str, int]) -> int:
        return c["x"] + self.x * (c["y"] + self.y * (c["z"] + self.z * c["data"]))

    def ranks_in(self, name: str) -> list[int]:
        """Global ranks of this rank's group `name`, in group order (ascending)."""
        sizes = dict(zip(DIMS, self.dims))
        mine = {d: self.coord(d) for d in DIMS}
        vary = GROUP_DIMS[name]
        ranks = [self._rank_of({**mine, **dict(zip(vary, vals))})
                 for vals in itertools.product(*(range(sizes[d]) for d in vary))]
        return sorted(ranks)

    def _build_groups(self) -> dict[str, Any]:
        # Group-local synchronisation: each rank creates only its own groups (6 calls, whatever the
        # world size), in the same order on every member.  Size-1 groups are never used.
        groups: dict[str, Any] = {}
        for name in GROUP_DIMS:
            if self.sizes[name] == 1:
                groups[name] = None
            elif name == "world":
                groups[name] = dist.group.WORLD
            else:
                groups[name] = _group_for(name, self.ranks_in(name))
        return groups


class _VirtualComm(Comm):
    """The Comm of a virtual grid: sizes only; a collective is a bug in the caller, so it raises."""

    def __init__(self, sizes: dict[str, int]) -> None:
        super().__init__({}, sizes)

    def _group(self, group: str) -> Any:
        raise RuntimeError(f"a virtual grid (dry run) has no process group; a collective over "
                           f"{group!r} cannot run")


# (role, ranks) -> process group, shared by every grid of this process. Each group holds backend
# threads and sockets, so a process that builds grids one after another (benchmarks, sweeps, tests)
# reuses them instead of piling them up. Torch cannot safely destroy and recreate locally
# synchronised groups (a new group may take a destroyed one's store keys), so they are kept.
_GROUPS: dict[tuple[str, tuple[int, ...]], Any] = {}


def _group_for(role: str, ranks: list[int]) -> Any:
    key = (role, tuple(ranks))
    group = _GROUPS.get(key)
    if group is not None:
        try:  # still registered with the current default group (not destroyed and re-initialised)
            if dist.get_process_group_ranks(group) == ranks:
                return group
        except (ValueError, RuntimeError, KeyError):
            pass
    group = dist.new_group(ranks, use_local_synchronization=True)
    _GROUPS[key] = group
    return group
