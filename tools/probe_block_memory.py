"""Probe: peak memory of CosmoFlow's first two blocks on one 4-way shard, by variant.

One process, no Horovod: the shapes of one rank of a 4x1x1 split of the paper's
CosmoFlow at 256^3 (a 64x256x256x4 shard), conv 3^3 (4->16) -> LeakyReLU -> average pool
3^3/2 'same' -> conv 3^3 (16->32) -> LeakyReLU, gradients of both kernels. Each variant
runs in a fresh process and prints the rise of the peak RSS (VmHWM) during one step:

    A  'same' convolution on the shard (what one process does on a slab; the floor)
    B  'valid' convolution on the shard padded by one tf.pad (the halo planes' room)
    C  B, plus a gradient path from one plane of the pooled activation, as on a rank that
       sends that plane to its neighbour (slice -> its gradient is a full-size Pad + AddN)
    E  C, with the first convolution's input extended by a concatenation AND a pad, as
       `extend_to_halo` does for an exchanging axis

Usage: .venv/bin/python tools/probe_block_memory.py [--planes 64] [--variants A,B,C,E]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

MODES = {"A": "same", "B": "pad", "C": "pad", "E": "concat_pad"}


def _peak_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def run_variant(variant: str, planes: int) -> None:
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((1, planes, 256, 256, 4)).astype("float32"))
    k1 = tf.Variable(rng.standard_normal((3, 3, 3, 4, 16)).astype("float32") * 0.1)
    k2 = tf.Variable(rng.standard_normal((3, 3, 3, 16, 32)).astype("float32") * 0.1)
    cotangent = tf.constant(rng.standard_normal((1, 1, 256, 256, 16)).astype("float32"))

    def conv(inputs, kernel, mode):
        if mode == "same":
            return tf.nn.conv3d(inputs, kernel, [1] * 5, "SAME")
        if mode == "concat_pad":
            inputs = tf.concat([inputs[:, :1], inputs, inputs[:, -1:]], axis=1)
            inputs = tf.pad(inputs, [[0, 0], [0, 0], [1, 1], [1, 1], [0, 0]])
        else:
            inputs = tf.pad(inputs, [[0, 0], [1, 1], [1, 1], [1, 1], [0, 0]])
        return tf.nn.conv3d(inputs, kernel, [1] * 5, "VALID")

    # The shard is an argument, not a captured constant: Grappler would fold the padding and
    # concatenation of a constant into graph constants and distort the comparison.
    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            hidden = tf.nn.leaky_relu(conv(x, k1, MODES[variant]), 0.01)
            pooled = tf.nn.avg_pool3d(hidden, [1, 3, 3, 3, 1], [1, 2, 2, 2, 1], "SAME")
            out = tf.nn.leaky_relu(conv(pooled, k2, "same"), 0.01)
            loss = tf.reduce_sum(out * out)
            if variant in ("C", "E"):
                loss += tf.reduce_sum(hidden[:, :1] * cotangent)
        return tape.gradient(loss, [k1, k2])

    before = _peak_mib()
    [g.numpy() for g in step(x)]
    print(f"| {variant} | {planes} | {before:.0f} | {_peak_mib() - before:.0f} |", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--planes", type=int, default=64, help="depth of the shard (default 64)")
    parser.add_argument("--variants", default="A,B,C,E", help="comma-separated subset of A,B,C,E")
    parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.variant:
        run_variant(args.variant, args.planes)
        return 0
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in MODES]
    if unknown or not variants:
        parser.error(f"--variants must be a comma-separated subset of A,B,C,E. Received: {args.variants!r}")
    if args.planes < 3:
        parser.error(f"--planes must be at least 3. Received: {args.planes}")
    print("| variant | shard depth | RSS peak before the step (MiB) | rise during the step (MiB) |")
    print("|---|---|---|---|")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    for variant in variants:
        subprocess.run([sys.executable, os.path.abspath(__file__), "--variant", variant,
                        "--planes", str(args.planes)], check=True, env=env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
