"""Ring costs, the node-aware hierarchy, and the memory model, on hand-checked numbers."""
import dataclasses

import pytest

from axonn.plan.collectives import collective_time, group_layout, group_strides, ring_time, wire_bytes
from axonn.plan.hardware import PRESETS
from axonn.plan.memory import memory_breakdown
from axonn.plan.shapes import ModelShape
from axonn.plan.volumes import Grid

HW = dataclasses.replace(PRESETS["alps-h100"], intra_bw=100e9, node_bw=40e9, intra_lat=1e-5,
                         inter_lat=2e-5, gpus_per_node=4)


def test_ring_formulas():
    # all-reduce: 2(p-1)/p * n/bw + 2(p-1) * lat = 2*3/4*1e9/1e11 + 6e-5
    assert ring_time("all_reduce", 1e9, 4, 1e11, 1e-5) == pytest.approx(0.015 + 6e-5)
    # all-gather / reduce-scatter: (p-1)/p * n/bw + (p-1) * lat
    assert ring_time("all_gather", 1e9, 4, 1e11, 1e-5) == pytest.approx(0.0075 + 3e-5)
    assert ring_time("reduce_scatter", 1e9, 4, 1e11, 1e-5) == pytest.approx(0.0075 + 3e-5)
    assert ring_time("all_reduce", 1e9, 1, 1e11, 1e-5) == 0.0
    assert wire_bytes("all_reduce", 1000, 4) == 1500
    assert wire_bytes("all_gather", 1000, 4) == 750
    assert wire_bytes("all_gather", 1000, 1) == 0


def test_strides_follow_x_fastest_layout():
    assert group_strides(2, 3, 4, 5) == {
        "x": (2, 1), "y": (3, 2), "z": (4, 6), "data": (5, 24), "batch": (20, 6),
        "tensor": (24, 1), "world": (120, 1)}


def test_group_inside_a_node_uses_intra_bandwidth_only():
    # X = 4 with stride 1 on 4 GPUs per node: all members share a node.
    assert group_layout(4, 1, 4, 16) == (4, 1)
    t = collective_time("all_reduce", 1e9, 4, 1, 16, HW)
    assert t == pytest.approx(ring_time("all_reduce", 1e9, 4, HW.intra_bw, HW.intra_lat))
    # a job smaller than a node never leaves it
    assert collective_time("all_gather", 1e9, 2, 2, 2, HW) == pytest.approx(
        ring_time("all_gather", 1e9, 2, HW.intra_bw, HW.intra_lat))


def test_group_across_nodes_shares_the_nic():
    # stride 4 on 4/node: one member per node, the 4 GPUs of a node split its 40 GB/s.
    assert group_layout(4, 4, 4, 16) == (1, 4)
    t = collective_time("all_reduce", 1e9, 4, 4, 16, HW)
    assert t == pytest.approx(2 * 3 / 4 * 1e9 / 10e9 + 2 * 3 * 2e-5)


def test_hierarchical_group():
    # p = 8, stride 1, 4/node: q = 4 in a node, m = 2 nodes; inter ring on n/q.
    assert group_layout(8, 1, 4, 16) == (4, 2)
    intra = 2 * 3 / 4 * 1e9 / 100e9 + 2 * 3 * 1e-5
    inter = 2 * 1 / 2 * (1e9 / 4) / (40e9 / 4) + 2 * 1 * 2e-5
    assert collective_time("all_reduce", 1e9, 8, 1, 16, HW) == pytest.approx(intra + inter)
    # stride 2 on 4/node: members {0,2} | {4,6} | ... -> 2 per node over 4 nodes
    assert group_layout(8, 2, 4, 16) == (2, 4)


TINY = ModelShape("t", hidden=8, layers=1, heads=2, kv_heads=2, ffn=16, vocab=32, tied=False)


def test_memory_by_hand_single_rank():
    # params: q,k,v,o 4*64 + gate,up,down 3*128 = 640; embedding + head 2*32*8 = 512;
    # 3 RMSNorms * 8 = 24 -> 1176.
    assert TINY.params == 1176
    m = memory_breakdown(TINY, Grid(1, 1, 1, 1), seq=4, micro_batch=1, checkpoint=False)
    # fp32 parameters and gradients, AdamW's two fp32 moments (the trainer under bf16 autocast)
    assert m["weights"] == 4 * 1176 and m["gradients"] == 4 * 1176
    assert m["optimizer"] == 8 * 1176
    # no Z split: the blocks cast to bf16 kept from forward to backward, the 640 block weights and
    # the 32 x 8 output table, 2 bytes each (the same with checkpointing here: one layer); fp32: none
    assert m["z_buffers"] == 2 * (640 + 256)
    assert memory_breakdown(TINY, Grid(1, 1, 1, 1), 4, 1, False, precision="fp32")["z_buffers"] == 0
    # block: T=4 tokens; width = 2H (norm inputs) + 5 column inputs * H/X + (q+k+v 24 + attn 8
    # + 3F 48) = 16 + 40 + 80 = 136 -> 2*4*136 = 1088, + lse 4*4*2 = 32 -> 1120.
    # activations = stored 1120 + one block in flight 1120 + logits 10*4*32 = 1280.
    assert m["activations"] == 1120 + 1120 + 1280
    ck = memory_breakdown(TINY, Grid(1, 1, 1, 1), seq=4, micro_batch=1, checkpoint=True)
    assert ck["activations"] == (2 * 4 * 8 + 1120) + 1120 + 1280


def test_memory_by_hand_z_split_and_padding():
    m = memory_breakdown(TINY, Grid(1, 1, 2, 1), seq=4, micro_batch=1, checkpoint=False)
    # every matrix halves over Z; the norms stay whole: 640/2 + 512/2 + 24 = 600
    assert m["weights"] == 4 * 600
    # largest gathered block: the 32 x 8 table = 256; prefetch (2 x bf16) + unscattered gradient (fp32)
    assert m["z_buffers"] == 256 * (2 * 2 + 4)
    assert memory_breakdown(TINY, Grid(1, 1, 2, 1), 4, 1, False, prefetch=False)["z_buffers"] == 256 * (2 + 4)
    # Z = 3: 8-row blocks pad to 9 rows (q,k,v,o: 9*8 = 72), 16-row to 18 (gate, up: 144),
    # down 8 rows of 16 -> 9*16 = 144, tables 32 -> 33 rows (264 each); per rank / 3.
    m3 = memory_breakdown(TINY, Grid(1, 1, 3, 1), seq=4, micro_batch=1, checkpoint=False)
    assert m3["weights"] == 4 * ((4 * 72 + 3 * 144 + 2 * 264) / 3 + 24)
