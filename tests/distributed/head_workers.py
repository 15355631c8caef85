"""Worker side of the distributed head-layer tests: flatten, global pooling, batch norm.

Every rank builds the plain Keras layer (or model) with the same weights and runs it on
the whole global batch; ranks return `excess` numbers (<= 0: within rtol=atol=1e-5) and
small arrays, and the pytest process asserts on them.

Which gradients are compared (docs/design.md, "Gradient rule": the sum over the world of
the per-rank gradients is the gradient of the sum of the per-rank losses):

- Sharded outputs (batch normalization): each rank's loss covers its own shard,
  `sum(y_local * cot_local)`, so the world's losses add up to the global loss; input
  gradients are compared shard by shard and WORLD-SUMMED weight gradients (of the same
  loss divided by the number of global outputs) with the serial ones.
- Replicated outputs (flatten, global pooling): all S ranks of a spatial group hold the
  same output of their data group's samples; each rank takes `sum(y * cot) / S`, its
  share of the group's loss, so that again the world's losses add up to the global loss
  and each rank's input gradient is its shard of the serial input gradient. Batch norm
  of a replicated (batch, features) tensor ('bn-replicated*') is checked the same way,
  with the input gradients of the S copies summed, as the gather's backward pass does.
- The end-to-end model ends in a replicated dense head whose loss, a mean squared error
  over the data group's batch, is computed identically on every rank of the group (as in
  real training): WORLD-AVERAGED weight gradients equal the serial model's gradients of
  the mean squared error over the global batch.
"""

from __future__ import annotations

import numpy as np

from tests.distributed.launcher import worker_setup
from tests.comparison import excess

EXTENTS = (8, 6, 4)  # divisible by every mesh used: (2,1,1), (1,2,1), (1,2,2)
CHANNELS = 3
BATCH_PER_GROUP = 2

REPLICATED_CASES = {
    "flatten": ("SpatialFlatten", {}),
    "gap": ("SpatialGlobalAveragePooling3D", {}),
    "gap-keepdims": ("SpatialGlobalAveragePooling3D", {"keepdims": True}),
    "gmp": ("SpatialGlobalMaxPooling3D", {}),
    "gmp-keepdims-ties": ("SpatialGlobalMaxPooling3D", {"keepdims": True}),
}
BN_CASES = {
    "bn": {"momentum": 0.9},
    "bn-spatial-stats": {"synchronized": False, "momentum": 0.8},
    "bn-noscale-eps": {"scale": False, "epsilon": 1e-2, "momentum": 0.5},
    "bn-renorm": {"renorm": True, "renorm_momentum": 0.7, "momentum": 0.6},
    # Called with a mask selecting about 60% of the positions (MASKED_CASES).
    "bn-masked": {"momentum": 0.9},
    "bn-masked-spatial-stats": {"synchronized": False, "momentum": 0.8},
    # A (batch, features) tensor replicated on the spatial group, as after SpatialFlatten.
    "bn-replicated": {"momentum": 0.7},
    "bn-replicated-spatial-stats": {"synchronized": False, "momentum": 0.7},
}
REPLICATED_FEATURES = 5
MASKED_CASES = ("bn-masked", "bn-masked-spatial-stats")


def _layer_class(name):
    from keras_spatial.layers import global_pooling, normalization, reshaping

    for module in (global_pooling, normalization, reshaping):
        if hasattr(module, name):
            return getattr(module, name)
    raise KeyError(name)


def _maybe_function(fn, graph):
    import tensorflow as tf

    return tf.function(fn) if graph else fn


def _global_input(strategy, seed, ties=False, features=None):
    rng = np.random.default_rng(seed)
    shape = (BATCH_PER_GROUP * strategy.data_size,) + ((features,) if features else (*EXTENTS, CHANNELS))
    if ties:  # few distinct values: maxima tie within and across shards
        return (rng.integers(-4, 3, shape) / 2.0).astype("float32"), rng
    # Non-zero, per-channel means and scales: the statistics are not trivially 0 and 1.
    channels = shape[-1]
    x = 2.0 + np.arange(channels) + rng.standard_normal(shape) * (1.0 + np.arange(channels))
    return x.astype("float32"), rng


def _group_rows(strategy, array):
    per_group = array.shape[0] // strategy.data_size
    return array[strategy.data_index * per_group : (strategy.data_index + 1) * per_group]


