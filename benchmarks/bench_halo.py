"""Benchmark: halo exchange vs local convolution for CosmoFlow-sized Conv3D layers.

    .venv/bin/horovodrun --gloo -np 2 -H localhost:2 .venv/bin/python benchmarks/bench_halo.py

(or `make bench-halo`). Each of the 2 ranks holds half of a W^3 volume (split along
depth) and uses one intra-op thread. For the first two CosmoFlow convolutions (kernel 3,
'same': 4->16 channels at W^3, 16->32 at (W/2)^3) it times, as the median of repeated
tf.function calls: the halo exchange alone, the local 'valid' convolution alone on the
extended shard, the whole SpatialConv3D forward, and forward+backward. Rank 0 prints a
table and writes it to docs/bench_halo.md with the command and date.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as common  # noqa: E402  (benchmarks/, this script's folder)
from recipes import cli  # noqa: E402  (the project's argparse types)


def bench_layer(strategy, size: int, channels_in: int, filters: int, repeats: int) -> dict:
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_spatial as ks

    with strategy.scope():
        inputs = ks.Input((size, size, size, channels_in))
        layer = ks.layers.SpatialConv3D(filters, 3, padding="same", use_bias=False)
        model = keras.Model(inputs, layer(inputs))
    x_global_shape = (1, size, size, size, channels_in)
    x_local = tf.constant(
        np.random.default_rng(0).standard_normal(strategy.local_shape(x_global_shape)).astype("float32")
    )
    plans = layer.axis_plans(strategy.spatial_shape, x_local.shape)

    halo = tf.function(lambda x: layer._extend(x, strategy, plans, 0.0))
    extended = halo(x_local)
    local_conv = tf.function(
        lambda x: tf.nn.conv3d(x, layer.kernel, strides=[1] * 5, padding="VALID")
    )
    forward = tf.function(lambda x: model(x))

    @tf.function
    def forward_backward(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = model(x)
            loss = tf.reduce_sum(y)
        return tape.gradient(loss, [x, layer.kernel])

    def run(fn, arg):
        return lambda: [t.numpy() for t in tf.nest.flatten(fn(arg))]

    return {
        "size": size,
        "layer": f"{channels_in}->{filters}",
        "local": "x".join(map(str, x_local.shape[1:4])),
        "halo_planes": sum(max(h, 0) for h in plans[0].halo(strategy.coords[0])),
        "halo": common.median_seconds(run(halo, x_local), repeats),
        "conv": common.median_seconds(run(local_conv, extended), repeats),
        "forward": common.median_seconds(run(forward, x_local), repeats),
        "fwd_bwd": common.median_seconds(run(forward_backward, x_local), repeats),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=cli.int_list("--sizes", 2), default=None,
                        help="global extents W to measure (default 64,128; 32 with --quick)")
    parser.add_argument("--repeats", type=cli.positive_int("--repeats"), default=None, help="timed calls (default 7; 2 with --quick)")
    parser.add_argument("--output", default=None,
                        help="table written by rank 0 (default docs/bench_halo.md; in "
                             f"{common.QUICK_DIRECTORY} with --quick)")
    parser.add_argument("--quick", action="store_true", help="smoke test: W=32, 2 timed calls, writes outside docs/")
    args = parser.parse_args()
    args.sizes = args.sizes or ([32] if args.quick else [64, 128])
    args.repeats = args.repeats or (2 if args.quick else 7)
    args.output = args.output or (os.path.join(common.QUICK_DIRECTORY, "bench_halo.md") if args.quick else "docs/bench_halo.md")

    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    import keras_spatial as ks

    strategy = ks.SpatialStrategy((2, 1, 1))
    if strategy.size != 2:
        print("run on 2 ranks: horovodrun --gloo -np 2 -H localhost:2 python benchmarks/bench_halo.py")
        return 2
    rows = []
    for size in args.sizes:
        for channels_in, filters, extent in ((4, 16, size), (16, 32, size // 2)):
            row = bench_layer(strategy, extent, channels_in, filters, args.repeats)
            row["network"] = size
            rows.append(row)
            if strategy.rank == 0:
                print(f"W={size}: conv {row['layer']} at {extent}^3 done", flush=True)
    if strategy.rank != 0:
        return 0
    lines = [
        "# Halo exchange vs local convolution (2 ranks, split 2x1x1)",
        "",
        f"Command: `.venv/bin/horovodrun --gloo -np 2 -H localhost:2 .venv/bin/python benchmarks/bench_halo.py "
        f"--sizes {','.join(map(str, args.sizes))} --repeats {args.repeats}`  ",
        f"Date: {datetime.date.today().isoformat()}; machine: {os.cpu_count()} cores, "
        f"{platform.machine()}, TensorFlow {tf.__version__}; one intra-op thread per rank; "
        "median of the timed calls; rank 0's numbers.",
        "",
        "Kernel 3, 'same', no bias, batch 1, float32. `halo` = the exchange alone "
        "(alltoall of one plane each way plus assembling the extended shard); `conv` = "
        "the local 'valid' convolution alone on the extended shard; `forward` = the whole "
        "SpatialConv3D; `fwd+bwd` = forward and gradients for input and kernel.",
        "",
        "| CosmoFlow W | conv | global volume | local shard | halo planes | halo (ms) | local conv (ms) | halo / conv | forward (ms) | fwd+bwd (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['network']} | {r['layer']} | {r['size']}^3 | {r['local']} | {r['halo_planes']} | "
            f"{r['halo'] * 1e3:.1f} | {r['conv'] * 1e3:.1f} | {r['halo'] / r['conv']:.2f} | "
            f"{r['forward'] * 1e3:.1f} | {r['fwd_bwd'] * 1e3:.1f} |"
        )
    table = "\n".join(lines) + "\n"
    print(table)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        f.write(table)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
