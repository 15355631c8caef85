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


def test_bucket_bytes_survive_the_config_and_bad_values_are_refused():
    optimizer = ks.DistributedOptimizer(keras.optimizers.Adam(3e-3), bucket_bytes=1 << 20)
    assert ks.DistributedOptimizer.from_config(optimizer.get_config()).bucket_bytes == 1 << 20
    for bad in (0, -1, 2.5, True, "1MB"):
        with pytest.raises(ValueError, match="`bucket_bytes` must be None or a positive integer"):
            ks.DistributedOptimizer(keras.optimizers.Adam(), bucket_bytes=bad)


def test_gradient_buckets_go_backwards_and_respect_the_size():
    import tensorflow as tf

    from keras_spatial.optimizer import gradient_buckets

    sizes = {0: 100, 1: 10, 2: 10, 3: 300, 4: 50}  # float32 elements
    tensors = {k: tf.zeros([n]) for k, n in sizes.items()}
    assert gradient_buckets(tensors, None) == [[0, 1, 2, 3, 4]]
    # 4*50 = 200 bytes; 3 (1200 bytes) is a bucket of its own; 2, 1 (80 bytes) then 0.
    assert gradient_buckets(tensors, 400) == [[4], [3], [2, 1], [0]]
    assert gradient_buckets(tensors, 1 << 20) == [[4, 3, 2, 1, 0]]
    assert gradient_buckets({}, 400) == []


def test_update_owners_balance_elements_and_agree_everywhere():
    from keras_spatial.optimizer import update_owners

    shapes = [(3, 3, 3, 4, 16), (16,), (3, 3, 3, 16, 16), (16,), (16, 1), (1,)]
    owners = update_owners(shapes, 2)
    # Largest first: 6912 -> rank 0, 1728 -> rank 1, then the small ones to rank 1.
    assert owners == [1, 1, 0, 1, 1, 1]
    assert update_owners(shapes, 2) == owners  # a pure function of the shapes
    assert update_owners(shapes, 1) == [0] * 6
    assert sorted(set(update_owners([(4,)] * 8, 4))) == [0, 1, 2, 3]
    assert update_owners([(2, 2), ()], 2) == [0, 1]  # a scalar counts one element


def test_shard_update_survives_the_config_and_changes_nothing_in_one_process():
    optimizer = ks.DistributedOptimizer(keras.optimizers.Adam(3e-3), shard_update=True)
    assert ks.DistributedOptimizer.from_config(optimizer.get_config()).shard_update is True
    plain, _ = _train(make_optimizer("adam"))
    sharded, _ = _train(ks.SpatialStrategy().distribute_optimizer(make_optimizer("adam"), shard_update=True))
    for a, b in zip(sharded.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("inner,message", [
    (keras.optimizers.Adam(global_clipnorm=1.0), "global_clipnorm"),
    (keras.optimizers.Adam(use_ema=True), "use_ema"),
    (keras.optimizers.SGD(gradient_accumulation_steps=2), "gradient_accumulation_steps"),
    (keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()), "LossScaleOptimizer"),
])
def test_shard_update_refuses_updates_that_need_every_variable(inner, message):
    with pytest.raises(ValueError, match=f"shard_update=True updates each variable on one rank.*{message}"):
        ks.DistributedOptimizer(inner, shard_update=True)
    ks.DistributedOptimizer(inner)  # fine without sharding


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_shard_update_must_be_a_bool(bad):
    with pytest.raises(ValueError, match="`shard_update` must be True or False"):
        ks.DistributedOptimizer(keras.optimizers.Adam(), shard_update=bad)


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