def check_replicated(strategy, case, graph) -> dict:
    """Flatten / global pooling: output replicated on the group, input gradient sharded."""
    import keras
    import tensorflow as tf

    import keras_spatial as ks
    from keras_spatial.conversion import keras_parent

    class_name, kwargs = REPLICATED_CASES[case]
    layer_class = _layer_class(class_name)
    x, rng = _global_input(strategy, seed=len(case), ties="ties" in case)
    with strategy.scope():
        inputs = ks.Input((*EXTENTS, CHANNELS))
        model = keras.Model(inputs, layer_class(**kwargs)(inputs))
    reference = keras_parent(layer_class)(**kwargs)
    out_shape = reference.compute_output_shape(x.shape)
    cotangent = rng.standard_normal(out_shape).astype("float32")

    def reference_step(x_global):
        with tf.GradientTape() as tape:
            tape.watch(x_global)
            y = reference(x_global)
            loss = tf.reduce_sum(y * cotangent)
        return y, tape.gradient(loss, x_global)

    def step(x_local, cot_group):
        with tf.GradientTape() as tape:
            tape.watch(x_local)
            y = model(x_local)
            loss = tf.reduce_sum(y * cot_group) / strategy.spatial_size
        return y, tape.gradient(loss, x_local)

    y_ref, dx_ref = _maybe_function(reference_step, graph)(tf.constant(x))
    y, dx = _maybe_function(step, graph)(
        tf.constant(strategy.shard(x, split_batch=True)), tf.constant(_group_rows(strategy, cotangent))
    )
    return {
        "symbolic_shape": tuple(model.output.shape[1:]) == tuple(out_shape[1:]),
        "output": excess(y, _group_rows(strategy, y_ref.numpy())),
        "input_grad": excess(dx, strategy.shard(dx_ref.numpy(), split_batch=True)),
    }


def check_batch_norm(strategy, case, graph) -> dict:
    """Training (statistics across ranks) and inference, against Keras on the global batch.

    The reference is `keras.layers.BatchNormalization` with the same arguments but
    `synchronized=False`: in one process both mean the same statistics, and the
    unsynchronized path uses the two-pass formula (the synchronized one computes
    E[x^2] - E[x]^2, whose float32 rounding alone moves these outputs by up to 5e-6,
    half the tolerance).
    With `synchronized=False` on the spatial layer, statistics are per data group, so
    the reference runs once per data group's sub-batch.

    Cases 'bn-replicated*' feed every rank of a spatial group the same (batch, features)
    rows of its data group, as after `SpatialFlatten`: each rank's loss is then its 1/S
    share of the group's loss, and the input gradient to compare is the sum over the S
    copies (what the gather's backward pass computes).
    """
    import keras
    import tensorflow as tf

    import keras_spatial as ks
    from keras_spatial.conversion import keras_parent
    from keras_spatial.layers.normalization import SpatialBatchNormalization

    replicated = case.startswith("bn-replicated")
    features = REPLICATED_FEATURES if replicated else None
    x, rng = _global_input(strategy, seed=11 + len(case), features=features)
    # Positions that count (True) or not; None: the layer is called without a mask.
    mask = rng.random(x.shape[:-1]) < 0.6 if case in MASKED_CASES else None
    with strategy.scope():
        layer = SpatialBatchNormalization(**BN_CASES[case])
        if replicated:
            inputs = keras.Input((features,))
        else:
            inputs = ks.Input((*EXTENTS, CHANNELS))
        model = keras.Model(inputs, layer(inputs))
    if replicated:
        local_part, loss_share = (lambda a: _group_rows(strategy, a)), strategy.spatial_size
    else:
        local_part, loss_share = (lambda a: strategy.shard(a, split_batch=True)), 1
    weights = [rng.uniform(0.5, 1.5, w.shape).astype("float32") for w in layer.get_weights()]
    layer.set_weights(weights)
    config = dict(layer.get_config(), synchronized=False)
    per_group = not layer.synchronized
    groups = range(strategy.data_size) if per_group else [None]
    cotangent = rng.standard_normal(x.shape).astype("float32")
    outputs_global = float(cotangent.size)

    def reference_step(reference, x_part, cot_part, training, mask_part=None):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x_part)
            y = reference(x_part, training=training, mask=mask_part)
            loss = tf.reduce_sum(y * cot_part)
            mean_loss = loss / outputs_global
        return y, tape.gradient(loss, x_part), tape.gradient(mean_loss, reference.trainable_weights)

    def step(x_local, cot_local, training, mask_local=None):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x_local)
            if mask_local is None:
                y = model(x_local, training=training)
            else:
                y = layer(x_local, training=training, mask=mask_local)
            loss = tf.reduce_sum(y * cot_local) / loss_share
            mean_loss = loss / outputs_global
        return y, tape.gradient(loss, x_local), tape.gradient(mean_loss, model.trainable_weights)

    result = {}
    x_local = tf.constant(local_part(x))
    cot_local = tf.constant(local_part(cotangent))
    mask_local = None if mask is None else tf.constant(local_part(mask[..., None])[..., 0])
    for training in (True, False):
        mode = "train" if training else "infer"
        expected_y, expected_dx, expected_dw, moving = [], [], None, []
        for group in groups:
            rows = slice(None) if group is None else slice(group * BATCH_PER_GROUP, (group + 1) * BATCH_PER_GROUP)
            reference = keras_parent(SpatialBatchNormalization).from_config(config)
            reference.build(x.shape)
            reference.set_weights(weights)
            y_ref, dx_ref, dw_ref = _maybe_function(reference_step, graph)(
                reference, tf.constant(x[rows]), tf.constant(cotangent[rows]), training,
                None if mask is None else tf.constant(mask[rows]),
            )
            expected_y.append(y_ref.numpy())
            expected_dx.append(dx_ref.numpy())
            dw_ref = [g.numpy() for g in dw_ref]
            expected_dw = dw_ref if expected_dw is None else [a + b for a, b in zip(expected_dw, dw_ref)]
            moving.append([w.numpy() for w in reference.non_trainable_weights])
        expected_y, expected_dx = np.concatenate(expected_y), np.concatenate(expected_dx)
        layer.set_weights(weights)
        y, dx, dw = _maybe_function(step, graph)(x_local, cot_local, training, mask_local)
        dw = [strategy.world_sum(g).numpy() for g in dw]
        if replicated:
            dx = strategy.allreduce(dx, "sum", "spatial")
        result[f"{mode}_output"] = excess(y, local_part(expected_y))
        result[f"{mode}_input_grad"] = excess(dx, local_part(expected_dx))
        for variable, g, g_ref in zip(layer.trainable_weights, dw, expected_dw):
            result[f"{mode}_grad_{variable.name}"] = excess(g, g_ref)
        expected_moving = np.mean(np.array(moving), axis=0)  # over data groups if per group
        for variable, value in zip(layer.non_trainable_weights, expected_moving):
            result[f"{mode}_{variable.name}"] = excess(variable.numpy(), value)
        result[f"{mode}_moving_values"] = [v.numpy().tolist() for v in layer.non_trainable_weights]
        initial = [w for w, v in zip(weights, layer.weights) if not v.trainable]
        result[f"{mode}_moving_changed"] = any(
            not np.array_equal(v.numpy(), w) for v, w in zip(layer.non_trainable_weights, initial)
        )
    return result


