"""Worker side of the distributed layer tests: spatial layer vs plain Keras layer.

Every rank builds the plain Keras layer with the same weights, runs it on the whole
(global) batch, and compares its own shard of the output and of the input gradient, and
the world-summed weight gradients, with the spatial layer's. Ranks return numbers; the
pytest process asserts on them.
"""

from __future__ import annotations

import numpy as np

from tests.comparison import excess
from tests.distributed.layer_cases import Case, choose_extents
from tests.distributed.launcher import worker_setup


def outputs_and_grads(layer, x):
    """Output of `layer` on `x` and the gradients of sum(y^2) for x and the weights."""
    import tensorflow as tf

    x = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x)
        loss = tf.reduce_sum(y * y)
    grads = tape.gradient(loss, [x] + layer.trainable_weights)
    return [y.numpy()] + [g.numpy() for g in grads]


def build_layer(case: Case, spatial: bool):
    import keras

    import keras_spatial as ks

    classes = {
        "conv": (ks.layers.SpatialConv3D, keras.layers.Conv3D),
        "max": (ks.layers.SpatialMaxPooling3D, keras.layers.MaxPooling3D),
        "avg": (ks.layers.SpatialAveragePooling3D, keras.layers.AveragePooling3D),
    }[case.kind]
    return classes[0 if spatial else 1](**case.options)


def check_case(strategy, case: Case, graph: bool) -> dict:
    import keras
    import tensorflow as tf

    import keras_spatial as ks

    extents, servable = choose_extents(case, strategy.spatial_shape)
    rng = np.random.default_rng(case.seed)
    batch = case.batch * strategy.data_size
    x = rng.uniform(-1, 1, (batch, *extents, case.channels)).astype("float32")

    with strategy.scope():
        inputs = ks.Input((*extents, case.channels))
        layer = build_layer(case, spatial=True)
        if not servable:
            try:
                layer(inputs)
            except ValueError as error:
                return {"extents": extents, "raises": str(error)}
            return {"extents": extents, "raises": None}
        model = keras.Model(inputs, layer(inputs))
    reference = build_layer(case, spatial=False)
    reference.build((None, *extents, case.channels))
    weights = [
        (rng.standard_normal(w.shape) / np.sqrt(max(np.prod(w.shape[:-1]), 1))).astype("float32")
        for w in reference.get_weights()
    ]
    reference.set_weights(weights)
    layer.set_weights(weights)

    # Input gradients of the loss sum(y * cotangent); weight gradients of the same loss
    # divided by the number of global outputs, i.e. of a mean, as real losses are (a sum
    # over thousands of voxels would put float32 rounding of the reference itself near
    # the 1e-5 tolerance).
    #
    # The reference runs in the same mode (graph or eager) as the spatial layer: TF 2.21's
    # eager MaxPool3DGrad misroutes a cotangent for one of the seeded inputs here (its input
    # gradients do not sum to the output cotangents), while the graph-mode kernel is right.
    x_global = tf.constant(x)
    cotangent = tf.constant(rng.standard_normal(reference.compute_output_shape(x.shape)).astype("float32"))
    outputs_global = float(np.prod(cotangent.shape))

    def reference_step(x_global):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x_global)
            y_ref = reference(x_global)
            loss = tf.reduce_sum(y_ref * cotangent)
            mean_loss = loss / outputs_global
        return y_ref, tape.gradient(loss, x_global), tape.gradient(mean_loss, reference.trainable_weights)

    if graph:
        reference_step = tf.function(reference_step)
    y_ref, dx_ref, dw_ref = reference_step(x_global)

    def step(x_local, cot_local):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x_local)
            y = model(x_local)
            loss = tf.reduce_sum(y * cot_local)
            mean_loss = loss / outputs_global
        dx = tape.gradient(loss, x_local)
        dw = tape.gradient(mean_loss, model.trainable_weights)
        return y, dx, dw

    if graph:
        step = tf.function(step)
    x_local = tf.constant(strategy.shard(x, split_batch=True))
    cot_local = tf.constant(strategy.shard(cotangent.numpy(), split_batch=True))
    y, dx, dw = step(x_local, cot_local)
    if strategy.size > 1:
        dw = [
            strategy.world_sum(g)
            for g in dw
        ]
    result = {
        "extents": extents,
        "output": excess(y, strategy.shard(y_ref.numpy(), split_batch=True)),
        "input_grad": excess(dx, strategy.shard(dx_ref.numpy(), split_batch=True)),
        "max_abs_output": float(np.max(np.abs(y_ref))),
    }
    for variable, g, g_ref in zip(reference.trainable_weights, dw, dw_ref):
        result[f"grad_{variable.name}"] = excess(g, g_ref)
    return result


