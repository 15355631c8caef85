"""World size 1: every spatial layer is exactly its Keras parent; errors and saving."""

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import keras_spatial as ks  # noqa: E402
from tests.comparison import assert_reloads_identically  # noqa: E402
from tests.distributed.layer_cases import conv_grid, pool_grid  # noqa: E402
from tests.distributed.layer_workers import build_layer, outputs_and_grads, stack_model  # noqa: E402

CASES = conv_grid() + pool_grid()


@pytest.mark.parametrize("with_strategy", [False, True], ids=["no-strategy", "strategy-1x1x1"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_world_size_one_is_exactly_keras(case, with_strategy):
    shape = (case.batch, 11, 10, 9, case.channels)
    x = np.random.default_rng(case.seed).uniform(-1, 1, shape).astype("float32")
    spatial, plain = build_layer(case, spatial=True), build_layer(case, spatial=False)
    plain.build(shape)
    if with_strategy:
        strategy = ks.SpatialStrategy((1, 1, 1))
        assert strategy.size == 1 and not strategy.is_spatial
        with strategy.scope():
            spatial.build(shape)
    else:
        spatial.build(shape)
    spatial.set_weights(plain.get_weights())
    for got, want in zip(outputs_and_grads(spatial, x), outputs_and_grads(plain, x)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "layer_class,kwargs",
    [
        (ks.layers.SpatialConv3D, dict(filters=2, kernel_size=3)),
        (ks.layers.SpatialMaxPooling3D, dict(pool_size=2)),
        (ks.layers.SpatialAveragePooling3D, dict(pool_size=2)),
    ],
)
def test_channels_first_is_refused(layer_class, kwargs):
    with pytest.raises(ks.SpatialNotSupportedError, match="channels_last.*channels_first"):
        layer_class(data_format="channels_first", **kwargs)
    assert issubclass(ks.SpatialNotSupportedError, NotImplementedError)


@pytest.mark.parametrize("case", [c for c in CASES if "k3" in c.name or "p3" in c.name], ids=lambda c: c.name)
def test_get_config_round_trips(case):
    layer = build_layer(case, spatial=True)
    config = layer.get_config()
    clone = type(layer).from_config(config)
    assert clone.get_config() == config
    serialized = keras.saving.serialize_keras_object(layer)
    assert serialized["registered_name"].startswith("keras_spatial>")
    assert keras.saving.deserialize_keras_object(serialized).get_config() == config


def test_model_saves_and_loads(tmp_path):
    keras.utils.set_random_seed(3)
    model = stack_model((16, 16, 16, 2))
    x = np.random.default_rng(0).uniform(-1, 1, (2, 16, 16, 16, 2)).astype("float32")
    loaded, _ = assert_reloads_identically(model, x, tmp_path / "stack.keras")
    assert loaded.get_layer(index=0).global_batch_shape == (None, 16, 16, 16, 2)


def test_input_keeps_global_shape_in_config():
    layer = ks.layers.SpatialInputLayer(shape=(8, 8, 8, 3), batch_size=2)
    assert layer.get_config()["batch_shape"] == (2, 8, 8, 8, 3)
    assert ks.Input((8, 8, 8, 3)).shape == (None, 8, 8, 8, 3)


@pytest.mark.parametrize("shape", [(8, 8, 3), (8, 8, 8, 8, 3)])
def test_input_needs_a_volume_with_channels(shape):
    with pytest.raises(ValueError, match="channels-last shape"):
        ks.Input(shape)


def test_spatial_split_without_launcher_is_refused():
    with pytest.raises(ValueError, match="multiple of the spatial size 2.*world_size=1"):
        ks.SpatialStrategy((2, 1, 1))


def test_strategy_of_one_process():
    strategy = ks.SpatialStrategy()
    assert (strategy.rank, strategy.size, strategy.coords, strategy.data_index) == (0, 1, (0, 0, 0), 0)
    x = np.arange(2 * 4 * 4 * 4).reshape(2, 4, 4, 4, 1)
    np.testing.assert_array_equal(strategy.shard(x), x)
    np.testing.assert_array_equal(strategy.gather(tf.constant(x)).numpy(), x)
    assert "spatial_shape=(1, 1, 1)" in repr(strategy)
    with pytest.raises(ValueError, match="channels-last 5D"):
        strategy.shard(np.zeros((4, 4, 4)))


def test_scope_overrides_the_latest_strategy():
    first = ks.SpatialStrategy()
    second = ks.SpatialStrategy()
    assert ks.get_strategy() is second
    with first.scope():
        assert ks.get_strategy() is first
    assert ks.get_strategy() is second
