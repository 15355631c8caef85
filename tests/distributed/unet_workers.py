"""Worker side of the distributed U-Net tests: transposed convolution, up-sampling,
skip connections and a per-voxel loss, against plain Keras on the whole volume.

As in `layer_workers`, every rank builds the plain Keras twin with the same weights, runs
it on the global batch and compares its own shard of the output and of the input
gradient, and the world-reduced weight gradients, with the spatial computation (done in
the same mode, graph or eager). Ranks return numbers (`excess` <= 0 means within
rtol = atol = 1e-5); the pytest process asserts on them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from tests.distributed.launcher import worker_setup
from tests.comparison import excess


@dataclasses.dataclass(frozen=True)
class LayerCase:
    """One layer configuration: `kind` is 'transpose' or 'upsample'."""

    name: str
    kind: str
    kwargs: tuple  # sorted (key, value) pairs, hashable
    channels: int = 2
    batch: int = 1
    seed: int = 0

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.kwargs)

    @property
    def layer_class(self) -> type:
        from keras_spatial.layers.convolutional_transpose import SpatialConv3DTranspose
        from keras_spatial.layers.upsampling import SpatialUpSampling3D

        return {"transpose": SpatialConv3DTranspose, "upsample": SpatialUpSampling3D}[self.kind]


def _case(name, kind, channels=2, batch=1, seed=0, **kwargs) -> LayerCase:
    return LayerCase(name, kind, tuple(sorted(kwargs.items())), channels, batch, seed)


LAYER_CASES = [
    _case("transpose-k2s2-valid", "transpose", filters=3, kernel_size=2, strides=2, padding="valid",
          seed=1),
    _case("transpose-k2s2-same-relu-nobias", "transpose", batch=2, filters=2, kernel_size=2, strides=2,
          padding="same", activation="relu", use_bias=False, seed=2),
    _case("transpose-k221-s221", "transpose", channels=3, filters=2, kernel_size=(2, 2, 1),
          strides=(2, 2, 1), seed=3),
    _case("transpose-k3s1-same", "transpose", filters=3, kernel_size=3, padding="same", seed=4),
    _case("transpose-k315s1-same-tanh", "transpose", filters=2, kernel_size=(3, 1, 5), padding="same",
          activation="tanh", seed=5),
    # Halo configurations of any kernel, stride, padding and output padding:
    _case("transpose-k3s2-same", "transpose", filters=2, kernel_size=3, strides=2, padding="same",
          seed=8),
    _case("transpose-k4s2-valid", "transpose", filters=2, kernel_size=4, strides=2, seed=9),
    _case("transpose-k2s1-same", "transpose", filters=2, kernel_size=2, padding="same", seed=10),
    _case("transpose-k3s1-valid-relu", "transpose", filters=3, kernel_size=3, activation="relu",
          seed=11),
    _case("transpose-k332-s112-same", "transpose", filters=2, kernel_size=(3, 3, 2),
          strides=(1, 1, 2), padding="same", seed=12),
    _case("transpose-k3s2-valid-op1", "transpose", filters=2, kernel_size=3, strides=2,
          output_padding=1, seed=13),
    _case("transpose-k1s2-same-op1", "transpose", filters=2, kernel_size=1, strides=2, padding="same",
          output_padding=1, seed=14),
    _case("transpose-k5s3-same-nobias", "transpose", filters=2, kernel_size=5, strides=3,
          padding="same", use_bias=False, seed=15),
    _case("upsample-2", "upsample", size=2, seed=6),
    _case("upsample-213", "upsample", channels=3, size=(2, 1, 3), seed=7),
]
EAGER_CASES = ["transpose-k2s2-valid", "transpose-k3s1-same", "upsample-213"]
GLOBAL_EXTENTS = (4, 6, 4)  # every mesh of the tests divides them; local extents 1-6


def _step(fn, graph):
    import tensorflow as tf

    return tf.function(fn) if graph else fn


def _reduced(strategy, grads, op):
    return [strategy.allreduce(g, op, "world") for g in grads] if strategy.size > 1 else grads


def _cotangent_checks(strategy, model, reference, x, rng, graph) -> dict:
    """Output, input gradient of sum(y * cot) and world-summed weight gradients of
    sum(y * cot) / N_global_outputs: spatial `model` on shards vs `reference` on all."""
    import tensorflow as tf

    x_global = tf.constant(x)
    out_shape = reference.compute_output_shape(x.shape)
    cotangent = rng.standard_normal(out_shape).astype("float32")
    outputs_global = float(np.prod(out_shape))

    def make_step(net):
        def step(x, cot):
            with tf.GradientTape(persistent=True) as tape:
                tape.watch(x)
                y = net(x)
                loss = tf.reduce_sum(y * cot)
                mean_loss = loss / outputs_global
            return y, tape.gradient(loss, x), tape.gradient(mean_loss, net.trainable_weights)

        return _step(step, graph)

    y_ref, dx_ref, dw_ref = make_step(reference)(x_global, tf.constant(cotangent))
    x_local = tf.constant(strategy.shard(x, split_batch=True))
    cot_local = tf.constant(strategy.shard(cotangent, split_batch=True))
    y, dx, dw = make_step(model)(x_local, cot_local)
    dw = _reduced(strategy, dw, "sum")
    result = {
        "output": excess(y, strategy.shard(y_ref.numpy(), split_batch=True)),
        "input_grad": excess(dx, strategy.shard(dx_ref.numpy(), split_batch=True)),
        "weights_compared": len(dw_ref),
    }
    for variable, g, g_ref in zip(reference.trainable_weights, dw, dw_ref):
        result[f"grad_{variable.path}"] = excess(g, g_ref)
    return result


def check_layer(strategy, case: LayerCase, graph: bool) -> dict:
    """One spatial layer on its shard vs its Keras parent on the whole batch."""
    import keras

    import keras_spatial as ks
    from keras_spatial.conversion import keras_parent

    rng = np.random.default_rng(case.seed)
    x = rng.uniform(-1, 1, (case.batch * strategy.data_size, *GLOBAL_EXTENTS, case.channels))
    x = x.astype("float32")
    with strategy.scope():
        inputs = ks.Input((*GLOBAL_EXTENTS, case.channels))
        layer = case.layer_class(**case.options)
        model = keras.Model(inputs, layer(inputs))
    reference = keras_parent(type(layer)).from_config(layer.get_config())
    reference.build(x.shape)
    weights = [
        (rng.standard_normal(w.shape) / np.sqrt(np.prod(w.shape[:-1]))).astype("float32")
        for w in reference.get_weights()
    ]
    reference.set_weights(weights)
    layer.set_weights(weights)
    result = _cotangent_checks(strategy, model, reference, x, rng, graph)
    result["local_output_shape"] = tuple(model.output.shape)
    return result


def skip_model(global_shape, classes=2):
    """conv -> pool -> conv -> up (transposed conv 2/2 and up-sampling) -> Concatenate
    with the pre-pool features -> transposed conv 3/1 'same' -> conv."""
    import keras

    import keras_spatial as ks
    from keras_spatial.layers.convolutional_transpose import SpatialConv3DTranspose
    from keras_spatial.layers.upsampling import SpatialUpSampling3D

    inputs = ks.Input(global_shape)
    skip = ks.layers.SpatialConv3D(4, 3, padding="same", activation="relu", name="down_conv")(inputs)
    y = ks.layers.SpatialMaxPooling3D(2, name="pool")(skip)
    y = ks.layers.SpatialConv3D(4, 3, padding="same", activation="relu", name="bottom_conv")(y)
    up = SpatialConv3DTranspose(3, 2, strides=2, name="up_transpose")(y)
    repeated = SpatialUpSampling3D(2, name="up_repeat")(y)
    y = keras.layers.Concatenate(name="skip_concat")([up, repeated, skip])
    y = SpatialConv3DTranspose(4, 3, padding="same", activation="relu", name="mix_transpose")(y)
    return keras.Model(inputs, ks.layers.SpatialConv3D(classes, 3, padding="same", name="head")(y))


def segmentation_model(global_shape, classes=3):
    """A small U-Net: conv, pool, conv, transposed conv 2/2, Concatenate with the
    pre-pool features, conv, 1x1x1 conv to `classes`, softmax over classes."""
    import keras

    import keras_spatial as ks
    from keras_spatial.layers.convolutional_transpose import SpatialConv3DTranspose

    inputs = ks.Input(global_shape)
    skip = ks.layers.SpatialConv3D(4, 3, padding="same", activation="relu", name="down_conv")(inputs)
    y = ks.layers.SpatialMaxPooling3D(2, name="pool")(skip)
    y = ks.layers.SpatialConv3D(6, 3, padding="same", activation="relu", name="bottom_conv")(y)
    y = SpatialConv3DTranspose(4, 2, strides=2, name="up")(y)
    y = keras.layers.Concatenate(name="skip_concat")([y, skip])
    y = ks.layers.SpatialConv3D(4, 3, padding="same", activation="relu", name="up_conv")(y)
    y = ks.layers.SpatialConv3D(classes, 1, name="logits")(y)
    return keras.Model(inputs, keras.layers.Softmax(name="probabilities")(y))


def branches_model(global_shape):
    """Three branches from the input, added: conv 3 -> average pool 3/2, conv 5 -> max
    pool 3/2 and conv 1 -> max pool 2/2; the sum is scaled by the global max of the
    second conv, shifted by the global average of the third branch, and convolved. The
    branches' halo exchanges and reductions do not depend on each other, so ranks may
    reach their gradients in different orders."""
    import keras

    import keras_spatial as ks

    inputs = ks.Input(global_shape)
    a = ks.layers.SpatialConv3D(3, 3, padding="same", name="conv_a")(inputs)
    a = ks.layers.SpatialAveragePooling3D(3, 2, padding="same", name="avg_a")(a)
    b_conv = ks.layers.SpatialConv3D(3, 5, padding="same", activation="tanh", name="conv_b")(inputs)
    b = ks.layers.SpatialMaxPooling3D(3, 2, padding="same", name="max_b")(b_conv)
    c = ks.layers.SpatialConv3D(3, 1, name="conv_c")(inputs)
    c = ks.layers.SpatialMaxPooling3D(2, name="max_c")(c)
    y = keras.layers.Add(name="join")([a, b, c])
    # Two more parallel collectives: global pools of two branches' convolutions
    # (broadcast over the volume), whose gradients are allreduces.
    y = keras.layers.Multiply(name="scale")([y, ks.layers.SpatialGlobalMaxPooling3D(keepdims=True, name="gmax")(b_conv)])
    y = keras.layers.Add(name="shift")([y, ks.layers.SpatialGlobalAveragePooling3D(keepdims=True, name="gavg")(c)])
    return keras.Model(inputs, ks.layers.SpatialConv3D(2, 3, padding="same", name="head")(y))


MODEL_SHAPE = (8, 8, 8, 2)


def check_skip_model(strategy, graph: bool, seed=11) -> dict:
    """The skip-connection model on shards vs `to_keras_model` of it on the volume."""
    import keras

    import keras_spatial as ks

    keras.utils.set_random_seed(seed)  # the same initial weights on every rank
    with strategy.scope():
        model = skip_model(MODEL_SHAPE)
    reference = ks.to_keras_model(model)
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, (strategy.data_size, *MODEL_SHAPE)).astype("float32")
    return _cotangent_checks(strategy, model, reference, x, rng, graph)


def check_branches(strategy, graph: bool, seed=31) -> dict:
    """`branches_model` on shards vs `to_keras_model` of it on the volume. Run eagerly,
    a step whose ranks reach the branches' gradients in different orders must raise
    SpatialNotSupportedError (returned as {'error': message}) instead of pairing one
    branch's gradient exchange with another's."""
    import keras

    import keras_spatial as ks

    keras.utils.set_random_seed(seed)
    with strategy.scope():
        model = branches_model(MODEL_SHAPE)
    reference = ks.to_keras_model(model)
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, (strategy.data_size, *MODEL_SHAPE)).astype("float32")
    try:
        return _cotangent_checks(strategy, model, reference, x, rng, graph)
    except ks.SpatialNotSupportedError as error:
        return {"error": str(error)}


def check_voxel_loss(strategy, graph: bool, seed=21, batch=2) -> dict:
    """Local SparseCategoricalCrossentropy (mean over own voxels) vs the global mean.

    Every rank holds the same number of voxels, so the global mean loss L is the mean of
    the ranks' local means, and dL/dw is the world AVERAGE of the local gradients. The
    input gradient a rank computes is that of the sum of its spatial group's losses (the
    halo exchange's backward pass returns the neighbours' terms), so dL/dx_local is it
    divided by the world size.
    """
    import keras
    import tensorflow as tf

    import keras_spatial as ks

    keras.utils.set_random_seed(seed)
    with strategy.scope():
        model = segmentation_model(MODEL_SHAPE)
    reference = ks.to_keras_model(model)
    rng = np.random.default_rng(seed)
    global_batch = batch * strategy.data_size
    x = rng.uniform(-1, 1, (global_batch, *MODEL_SHAPE)).astype("float32")
    labels = rng.integers(0, 3, (global_batch, *MODEL_SHAPE[:3], 1)).astype("int32")
    loss_fn = keras.losses.SparseCategoricalCrossentropy()  # reduction: mean

    def make_step(net):
        def step(x, labels):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = loss_fn(labels[..., 0], net(x))
            dx, *dw = tape.gradient(loss, [x] + net.trainable_weights)
            return loss, dx, dw

        return _step(step, graph)

    loss_ref, dx_ref, dw_ref = make_step(reference)(tf.constant(x), tf.constant(labels))
    loss, dx, dw = make_step(model)(
        tf.constant(strategy.shard(x, split_batch=True)),
        tf.constant(strategy.shard(labels, split_batch=True)),
    )
    result = {
        "loss": excess(_reduced(strategy, [loss], "average")[0], loss_ref),
        "input_grad": excess(dx / strategy.size, strategy.shard(dx_ref.numpy(), split_batch=True)),
        "weights_compared": len(dw_ref),
        "loss_value": float(loss_ref),
    }
    averaged = _reduced(strategy, dw, "average")
    for variable, g, g_ref in zip(reference.trainable_weights, averaged, dw_ref):
        result[f"grad_{variable.path}"] = excess(g, g_ref)
    return result


def run_suite(meshes) -> dict:
    """Everything one launch checks. `meshes` holds (spatial_shape, layer case names,
    eager case names, checks) with checks a subset of {'skip', 'loss', 'branches',
    'eager_branches'}."""
    worker_setup()
    import keras_spatial as ks

    cases = {case.name: case for case in LAYER_CASES}
    results = {}
    for spatial_shape, names, eager_names, checks in meshes:
        strategy = ks.SpatialStrategy(spatial_shape)
        mesh = tuple(spatial_shape)
        results[(mesh, "data_size")] = strategy.data_size
        for name in names:
            results[(mesh, name, True)] = check_layer(strategy, cases[name], graph=True)
        for name in eager_names:
            results[(mesh, name, False)] = check_layer(strategy, cases[name], graph=False)
        if "skip" in checks:
            results[(mesh, "skip", True)] = check_skip_model(strategy, graph=True)
        if "loss" in checks:
            results[(mesh, "loss", True)] = check_voxel_loss(strategy, graph=True)
        if "branches" in checks:
            results[(mesh, "branches", True)] = check_branches(strategy, graph=True)
        if "eager_branches" in checks:
            results[(mesh, "branches", False)] = check_branches(strategy, graph=False)
    # No rank may leave (and shut Horovod down) while another is still communicating.
    strategy.barrier()
    return results
