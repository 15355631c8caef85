"""World size 1: the head layers and batch normalization are exactly their Keras parents.

Also: configs, saving, conversion to the Keras parent, refused configurations, and the
private Keras hook `BatchNormalization._moments` that SpatialBatchNormalization overrides.
"""

import inspect

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import keras_spatial as ks  # noqa: E402
from keras_spatial.conversion import keras_parent  # noqa: E402
from keras_spatial.layers.global_pooling import (  # noqa: E402
    SpatialGlobalAveragePooling3D,
    SpatialGlobalMaxPooling3D,
)
from keras_spatial.layers.normalization import SpatialBatchNormalization  # noqa: E402
from keras_spatial.layers.reshaping import SpatialFlatten  # noqa: E402

SHAPE = (2, 6, 5, 4, 3)
LAYERS = [
    (SpatialFlatten, {}),
    (SpatialGlobalAveragePooling3D, {}),
    (SpatialGlobalAveragePooling3D, {"keepdims": True}),
    (SpatialGlobalMaxPooling3D, {}),
    (SpatialGlobalMaxPooling3D, {"keepdims": True}),
    (SpatialBatchNormalization, {}),
    (SpatialBatchNormalization, {"synchronized": False, "momentum": 0.5, "center": False}),
    (SpatialBatchNormalization, {"scale": False, "epsilon": 1e-2}),
]
IDS = [f"{cls.__name__}-{kwargs}" for cls, kwargs in LAYERS]


def _run(layer, x, training):
    x = tf.constant(x)
    cotangent = tf.constant(np.random.default_rng(1).standard_normal(layer.compute_output_shape(x.shape)), tf.float32)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, training=training) if isinstance(layer, keras.layers.BatchNormalization) else layer(x)
        loss = tf.reduce_sum(y * cotangent)
    grads = tape.gradient(loss, [x] + layer.trainable_weights)
    return [y.numpy()] + [g.numpy() for g in grads] + [w.numpy() for w in layer.non_trainable_weights]


@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("with_strategy", [False, True], ids=["no-strategy", "strategy-1x1x1"])
@pytest.mark.parametrize("layer_class,kwargs", LAYERS, ids=IDS)
def test_world_size_one_is_exactly_keras(layer_class, kwargs, with_strategy, training):
    rng = np.random.default_rng(0)
    x = (3.0 + rng.standard_normal(SHAPE)).astype("float32")
    x[0, 0, 0, 0, :] = x[0, 1, 1, 1, :] = 9.0  # ties in the max
    spatial = layer_class(**kwargs)
    plain = keras_parent(layer_class).from_config(spatial.get_config())  # the same arguments
    plain.build(SHAPE)
    if with_strategy:
        strategy = ks.SpatialStrategy((1, 1, 1))
        assert strategy.size == 1
        with strategy.scope():
            spatial.build(SHAPE)
            got = _run(spatial, x, training)
    else:
        spatial.build(SHAPE)
        got = _run(spatial, x, training)
    want = _run(plain, x, training)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("layer_class,kwargs", LAYERS, ids=IDS)
def test_config_round_trips_and_converts_to_the_keras_parent(layer_class, kwargs):
    layer = layer_class(**kwargs)
    config = layer.get_config()
    assert type(layer).from_config(config).get_config() == config
    serialized = keras.saving.serialize_keras_object(layer)
    assert serialized["registered_name"] == f"keras_spatial>{layer_class.__name__}"
    assert keras.saving.deserialize_keras_object(serialized).get_config() == config
    # keras_spatial.to_keras_model builds the parent from this same config.
    parent = keras_parent(layer_class).from_config(config)
    assert type(parent).__module__.startswith("keras.")
    assert parent.get_config() == config


def test_batch_normalization_defaults_to_global_statistics():
    assert SpatialBatchNormalization().synchronized is True
    assert keras.layers.BatchNormalization().synchronized is False


@pytest.mark.parametrize(
    "make",
    [
        lambda: SpatialFlatten(data_format="channels_first"),
        lambda: SpatialGlobalAveragePooling3D(data_format="channels_first"),
        lambda: SpatialGlobalMaxPooling3D(data_format="channels_first"),
    ],
    ids=["flatten", "gap", "gmp"],
)
def test_channels_first_is_refused(make):
    with pytest.raises(ks.SpatialNotSupportedError, match="channels_last.*channels_first"):
        make()


@pytest.mark.parametrize("axis", [1, 3, -2])
def test_batch_normalization_refuses_a_non_channel_axis(axis):
    with pytest.raises(ks.SpatialNotSupportedError, match=f"last axis.*Received: axis={axis}"):
        SpatialBatchNormalization(axis=axis).build(SHAPE)
    SpatialBatchNormalization(axis=4).build(SHAPE)  # the last axis, counted from 0


def test_keras_batch_normalization_moments_hook_is_still_used():
    """SpatialBatchNormalization overrides the private `_moments(inputs, mask)`: it
    must still exist with that signature and be what `call` uses in training only."""
    parameters = list(inspect.signature(keras.layers.BatchNormalization._moments).parameters)
    assert parameters == ["self", "inputs", "mask"]

    class Spy(keras.layers.BatchNormalization):
        calls = 0

        def _moments(self, inputs, mask):
            Spy.calls += 1
            channels = inputs.shape[-1]
            return tf.zeros([channels]), tf.fill([channels], 4.0)

    layer = Spy(epsilon=0.0, center=False, scale=False)
    x = np.ones((1, 2, 2, 2, 3), "float32")
    np.testing.assert_allclose(layer(x, training=True), x / 2.0)  # uses the hook's moments
    assert Spy.calls == 1
    layer(x, training=False)
    assert Spy.calls == 1


def test_flatten_and_pooling_in_a_model_save_and_load(tmp_path):
    keras.utils.set_random_seed(5)
    inputs = ks.Input((6, 4, 4, 2))
    y = ks.layers.SpatialConv3D(3, 3, padding="same")(inputs)
    y = SpatialBatchNormalization()(y)
    a = SpatialGlobalAveragePooling3D()(y)
    m = SpatialGlobalMaxPooling3D()(y)
    f = SpatialFlatten()(y)
    outputs = keras.layers.Dense(2)(keras.layers.Concatenate()([a, m, f]))
    model = keras.Model(inputs, outputs)
    x = np.random.default_rng(2).standard_normal((2, 6, 4, 4, 2)).astype("float32")
    path = tmp_path / "head.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert [type(layer).__name__ for layer in loaded.layers] == [type(layer).__name__ for layer in model.layers]
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    plain = ks.to_keras_model(model)
    assert type(plain.layers[2]) is keras.layers.BatchNormalization
    np.testing.assert_allclose(plain.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6, atol=1e-6)
