"""World size 1: DistributedOptimizer is its inner optimizer; callbacks; jit_compile."""

import numpy as np
import pytest

keras = pytest.importorskip("keras")

import keras_spatial as ks  # noqa: E402
from tests.distributed.training_workers import make_optimizer, voxel_regression_model  # noqa: E402


def _train(optimizer, seed=0):
    keras.utils.set_random_seed(seed)
    model = voxel_regression_model((8, 8, 8, 2))
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
    x = np.random.default_rng(1).standard_normal((6, 8, 8, 8, 2)).astype("float32")
    history = model.fit(x, np.tanh(x[..., :1]), batch_size=2, epochs=2, shuffle=False, verbose=0,
                        callbacks=ks.SpatialStrategy().callbacks())
    return model, history


@pytest.mark.parametrize("kind", ["adam", "sgd-schedule", "adamw"])
def test_distributed_optimizer_of_one_process_is_the_inner_optimizer(kind):
    plain, plain_history = _train(make_optimizer(kind))
    wrapped, wrapped_history = _train(ks.SpatialStrategy().distribute_optimizer(make_optimizer(kind)))
    assert isinstance(wrapped.optimizer, ks.DistributedOptimizer)
    for a, b in zip(wrapped.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert wrapped_history.history == plain_history.history
    assert int(wrapped.optimizer.iterations.numpy()) == 6
    assert wrapped.optimizer.learning_rate is not None


def test_distributed_optimizer_config_round_trips_and_saves(tmp_path):
    model, _ = _train(ks.DistributedOptimizer(keras.optimizers.Adam(3e-3)))
    config = model.optimizer.get_config()
    clone = ks.DistributedOptimizer.from_config(config)
    assert clone.get_config() == config
    assert not clone.broadcast_on_build  # restored optimizers never broadcast
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded.optimizer, ks.DistributedOptimizer)
    assert int(loaded.optimizer.iterations.numpy()) == int(model.optimizer.iterations.numpy())


@pytest.mark.parametrize("bad", [None, "adam", ks.DistributedOptimizer(keras.optimizers.SGD())])
def test_distributed_optimizer_refuses_what_it_cannot_wrap(bad):
    with pytest.raises(ValueError):
        ks.DistributedOptimizer(bad)


@pytest.mark.parametrize("jit_compile", [True, "auto"])
def test_spatial_models_are_never_xla_compiled(jit_compile):
    model = voxel_regression_model((8, 8, 8, 2))
    model.compile(optimizer="sgd", loss="mse", jit_compile=jit_compile)
    assert model.jit_compile is False


def test_callbacks_put_metric_average_first():
    checkpoint = keras.callbacks.ModelCheckpoint("unused.keras")
    callbacks = ks.SpatialStrategy().callbacks(checkpoint)
    assert isinstance(callbacks[0], ks.callbacks.MetricAverage)
    assert isinstance(callbacks[1], ks.callbacks.ReplicatedLayerSync)
    assert callbacks[2] is checkpoint
    assert ks.callbacks.rank_zero_callbacks([checkpoint], rank=1) == []


def test_replicated_layers_are_the_ones_after_the_gather():
    from keras_spatial.plan import replicated_layers

    inputs = ks.Input((8, 8, 8, 2))
    y = ks.layers.SpatialConv3D(2, 3, padding="same", name="conv")(inputs)
    y = ks.layers.SpatialFlatten(name="flatten")(y)
    y = keras.layers.Dense(3, name="dense1")(y)
    y = keras.layers.Dropout(0.5, name="dropout")(y)
    y = keras.layers.Dense(1, name="dense2")(y)
    model = keras.Model(inputs, y)
    names = [layer.name for layer in replicated_layers(model, ks.SpatialStrategy())]
    assert names == ["dense1", "dropout", "dense2"]