def end_to_end_model(global_shape):
    import keras

    import keras_spatial as ks
    from keras_spatial.layers.global_pooling import SpatialGlobalAveragePooling3D
    from keras_spatial.layers.normalization import SpatialBatchNormalization

    inputs = ks.Input(global_shape)
    y = ks.layers.SpatialConv3D(4, 3, padding="same", use_bias=False, name="conv")(inputs)
    y = SpatialBatchNormalization(momentum=0.9, name="bn")(y)
    y = keras.layers.Activation("relu")(y)
    y = SpatialGlobalAveragePooling3D(name="pool")(y)
    return keras.Model(inputs, keras.layers.Dense(2, name="dense")(y))


def check_end_to_end(strategy) -> dict:
    """conv (no bias, as before a BN) -> BN -> relu -> global average pooling -> Dense;
    mean squared error on the replicated head."""
    import keras
    import tensorflow as tf

    import keras_spatial as ks

    keras.utils.set_random_seed(21)  # same initial weights on every rank
    global_shape = (*EXTENTS, 2)
    with strategy.scope():
        model = end_to_end_model(global_shape)
    twin = ks.to_keras_model(model)
    twin_types = sorted({type(layer).__module__.split(".")[0] for layer in twin.layers})
    rng = np.random.default_rng(5)
    x = rng.standard_normal((BATCH_PER_GROUP * strategy.data_size, *global_shape)).astype("float32")
    target = rng.standard_normal((x.shape[0], 2)).astype("float32")

    @tf.function
    def serial_step(x_global, t_global):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(twin(x_global, training=True) - t_global))
        return loss, tape.gradient(loss, twin.trainable_weights)

    @tf.function
    def step(x_local, t_group):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x_local, training=True) - t_group))
        return loss, tape.gradient(loss, model.trainable_weights)

    loss_ref, grads_ref = serial_step(tf.constant(x), tf.constant(target))
    loss, grads = step(tf.constant(strategy.shard(x, split_batch=True)), tf.constant(_group_rows(strategy, target)))
    result = {
        "twin_modules": twin_types,
        "loss": excess(strategy.allreduce(loss, "average", "world"), loss_ref),
    }
    for variable, g, g_ref in zip(model.trainable_weights, grads, grads_ref):
        result[f"grad_{variable.path}"] = excess(strategy.allreduce(g, "average", "world"), g_ref)
    for variable, v_ref in zip(model.non_trainable_weights, twin.non_trainable_weights):
        result[f"state_{variable.path}"] = excess(variable.numpy(), v_ref.numpy())
    y_infer = model.predict(strategy.shard(x, split_batch=True), verbose=0)
    result["inference_output"] = excess(y_infer, _group_rows(strategy, twin.predict(x, verbose=0)))
    return result


