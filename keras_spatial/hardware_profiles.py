"""Named machine descriptions for the performance model (`keras_spatial.cost_model`).

`PROFILES` maps a name to the fields of a `cost_model.Hardware`;
`cost_model.as_hardware("lassen")` builds one. The figures come from public spec sheets; the efficiencies, latencies and
per-layer overheads are assumptions (docs/performance_model.md):

* "lassen": NVIDIA V100 SXM2 (15.7 TFLOP/s float32, 900 GB/s HBM2, 16 GB), 4 per node as
  in LLNL Lassen / IBM AC922 (3 NVLink 2 bricks of 25 GB/s per direction between peers,
  2 EDR InfiniBand ports of 100 Gb/s per node).
* "h100": NVIDIA H100 SXM5 (67 TFLOP/s float32 without tensor cores, 3.35 TB/s HBM3,
  80 GB), 8 per node, NVLink 4 (450 GB/s per direction), one 400 Gb/s NIC per GPU.

A measured description of another machine can be written as JSON with the same keys and
passed wherever a profile name is accepted (`cost_model.as_hardware`).

Example:
>>> PROFILES["lassen"]["ranks_per_node"]
4
"""

from __future__ import annotations

GB = 1e9

PROFILES = {
    "lassen": dict(
        name="Lassen-like (4 x V100 16 GB, NVLink 2, 2 x EDR IB)", peak_flops=15.7e12,
        flop_efficiency=0.5, memory_bandwidth=900 * GB, memory_efficiency=0.8,
        memory_capacity=16 * GB, intra_node_latency=3e-6, intra_node_bandwidth=75 * GB,
        inter_node_latency=5e-6, inter_node_bandwidth=25 * GB, ranks_per_node=4,
        op_overhead=20e-6,
    ),
    "h100": dict(
        name="H100 cluster (8 x H100 80 GB, NVLink 4, 8 x 400 Gb/s)", peak_flops=67e12,
        flop_efficiency=0.5, memory_bandwidth=3350 * GB, memory_efficiency=0.8,
        memory_capacity=80 * GB, intra_node_latency=2e-6, intra_node_bandwidth=450 * GB,
        inter_node_latency=4e-6, inter_node_bandwidth=400 * GB, ranks_per_node=8,
        op_overhead=10e-6,
    ),
}


__all__ = ["GB", "PROFILES"]
