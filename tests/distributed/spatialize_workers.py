"""Worker side of the spatialize tests: a plain Keras model made spatial on a mesh, against
the plain model on the whole volume in the same process."""

from __future__ import annotations

import numpy as np

from tests.comparison import excess
from tests.distributed.launcher import worker_setup

EXTENT = 8


def plain_model(head: bool):
    """A plain Keras model with every kind of layer spatialize converts or keeps."""
    import keras

    keras.utils.set_random_seed(1)
    x = keras.Input((EXTENT, EXTENT, EXTENT, 2))
    a = keras.layers.Conv3D(4, 3, padding="same", activation="relu")(x)
    b = keras.layers.BatchNormalization()(a, training=False)
    c = keras.layers.AveragePooling3D(2)(b)
    c = keras.layers.Conv3D(4, 2, padding="same")(c)  # even kernel, asymmetric halo
    d = keras.layers.Conv3DTranspose(4, 2, strides=2)(c)
    u = keras.layers.UpSampling3D(2)(keras.layers.MaxPooling3D(2)(a))
    e = keras.layers.Concatenate()([a, d, u])
    f = keras.layers.Add()([keras.layers.Dense(4)(e), a])
    f = keras.layers.LeakyReLU(0.1)(f)
    if head:
        g = keras.layers.GlobalMaxPooling3D()(f)
        return keras.Model(x, keras.layers.Dense(3, activation="tanh")(g))
    return keras.Model(x, keras.layers.Conv3D(2, 1)(f))


def run_spatialize_suite(shapes) -> dict:
    """For each spatial shape and both models: output and input gradient of the spatial
    model against the plain one (this rank's shard where sharded)."""
    worker_setup()
    import tensorflow as tf

    import keras_spatial as ks

    results = {}
    x = np.random.default_rng(0).standard_normal((2, EXTENT, EXTENT, EXTENT, 2)).astype("float32")
    for shape in shapes:
        strategy = ks.SpatialStrategy(spatial_shape=shape)
        for head in (False, True):
            plain = plain_model(head)
            spatial = strategy.spatialize(plain)

            def run(model, inputs, share):
                inputs = tf.constant(inputs)
                with tf.GradientTape() as tape:
                    tape.watch(inputs)
                    y = model(inputs)
                    loss = tf.reduce_sum(y * y) * share
                return y.numpy(), tape.gradient(loss, inputs).numpy()

            # The gradient rule (docs/design.md): a replicated output's loss is shared by
            # the S ranks of the spatial group, each taking 1/S of it.
            y_plain, dx_plain = run(plain, x, 1.0)
            share = 1.0 / strategy.spatial_size if head else 1.0
            y_spatial, dx_spatial = run(spatial, strategy.shard(x), share)
            if not head:
                y_plain = strategy.shard(y_plain)
            results[(tuple(shape), head)] = {
                "output": excess(y_spatial, y_plain),
                "input_grad": excess(dx_spatial, strategy.shard(dx_plain)),
                "types": sorted({type(layer).__name__ for layer in spatial.layers}),
            }
    return results
