"""U-Net layers in one process: exactly Keras at world size 1, the local computations
the spatial path relies on, the refused configurations, and saving."""

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import keras_spatial as ks  # noqa: E402
from keras_spatial.conversion import keras_parent, to_keras_model  # noqa: E402
from keras_spatial.layers.convolutional_transpose import (  # noqa: E402
    SpatialConv3DTranspose,
    as_convolution_kernel,
)
from keras_spatial.layers.upsampling import SpatialUpSampling3D  # noqa: E402
from tests.distributed.layer_workers import outputs_and_grads  # noqa: E402
from tests.distributed.unet_workers import LAYER_CASES, skip_model  # noqa: E402


@pytest.mark.parametrize("with_strategy", [False, True], ids=["no-strategy", "strategy-1x1x1"])
@pytest.mark.parametrize("case", LAYER_CASES, ids=lambda c: c.name)
def test_world_size_one_is_exactly_keras(case, with_strategy):
    shape = (case.batch, 5, 4, 3, case.channels)
    x = np.random.default_rng(case.seed).uniform(-1, 1, shape).astype("float32")
    spatial = case.layer_class(**case.options)
    plain = keras_parent(case.layer_class)(**case.options)
    plain.build(shape)
    if with_strategy:
        strategy = ks.SpatialStrategy((1, 1, 1))
        assert strategy.size == 1 and not strategy.is_spatial
        with strategy.scope():
            spatial.build(shape)
            assert spatial.compute_output_shape(shape) == plain.compute_output_shape(shape)
    else:
        spatial.build(shape)
    spatial.set_weights(plain.get_weights())
    for got, want in zip(outputs_and_grads(spatial, x), outputs_and_grads(plain, x)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kernel_size", [(1, 1, 1), (3, 3, 3), (5, 1, 3)])
def test_stride_one_transpose_is_the_flipped_convolution_on_the_extended_input(kernel_size):
    """What each rank computes in the halo configuration, on one rank holding the whole
    volume: the input extended by (k - 1) / 2 zero planes per side (extend_to_halo at the
    global border), then a 'valid' convolution with `as_convolution_kernel`. It must be
    Keras's stride-1 'same' transposed convolution, and so must its gradients."""
    rng = np.random.default_rng(sum(kernel_size))
    x = tf.constant(rng.uniform(-1, 1, (2, 6, 5, 4, 3)).astype("float32"))
    kernel = tf.constant(rng.standard_normal(kernel_size + (4, 3)).astype("float32"))
    halo = [(k - 1) // 2 for k in kernel_size]

    def as_convolution(x, kernel):
        extended = tf.pad(x, [[0, 0]] + [[h, h] for h in halo] + [[0, 0]])
        return keras.ops.conv(extended, as_convolution_kernel(kernel), 1, "valid")

    def transposed(x, kernel):
        return keras.ops.conv_transpose(x, kernel, 1, "same")

    cotangent = tf.constant(rng.standard_normal((2, 6, 5, 4, 4)).astype("float32"))
    results = []
    for fn in (as_convolution, transposed):
        with tf.GradientTape() as tape:
            tape.watch([x, kernel])
            y = fn(x, kernel)
            loss = tf.reduce_sum(y * cotangent)
        results.append([y.numpy()] + [g.numpy() for g in tape.gradient(loss, [x, kernel])])
    for got, want in zip(*results):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("padding", ["valid", "same"])
@pytest.mark.parametrize("kernel_size", [2, (2, 3, 1)])
def test_kernel_equal_to_stride_is_local(kernel_size, padding):
    """The blockwise configuration: Keras's transposed convolution of a slab of the
    input is the matching slab of the transposed convolution of the whole input."""
    layer = keras.layers.Conv3DTranspose(3, kernel_size, strides=kernel_size, padding=padding)
    x = np.random.default_rng(0).uniform(-1, 1, (1, 4, 6, 2, 2)).astype("float32")
    whole = layer(x).numpy()
    stride = layer.strides
    for axis in range(3):
        half = x.shape[axis + 1] // 2
        part = layer(np.take(x, range(half, 2 * half), axis=axis + 1)).numpy()
        start = half * stride[axis]
        expected = np.take(whole, range(start, 2 * start), axis=axis + 1)
        np.testing.assert_array_equal(part, expected)


UNSUPPORTED = {
    "k3-s2": (dict(kernel_size=3, strides=2, padding="same"), r"kernel_size=\(3, 3, 3\), strides=\(2, 2, 2\)"),
    "k4-s2": (dict(kernel_size=4, strides=2), r"kernel_size=\(4, 4, 4\), strides=\(2, 2, 2\)"),
    "even-k2-s1": (dict(kernel_size=2, padding="same"), r"kernel_size=\(2, 2, 2\), strides=\(1, 1, 1\)"),
    "k3-s1-valid": (dict(kernel_size=3, padding="valid"), r"strides=1 with odd.*padding='valid'"),
    "mixed-axes": (
        dict(kernel_size=(3, 3, 2), strides=(1, 1, 2), padding="same"),
        r"kernel_size=\(3, 3, 2\), strides=\(1, 1, 2\)",
    ),
    "dilation": (dict(kernel_size=3, padding="same", dilation_rate=2), r"dilation_rate=1\. .*=\(2, 2, 2\)"),
    "output-padding": (dict(kernel_size=2, strides=2, output_padding=1), r"output_padding.*=\(1, 1, 1\)"),
    "output-padding-0": (dict(kernel_size=2, strides=2, output_padding=0), r"output_padding.*=\(0, 0, 0\)"),
}


@pytest.mark.parametrize("kwargs,match", list(UNSUPPORTED.values()), ids=list(UNSUPPORTED))
def test_unsupported_transpose_configurations_are_refused(kwargs, match):
    with pytest.raises(ks.SpatialNotSupportedError, match=match) as info:
        SpatialConv3DTranspose(2, name="up_bad", **kwargs)
    message = str(info.value)
    assert message.startswith("SpatialConv3DTranspose ")
    assert "layer='up_bad'" in message
    # Keras itself accepts every one of these: the refusal is ours, not a Keras error.
    keras.layers.Conv3DTranspose(2, **kwargs)


@pytest.mark.parametrize(
    "layer_class,kwargs",
    [
        (SpatialConv3DTranspose, dict(filters=2, kernel_size=2, strides=2)),
        (SpatialUpSampling3D, dict(size=2)),
    ],
)
def test_channels_first_is_refused(layer_class, kwargs):
    with pytest.raises(ks.SpatialNotSupportedError, match="channels_last.*channels_first"):
        layer_class(data_format="channels_first", **kwargs)


@pytest.mark.parametrize("case", LAYER_CASES, ids=lambda c: c.name)
def test_get_config_round_trips_and_suits_the_keras_parent(case):
    layer = case.layer_class(**case.options)
    config = layer.get_config()
    assert type(layer).from_config(config).get_config() == config
    serialized = keras.saving.serialize_keras_object(layer)
    assert serialized["registered_name"] == f"keras_spatial>{case.layer_class.__name__}"
    assert keras.saving.deserialize_keras_object(serialized).get_config() == config
    # to_keras_model builds the parent from this config: it must be the parent's own.
    parent = keras_parent(case.layer_class)
    assert parent in (keras.layers.Conv3DTranspose, keras.layers.UpSampling3D)
    assert parent.from_config(config).get_config() == config


def test_skip_connection_model_saves_loads_and_converts(tmp_path):
    keras.utils.set_random_seed(5)
    model = skip_model((8, 8, 8, 2))
    x = np.random.default_rng(1).uniform(-1, 1, (1, 8, 8, 8, 2)).astype("float32")
    path = tmp_path / "skip.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert [type(la).__name__ for la in loaded.layers] == [type(la).__name__ for la in model.layers]
    expected = model.predict(x, verbose=0)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), expected)
    plain = to_keras_model(model)
    assert not any(type(layer).__module__.startswith("keras_spatial") for layer in plain.layers)
    np.testing.assert_array_equal(plain.predict(x, verbose=0), expected)
