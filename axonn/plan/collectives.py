"""Ring collective costs with a node-aware two-level bandwidth hierarchy.

Rank layout (shared with axonn.grid): X fastest, then Y, Z, data, so a group's ranks are spaced by
a fixed stride: X 1, Y x, Z x*y, data x*y*z. From the stride and GPUs per node we know how many
members of a group share a node (q) and how many nodes it spans (m), and cost the collective
hierarchically: a ring inside each node over NVLink-class links, then a ring across the m nodes on
1/q of the data, where a node's NICs are shared by all its devices (they all run the same
collective at the same time, one group each or q members per group).
"""
from __future__ import annotations

import functools

from axonn.plan.hardware import Hardware

KINDS = ("all_reduce", "all_gather", "reduce_scatter")
GROUPS = ("x", "y", "z", "data", "batch", "tensor", "world")


def ring_time(kind: str, n_bytes: float, p: int, bw: float, lat: float) -> float:
    """Flat ring cost: all-reduce 2(p-1)/p*n/bw + 2(p-1)*lat; all-gather/reduce-scatter half."""
    if p <= 1 or n_bytes <= 0:
        return 0.0
    passes = 2 if kind == "all_reduce" else 1
    return passes * ((p - 1) / p * n_bytes / bw + (p - 1) * lat)


def wire_bytes(kind: str, n_bytes: float, p: int) -> float:
    """Bytes one rank sends in a ring collective on an n-byte buffer (full, gathered size)."""
    if p <= 1:
        return 0.0
    return (2 if kind == "all_reduce" else 1) * (p - 1) / p * n_bytes


def group_strides(x: int, y: int, z: int, data: int) -> dict[str, tuple[int, int]]:
    """(size, stride) of each named group in the X-fastest rank layout (batch = Z x data)."""
    return {"x": (x, 1), "y": (y, x), "z": (z, x * y), "data": (data, x * y * z),
            "batch": (z * data, x * y), "tensor": (x * y * z, 1), "world": (x * y * z * data, 1)}


@functools.lru_cache(maxsize=4096)
def group_layout(p: int, stride: int, gpus_per_node: int, gpus: int) -> tuple[int, int]:
    """(q, m): members of a group per node and nodes spanned, for the group holding rank 0.

    Groups are congruent in the usual power-of-two layouts; for odd sizes we take rank 0's group
    as representative and round q up (a slightly optimistic intra share).
    """
    if p <= 1:
        return 1, 1
    if gpus <= gpus_per_node:
        return p, 1
    nodes = len({(i * stride) // gpus_per_node for i in range(p)})
    q = -(-p // nodes)
    return q, nodes


def collective_time(kind: str, n_bytes: float, p: int, stride: int, gpus: int,
                    hw: Hardware, gpus_per_node: int | None = None) -> float:
    """Seconds for one collective on an n-byte buffer over a group of p ranks spaced by `stride`.

    With q members per node over m nodes (p = q*m) and g devices per node:
      t = ring(q, n, intra_bw, intra_lat) + ring(m, n/q, node_bw/g, inter_lat)
    where ring() is `ring_time` of the same kind. m = 1 leaves the intra term only; q = 1 is a plain
    ring across nodes, each device getting 1/g of its node's NIC bandwidth.
    """
    if p <= 1 or n_bytes <= 0:
        return 0.0
    g = hw.gpus_per_node if gpus_per_node is None else gpus_per_node
    q, m = group_layout(p, stride, g, gpus)
    t = ring_time(kind, n_bytes, q, hw.intra_bw, hw.intra_lat)
    if m > 1:
        sharing = min(g, gpus)  # devices of one node pushing through its NICs at once
        t += ring_time(kind, n_bytes / q, m, hw.node_bw / sharing, hw.inter_lat)
    return t
