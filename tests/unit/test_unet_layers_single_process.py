"""U-Net layers in one process: exactly Keras at world size 1, the local computations
the spatial path relies on, the refused configurations, and saving."""

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import keras_spatial as ks  # noqa: E402
from keras_spatial.conversion import keras_parent, to_keras_model  # noqa: E402
from keras_spatial.halo import plan_transposed_axis, transposed_output_extent  # noqa: E402
from keras_spatial.ops.halo_convolution import transposed_convolution_shard  # noqa: E402
from keras_spatial.layers.convolutional_transpose import SpatialConv3DTranspose  # noqa: E402
from keras_spatial.layers.upsampling import SpatialUpSampling3D  # noqa: E402
from tests.comparison import assert_reloads_identically  # noqa: E402
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


def _shard_of_transposed_convolution(x, kernel, plans, coords):
    """What one rank computes, in one process: its needed inputs cut from the whole
    input (zeros outside it, as the halo exchange fills them), then
    `transposed_convolution_shard`."""
    pad = [[0, 0]] + [[max(-p.needed[c][0], 0), max(p.needed[c][1] - p.global_extent, 0)]
                      for p, c in zip(plans, coords)] + [[0, 0]]
    padded = np.pad(x, pad)
    index = (slice(None),) + tuple(
        slice(p.needed[c][0] + before, p.needed[c][1] + before)
        for p, c, (before, _) in zip(plans, coords, pad[1:4])
    )
    return transposed_convolution_shard(tf.constant(padded[index]), kernel, plans, coords).numpy()


TRANSPOSED_AXES = [
    # (kernel, stride, padding, output_padding) along the split axis
    (k, t, padding, op)
    for k in (1, 2, 3, 4, 5)
    for t in (1, 2, 3)
    for padding in ("valid", "same")
    for op in (None,) + tuple(range(t))
]


@pytest.mark.parametrize("shards", [2, 3])
def test_every_shard_of_a_transposed_convolution_is_the_whole_volumes(shards):
    """The planner (`plan_transposed_axis`) and the local computation
    (`transposed_convolution_shard`) give every shard exactly its slab of Keras's
    transposed convolution of the whole volume, for every kernel 1-5, stride 1-3,
    padding and output padding along a split depth axis (extents chosen so that input
    and output split evenly; configurations Keras itself rejects are skipped)."""
    rng = np.random.default_rng(shards)
    checked = rejected = 0
    for k, t, padding, op in TRANSPOSED_AXES:
        extent = next((e for e in range(shards, 13 * shards, shards)
                       if transposed_output_extent(e, k, t, padding, op) % shards == 0), None)
        if extent is None:  # the output never splits evenly (e.g. 2E + 1 outputs)
            continue
        x = rng.uniform(-1, 1, (1, extent, 3, 2, 2)).astype("float32")
        kernel = tf.constant(rng.standard_normal((k, 3, 1, 3, 2)).astype("float32"))
        try:
            whole = keras.ops.conv_transpose(
                x, kernel, (t, 1, 1), padding, None if op is None else (op, 0, 0)).numpy()
        except Exception:  # noqa: BLE001  (TensorFlow rejects it: nothing to match)
            # Only where TensorFlow's output size check fails: 'same' with an output
            # padding that makes ceil(O / t) differ from E.
            out = transposed_output_extent(extent, k, t, padding, op)
            assert padding == "same" and op is not None and -(-out // t) != extent, (k, t, padding, op)
            rejected += 1
            continue
        plans = (plan_transposed_axis(extent, shards, k, t, padding, op),
                 plan_transposed_axis(3, 1, 3, 1, padding, None if op is None else 0),
                 plan_transposed_axis(2, 1, 1, 1, padding, None if op is None else 0))
        assert plans[0].output_extent == whole.shape[1], (k, t, padding, op)
        # Equal extended lengths: an exchange along a later axis sends equal extents.
        assert len({stop - start for start, stop in plans[0].needed}) == 1
        assert [p.output_extent for p in plans[1:]] == list(whole.shape[2:4])
        per_shard = whole.shape[1] // shards
        for shard in range(shards):
            got = _shard_of_transposed_convolution(x, kernel, plans, (shard, 0, 0))
            want = whole[:, shard * per_shard:(shard + 1) * per_shard]
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5,
                                       err_msg=f"k={k} t={t} {padding} op={op} shard {shard}")
        checked += 1
    assert checked >= 40 and rejected <= 4, (checked, rejected)


@pytest.mark.parametrize("kernel,stride,padding", [(2, 2, "valid"), (2, 2, "same"), (1, 2, "valid"),
                                                   (1, 3, "same"), (2, 3, "valid")])
def test_transposed_convolution_needs_no_halo_when_each_input_fills_its_own_block(kernel, stride, padding):
    plan = plan_transposed_axis(8, 4, kernel, stride, padding)
    assert not plan.exchanges
    assert all(plan.halo(shard) == (0, 0) for shard in range(4))


def test_transposed_axis_plan_refuses_too_many_shards_and_bad_output_padding():
    with pytest.raises(ValueError, match="Input extent 3 and output extent 7 must both be at least the 4 shards"):
        plan_transposed_axis(3, 4, 3, 2, "valid")
    with pytest.raises(ValueError, match="less than the stride. Received: output_padding=2, stride=2"):
        plan_transposed_axis(8, 2, 3, 2, "valid", 2)


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
    "dilation": (dict(kernel_size=3, padding="same", dilation_rate=2), r"dilation_rate=1\. .*=\(2, 2, 2\)"),
    "dilation-one-axis": (dict(kernel_size=2, strides=1, dilation_rate=(1, 3, 1)), r"dilation_rate=\(1, 3, 1\)"),
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
    _, expected = assert_reloads_identically(model, x, tmp_path / "skip.keras")
    plain = to_keras_model(model)
    assert not any(type(layer).__module__.startswith("keras_spatial") for layer in plain.layers)
    np.testing.assert_array_equal(plain.predict(x, verbose=0), expected)
