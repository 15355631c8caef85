"""Demo: a 2-rank spatial forward and backward pass checked against plain Keras.

Run with `make demo`, or by hand:

    .venv/bin/horovodrun --gloo -np 2 -H localhost:2 .venv/bin/python tools/demo_layers.py

Each rank holds half (along depth) of a random 64^3 x 4 volume, runs a small conv/pool
stack with halo exchange, and the gathered output and gradients are compared with plain
Keras layers running the same weights on the whole volume.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402


def build(size: int, channels: int):
    import keras

    import keras_spatial as ks

    # Max pooling comes first, on the raw input: after a convolution, two values of a
    # window can lie within float32 rounding of each other, and the spatial and the
    # single-process convolutions (different summation orders) may then pick different
    # maxima, which moves a gradient entry to the neighbouring voxel (see the README).
    inputs = ks.Input((size, size, size, channels))
    y = ks.layers.SpatialMaxPooling3D(2, strides=1, padding="same")(inputs)
    y = ks.layers.SpatialConv3D(16, 3, padding="same", activation="relu")(y)
    y = ks.layers.SpatialAveragePooling3D(3, strides=2, padding="same")(y)
    y = ks.layers.SpatialConv3D(32, 3, padding="same", activation="relu")(y)
    y = ks.layers.SpatialConv3D(8, 2, padding="same")(y)
    return keras.Model(inputs, y)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=64, help="global extent W of the W^3 volume")
    parser.add_argument("--spatial", default="2,1,1", help="shards along depth,height,width")
    args = parser.parse_args()

    import keras
    import tensorflow as tf

    import keras_spatial as ks

    strategy = ks.SpatialStrategy(tuple(int(s) for s in args.spatial.split(",")))
    log = print if strategy.rank == 0 else (lambda *a, **k: None)
    log(f"{strategy}; volume {args.size}^3 x 4")
    keras.utils.set_random_seed(1234)  # identical weights on every rank
    with strategy.scope():
        model = build(args.size, 4)
    reference = ks.to_keras_model(model)
    x = np.random.default_rng(0).standard_normal((1, args.size, args.size, args.size, 4)).astype("float32")

    @tf.function
    def spatial_step(x_local):
        with tf.GradientTape() as tape:
            y = model(x_local)
            loss = tf.reduce_sum(tf.square(y)) / float(np.prod(reference.output_shape[1:]))
        return y, tape.gradient(loss, model.trainable_weights)

    start = time.perf_counter()
    y_local, grads = spatial_step(tf.constant(strategy.shard(x)))
    grads = [strategy.world_sum(g) for g in grads]
    elapsed = time.perf_counter() - start
    y_global = strategy.gather(y_local).numpy()

    with tf.GradientTape() as tape:
        y_ref = reference(x)
        loss = tf.reduce_sum(tf.square(y_ref)) / float(np.prod(y_ref.shape))
    grads_ref = tape.gradient(loss, reference.trainable_weights)

    out_diff = float(np.max(np.abs(y_global - y_ref.numpy())))
    # Relative to each gradient's largest entry: a kernel gradient sums over every voxel,
    # so float32 rounding grows with the volume.
    grad_diff = max(
        float(np.max(np.abs(g - r)) / np.max(np.abs(r))) for g, r in zip(grads, grads_ref)
    )
    log(f"spatial forward+backward (first call, includes tracing): {elapsed:.2f} s")
    log(f"largest |spatial - keras| output:          {out_diff:.3e}  (max |output| {np.max(np.abs(y_ref)):.3f})")
    log(f"largest |spatial - keras| / max|keras| weight gradient: {grad_diff:.3e}")
    # Float32 rounding: outputs sum a few hundred products (1e-5 relative is ample); a
    # kernel gradient sums over every voxel of the volume (262,144 at 64^3), where
    # different summation orders differ by ~1e-5 of the largest entry.
    ok = out_diff <= 1e-5 * np.max(np.abs(y_ref)) and grad_diff <= 1e-4
    log("OK: the spatial model computes what one process computes on the whole volume" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