def check_recomputed_statistics(strategy) -> dict:
    """`recompute_batch_norm_statistics` over two global batches of local shards against
    the same function on the serial twin over the whole batches: conv -> BN -> relu ->
    conv -> BN -> global average -> Dense (the second BN sees the first's
    training-mode normalization)."""
    import keras
    import tensorflow as tf

    import keras_spatial as ks
    from keras_spatial.layers.global_pooling import SpatialGlobalAveragePooling3D
    from keras_spatial.layers.normalization import SpatialBatchNormalization

    keras.utils.set_random_seed(23)
    global_shape = (*EXTENTS, 2)
    with strategy.scope():
        inputs = ks.Input(global_shape)
        y = ks.layers.SpatialConv3D(3, 3, padding="same", name="conv1")(inputs)
        y = SpatialBatchNormalization(momentum=0.9, name="bn1")(y)
        y = keras.layers.Activation("relu")(y)
        y = ks.layers.SpatialConv3D(2, 3, padding="same", name="conv2")(y)
        y = SpatialBatchNormalization(momentum=0.8, epsilon=1e-2, name="bn2")(y)
        y = SpatialGlobalAveragePooling3D(name="pool")(y)
        model = keras.Model(inputs, keras.layers.Dense(2, name="dense")(y))
    rng = np.random.default_rng(9)
    for layer in model.layers:  # gamma and beta away from 1 and 0
        if isinstance(layer, SpatialBatchNormalization):
            layer.gamma.assign(rng.uniform(0.5, 2.0, layer.gamma.shape).astype("float32"))
            layer.beta.assign(rng.standard_normal(layer.beta.shape).astype("float32"))
    twin = ks.to_keras_model(model)
    batches = [2.0 + 3.0 * rng.standard_normal((BATCH_PER_GROUP * strategy.data_size, *global_shape))
               .astype("float32") for _ in range(2)]
    serial = tf.data.Dataset.from_tensor_slices(np.stack(batches))
    local = tf.data.Dataset.from_tensor_slices(
        np.stack([strategy.shard(b, split_batch=True) for b in batches]))
    used_serial = ks.recompute_batch_norm_statistics(twin, serial)
    used = ks.recompute_batch_norm_statistics(model, local)
    result = {"batches": [used, used_serial],
              "momenta": [layer.momentum for layer in model.layers
                          if isinstance(layer, SpatialBatchNormalization)]}
    for variable, v_ref in zip(model.non_trainable_weights, twin.non_trainable_weights):
        result[f"state_{variable.path}"] = excess(variable.numpy(), v_ref.numpy())
    result["moving_values"] = np.concatenate([v.numpy().ravel() for v in model.non_trainable_weights]).tolist()
    return result


def run_head_suite(meshes, eager_mesh=None, end_to_end=False) -> dict:
    """The checks named for each mesh in `meshes`, a list of (spatial_shape, case names);
    all in graph mode, and again in eager mode on `eager_mesh`; the end-to-end model on
    the last mesh."""
    worker_setup()
    import tensorflow as tf

    import keras_spatial as ks

    tf.get_logger().setLevel("ERROR")  # each check traces fresh functions on purpose
    results = {}
    for spatial_shape, cases in meshes:
        strategy = ks.SpatialStrategy(spatial_shape)
        modes = [True, False] if tuple(spatial_shape) == eager_mesh else [True]
        for graph in modes:
            for case in cases:
                check = check_replicated if case in REPLICATED_CASES else check_batch_norm
                results[(tuple(spatial_shape), case, graph)] = check(strategy, case, graph)
    if end_to_end:
        results["end_to_end"] = check_end_to_end(strategy)
        results["recompute"] = check_recomputed_statistics(strategy)
    # No rank may leave (and shut Horovod down) while another is still communicating.
    strategy.barrier()
    return results
