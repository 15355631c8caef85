"""Probe: allocator peak of CosmoFlow blocks 1-3 on one interior 4-way shard, with the
shard convolved where it lies (`ops.convolve_with_boundary_planes`, what `SpatialConv3D`
runs for this layout) or extended (`ops.convolve_halo_parts`, its path before).

One process, no Horovod: one rank's shard of a 4x1x1 split of the paper's CosmoFlow at
256^3 (64x256x256x4 by default), [conv 3^3 -> LeakyReLU -> average pool 3^3/2 'same']
x `--blocks`, gradients of the kernels. The halo planes on both faces are stand-ins
computed from the shard (an interior rank receives on both). Prints the rise of
TensorFlow's BFC allocator peak during the second step, per variant.

The ninth session measured 669 MiB (boundary planes) against 549 MiB (extended) with the
op as first written (5ef269e); with the op as of 93bbaaf (kernel taps sliced once, the
Snapshot after all corrections) the tenth session measured 573 against 570 MiB, twice.
The 4x1x1 rows of bench_memory that had the op switched off were the allocator's pool,
not the tensors (docs/benchmarks.md, "Tenth session").

Usage: .venv/bin/python tools/probe_boundary_planes_memory.py [--planes 64] [--width 256] [--blocks 3]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHANNELS = [(4, 16), (16, 32), (32, 64)]


def run_variant(variant: str, planes: int, width: int, blocks: int) -> float:
    import numpy as np
    import tensorflow as tf

    from keras_spatial.ops.halo_convolution import convolve_halo_parts, convolve_with_boundary_planes
    from keras_spatial.ops.halo_exchange import HaloParts

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    rng = np.random.default_rng(0)
    shard = tf.constant(rng.standard_normal((1, planes, width, width, 4)).astype("float32"))
    kernels = [tf.Variable(rng.standard_normal((3, 3, 3, a, b)).astype("float32") * 0.05)
               for a, b in CHANNELS[:blocks]]

    def assemble(x, before, after):
        return tf.pad(tf.concat([before, x, after], 1), [[0, 0], [0, 0], [1, 1], [1, 1], [0, 0]])

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            x = shard
            for kernel in kernels:
                before, after = x[:, -1:] * 0.5, x[:, :1] * 0.5  # stand-ins for received planes
                if variant == "boundary":
                    y = convolve_with_boundary_planes(x, before, after, kernel, 0)
                else:
                    y = convolve_halo_parts(HaloParts([x, before, after], assemble), kernel, (1, 1, 1))
                x = tf.nn.avg_pool3d(tf.nn.leaky_relu(y, 0.01), 3, 2, "SAME")
            loss = tf.reduce_sum(x * x)
        return tape.gradient(loss, kernels)

    [g.numpy() for g in step()]
    base = tf.config.experimental.get_memory_info("CPU:0")["current"]
    tf.config.experimental.reset_memory_stats("CPU:0")
    [g.numpy() for g in step()]
    return (tf.config.experimental.get_memory_info("CPU:0")["peak"] - base) / 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--planes", type=int, default=64, help="shard depth (default 64)")
    parser.add_argument("--width", type=int, default=256, help="height and width (default 256)")
    parser.add_argument("--blocks", type=int, default=3, choices=(1, 2, 3), help="blocks (default 3)")
    parser.add_argument("--variant", choices=("boundary", "extended"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        print(f"PEAK {run_variant(args.variant, args.planes, args.width, args.blocks):.0f}")
        return 0
    env = {**os.environ, "TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPP_MIN_LOG_LEVEL": "3",
           "PYTHONPATH": os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p)}
    for variant in ("boundary", "extended"):
        print(f"{variant}: running ...", flush=True)
        result = subprocess.run(
            [sys.executable, __file__, "--variant", variant, "--planes", str(args.planes),
             "--width", str(args.width), "--blocks", str(args.blocks)],
            env=env, capture_output=True, text=True,
        )
        if result.returncode != 0:
            print(result.stderr[-2000:], file=sys.stderr)
            return result.returncode
        peak = result.stdout.split("PEAK")[1].split()[0]
        print(f"{variant}: allocator peak rise {peak} MiB (shard {args.planes}x{args.width}x{args.width}x4, "
              f"{args.blocks} blocks)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