def stack_model(global_shape):
    """conv -> max pool -> conv -> average pool, all spatial layers."""
    import keras

    import keras_spatial as ks

    inputs = ks.Input(global_shape)
    y = ks.layers.SpatialConv3D(4, 3, padding="same", activation="relu", name="conv1")(inputs)
    y = ks.layers.SpatialMaxPooling3D(2, name="pool1")(y)
    y = ks.layers.SpatialConv3D(3, 2, strides=1, padding="same", name="conv2")(y)
    y = ks.layers.SpatialAveragePooling3D(3, strides=2, padding="same", name="pool2")(y)
    return keras.Model(inputs, y)


def run_stack_and_save(strategy, path_prefix, global_shape=(16, 16, 16, 2)) -> dict:
    """Run the stack on shards, gather the output; rank 0 saves model, input, output."""
    import keras

    seed = 7
    keras.utils.set_random_seed(seed)  # same initial weights on every rank
    with strategy.scope():
        model = stack_model(global_shape)
    x = np.random.default_rng(seed).uniform(-1, 1, (2, *global_shape)).astype("float32")
    y_local = model(strategy.shard(x))
    y_global = strategy.gather(y_local).numpy()
    if strategy.rank == 0:
        model.save(f"{path_prefix}.keras")
        np.savez(f"{path_prefix}.npz", x=x, y=y_global)
    return {"local_output_shape": tuple(y_local.shape), "global_output_shape": y_global.shape}


def thread_classes() -> dict:
    """How many of this process's threads are in SCHED_IDLE ("idle") or another class
    ("other"), the main thread's class, and the names of TensorFlow's threads (named
    "tf_...") that are in SCHED_IDLE."""
    import os
    import threading

    def is_idle(thread_id):
        return os.sched_getscheduler(thread_id) == os.SCHED_IDLE

    def name(thread_id):
        with open(f"/proc/self/task/{thread_id}/comm") as f:
            return f.read().strip()

    ids = [int(t) for t in os.listdir("/proc/self/task")]
    idle = [t for t in ids if is_idle(t)]
    return {
        "idle": len(idle), "other": len(ids) - len(idle),
        "main": "idle" if is_idle(threading.main_thread().native_id) else "other",
        "tensorflow_idle": [name(t) for t in idle if name(t).startswith("tf_")],
        "tensorflow_threads": sum(1 for t in ids if name(t).startswith("tf_")),
    }


def thread_affinities() -> list:
    """The distinct CPU sets of this process's threads (sorted lists)."""
    import os

    from keras_spatial.comm import runtime

    sets = runtime._for_each_thread(lambda thread_id: tuple(sorted(os.sched_getaffinity(thread_id))))
    return sorted(list(s) for s in set(sets))


def run_suite(meshes, save_dir=None, bad_spatial_shape=None) -> dict:
    """Everything one launch checks. `meshes` holds (spatial_shape, cases, graph).

    Several strategies are created one after another in this one process, which is part
    of what is tested.
    """
    worker_setup()
    import keras_spatial as ks

    results = {}
    if bad_spatial_shape is not None:
        try:
            ks.SpatialStrategy(bad_spatial_shape)
            results["bad_mesh"] = None
        except ValueError as error:
            results["bad_mesh"] = str(error)
    for spatial_shape, cases, graph in meshes:
        strategy = ks.SpatialStrategy(spatial_shape)
        results[("mesh", tuple(spatial_shape))] = {
            "rank": strategy.rank, "coords": strategy.coords, "data_index": strategy.data_index,
        }
        for case in cases:
            results[(tuple(spatial_shape), case.name, graph)] = check_case(strategy, case, graph)
        if save_dir is not None:
            prefix = f"{save_dir}/stack_{'x'.join(map(str, spatial_shape))}"
            results[("stack", tuple(spatial_shape))] = run_stack_and_save(strategy, prefix)
    results["thread_classes"] = thread_classes()  # TensorFlow's thread pools exist by now
    results["affinities"] = thread_affinities()
    # No rank may leave (and shut Horovod down) while another group is still working.
    strategy.barrier()
    return results
