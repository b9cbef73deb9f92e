"""Hardware profiles: peak compute, GEMM ceiling, memory, and the two-level network."""
from __future__ import annotations

import dataclasses

GB = 1e9
GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator kind and the node/network it sits in (bandwidths in bytes/s, per direction)."""

    name: str
    peak_flops: float  # dense bf16 datasheet peak per device
    gemm_eff: float  # practical ceiling of a large GEMM as a fraction of peak
    attn_eff: float  # fused (flash) attention as a fraction of peak
    hbm_bw: float  # device memory bandwidth, for memory-bound kernels
    memory_bytes: float  # device memory capacity
    gpus_per_node: int
    intra_bw: float  # effective ring bandwidth per device inside a node
    node_bw: float  # effective NIC bandwidth per node, shared by the node's devices
    intra_lat: float  # per ring step, seconds
    inter_lat: float
    gemm_half_dim: float = 32.0  # GEMM dim at which the shape factor halves (see compute.py)
    launch_s: float = 5e-6  # fixed cost per kernel
    # Collectives progress while compute runs (GPU copy engines / NICs). False for CPU ranks under
    # gloo: the transfers and reductions run on the same cores as the GEMMs, so nothing hides them.
    hides_comm: bool = True
    note: str = ""

    def describe(self) -> str:
        """One line for tables and logs."""
        return (f"{self.name}: {self.peak_flops / 1e12:.1f} TF/s peak x {self.gemm_eff:.2f}, "
                f"{self.memory_bytes / GiB:.0f} GiB, {self.gpus_per_node}/node, "
                f"intra {self.intra_bw / GB:.0f} GB/s, node NICs {self.node_bw / GB:.0f} GB/s")


# Slingshot-11 on all three systems: 4 NICs x 25 GB/s per node per direction; we assume ~90% is
# reachable by NCCL/RCCL (90 GB/s per node). Intra-node numbers are per-direction link totals
# derated by 0.8 for what a ring collective actually reaches. Sources: vendor datasheets (A100,
# MI250X, H100/GH200), NERSC/OLCF/CSCS system pages; the H100 GEMM ceiling is the 798/989 TF/s
# measured on an 8192^3 bf16 GEMM (FACTS.md). Everything else is an assumption stated here.
PRESETS: dict[str, Hardware] = {
    "perlmutter-a100": Hardware(
        name="perlmutter-a100", peak_flops=312e12, gemm_eff=0.85, attn_eff=0.55,
        hbm_bw=1.555e12, memory_bytes=40 * GiB, gpus_per_node=4,
        intra_bw=240e9,  # NVLink3: 12 links x 25 GB/s = 300 GB/s per direction, x0.8
        node_bw=90e9, intra_lat=5e-6, inter_lat=15e-6,
        note="A100-SXM4 40 GB nodes (Perlmutter also has 256 nodes with 80 GB; not modelled)"),
    "frontier-mi250x": Hardware(
        name="frontier-mi250x", peak_flops=191.5e12, gemm_eff=0.65, attn_eff=0.35,
        hbm_bw=1.6e12, memory_bytes=64 * GiB, gpus_per_node=8,
        intra_bw=50e9,  # Infinity Fabric: 50-100 GB/s between packages bounds an 8-GCD ring
        node_bw=90e9, intra_lat=8e-6, inter_lat=15e-6,
        note="per MI250X GCD; the GEMM ceiling assumes tuned rocBLAS/hipBLASLt kernels"),
    "alps-h100": Hardware(
        name="alps-h100", peak_flops=989e12, gemm_eff=798 / 989, attn_eff=0.5,
        hbm_bw=4.0e12, memory_bytes=96 * GiB, gpus_per_node=4,
        intra_bw=360e9,  # NVLink4 between the 4 GH200 of a node: ~450 GB/s per direction, x0.8
        node_bw=90e9, intra_lat=5e-6, inter_lat=15e-6,
        note="GH200 superchips: H100 with 96 GB HBM3"),
    "h100": Hardware(
        name="h100", peak_flops=989e12, gemm_eff=798 / 989, attn_eff=0.5,
        hbm_bw=3.35e12, memory_bytes=80 * GiB, gpus_per_node=8,
        intra_bw=360e9,  # NVSwitch, 450 GB/s per direction, x0.8
        node_bw=360e9,  # 8 x 400 Gb/s ConnectX-7 = 400 GB/s, x0.9 (only if you go past 8 GPUs)
        intra_lat=5e-6, inter_lat=10e-6,
        note="one DGX-style node of 8 x H100 SXM 80 GB"),
}


def hardware_choices() -> list[str]:
    """Every name `--hardware` accepts."""
    return sorted(PRESETS) + ["local"]
