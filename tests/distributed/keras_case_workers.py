"""Worker side of tests/distributed/test_keras_parameterizations.py.

Each case is one Keras 3D layer with the arguments of one of Keras's own test
parameterizations (`tests.keras_parameterizations`), in a plain Keras model
`Input -> layer`, made spatial by `keras_spatial.spatialize` and run in a `tf.function`
on this rank's shard; plain Keras runs the same weights on the whole volume here too.
Extents are the smallest, from odd ones up, that the mesh can split for the layer, so
most split axes are uneven.
"""

from __future__ import annotations

import traceback
import zlib

import numpy as np

from tests.comparison import excess
from tests.distributed.launcher import worker_setup

GLOBAL_LAYERS = ("GlobalAveragePooling3D", "GlobalMaxPooling3D")


def _plain_model(case, extents, channels):
    import keras

    inputs = keras.Input((*extents, channels))
    layer = getattr(keras.layers, case.layer)(**case.options)
    return keras.Model(inputs, layer(inputs))


def choose_extents(case, spatial_shape, channels):
    """The smallest extents (start + k on every axis; starts odd, 2 s + 1 on an axis of
    s > 1 shards, else 5) whose layout `plan_for_mesh` accepts, with Keras's output
    non-empty. Pure arithmetic: no collective."""
    from keras_spatial.context import no_strategy
    from keras_spatial.plan import plan_for_mesh
    from keras_spatial.spatialize import _build_without_strategy, _spatial_config, _functional

    starts = [2 * s + 1 if s > 1 else 5 for s in spatial_shape]
    error = None
    for k in range(0, 24, 2):
        extents = tuple(start + k for start in starts)
        with no_strategy():
            try:
                model = _plain_model(case, extents, channels)
            except ValueError as e:  # Keras itself rejects the shape (no output)
                error = e
                continue
            if any(d == 0 for d in model.output.shape[1:]):
                continue
            global_model = _build_without_strategy(keras_from_config(), _spatial_config(_functional(model)))
            try:
                plan_for_mesh(global_model, spatial_shape)
            except ValueError as e:
                error = e
                continue
        return extents
    raise AssertionError(f"no extents serve {case.name} on {spatial_shape}: {error}")


def keras_from_config():
    import keras

    return keras.Model.from_config


def check_case(strategy, case) -> dict:
    import keras
    import tensorflow as tf

    import keras_spatial as ks

    channels = 4 if case.options.get("groups", 1) > 1 else 3
    extents = choose_extents(case, strategy.spatial_shape, channels)
    rng = np.random.default_rng(zlib.crc32(case.name.encode()))  # the same on every rank
    batch = 2 * strategy.data_size
    x = rng.uniform(-1, 1, (batch, *extents, channels)).astype("float32")
    with ks.context.no_strategy():
        plain = _plain_model(case, extents, channels)
    weights = [rng.uniform(-0.5, 0.5, w.shape).astype("float32") for w in plain.get_weights()]
    plain.set_weights(weights)
    spatial = ks.spatialize(plain, strategy)
    replicated = case.layer in GLOBAL_LAYERS
    training = case.layer == "BatchNormalization"
    cotangent = rng.standard_normal((batch, *plain.output.shape[1:])).astype("float32")
    outputs_global = float(cotangent.size)

    @tf.function
    def reference_step(x_global):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x_global)
            y = plain(x_global, training=training)
            loss = tf.reduce_sum(y * cotangent)
            mean_loss = loss / outputs_global
        return y, tape.gradient(loss, x_global), tape.gradient(mean_loss, plain.trainable_weights)

    y_ref, dx_ref, dw_ref = reference_step(tf.constant(x))

    def mine(array):
        return strategy.shard(array, split_batch=True)

    def my_rows(array):
        per_group = array.shape[0] // strategy.data_size
        return array[strategy.data_index * per_group:(strategy.data_index + 1) * per_group]

    share = strategy.spatial_size if replicated else 1
    cot_local = my_rows(cotangent) if replicated else mine(cotangent)

    @tf.function
    def step(x_local):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x_local)
            y = spatial(x_local, training=training)
            loss = tf.reduce_sum(y * cot_local) / share
            mean_loss = loss / outputs_global
        return y, tape.gradient(loss, x_local), tape.gradient(mean_loss, spatial.trainable_weights)

    y, dx, dw = step(tf.constant(mine(x)))
    result = {
        "extents": extents,
        "output": excess(y, my_rows(y_ref.numpy()) if replicated else mine(y_ref.numpy())),
        "input_grad": excess(dx, mine(dx_ref.numpy())),
    }
    for variable, g, g_ref in zip(plain.trainable_weights, dw, dw_ref):
        result[f"grad_{variable.name}"] = excess(strategy.world_sum(g), g_ref)
    return result


def run_keras_cases(meshes) -> dict:
    """`meshes`: (spatial_shape, cases). Returns {(spatial_shape, case name): result}."""
    worker_setup()
    import keras_spatial as ks

    results = {}
    strategy = None
    for spatial_shape, cases in meshes:
        strategy = ks.SpatialStrategy(spatial_shape)
        for case in cases:
            try:
                results[(tuple(spatial_shape), case.name)] = check_case(strategy, case)
            except Exception as error:  # reported per case; the other cases still run
                results[(tuple(spatial_shape), case.name)] = {"error": f"{type(error).__name__}: {error}\n{traceback.format_exc()}"}
    strategy.barrier()
    return results
