"""FusedAdam: Keras's Adam to float32 rounding, with its options, state layout and saving."""

import numpy as np
import pytest

keras = pytest.importorskip("keras")

import keras_spatial as ks  # noqa: E402
from tests.allocator_peaks import allocator_peaks  # noqa: E402
from tests.distributed.training_workers import voxel_regression_model  # noqa: E402

ADAM_OPTIONS = {
    "defaults": {},
    "amsgrad": {"amsgrad": True},
    "weight-decay-and-clipnorm": {"weight_decay": 0.05, "clipnorm": 0.1},
    "schedule-and-global-clipnorm": {
        "learning_rate": keras.optimizers.schedules.ExponentialDecay(0.02, decay_steps=2, decay_rate=0.5),
        "global_clipnorm": 0.5,
    },
    "ema": {"use_ema": True, "ema_momentum": 0.5, "ema_overwrite_frequency": 3},
    "gradient-accumulation": {"gradient_accumulation_steps": 2},
    "betas-epsilon": {"beta_1": 0.8, "beta_2": 0.95, "epsilon": 1e-4},
}


def _fit(optimizer, seed=0, model_fn=None):
    keras.utils.set_random_seed(seed)
    model = (model_fn or (lambda: voxel_regression_model((8, 8, 8, 2))))()
    model.compile(optimizer=optimizer, loss="mse")
    x = np.random.default_rng(1).standard_normal((8, 8, 8, 8, 2)).astype("float32")
    model.fit(x, np.tanh(x[..., :1]), batch_size=2, epochs=2, shuffle=False, verbose=0)
    return model


@pytest.mark.parametrize("options", ADAM_OPTIONS.values(), ids=ADAM_OPTIONS.keys())
def test_fused_adam_trains_like_keras_adam(options):
    options = {"learning_rate": 1e-2, **options}
    plain = _fit(keras.optimizers.Adam(**options))
    fused = _fit(ks.FusedAdam(**options))
    moved = max(np.abs(a - b).max() for a, b in zip(plain.get_weights(), _fit_initial_weights()))
    assert moved > 1e-3, "training did not change the weights"
    # Weights and optimizer state (moments, EMA copies, accumulators) after 8 steps:
    # float32 rounding (an XLA multiply-add may round once where Adam rounds twice).
    for a, b in zip(fused.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    def layout(optimizer):  # slot kinds and shapes, in order (layer names are numbered)
        return [(tuple(v.shape), v.path.rsplit("/", 1)[-1].rsplit("_", 1)[-1]) for v in optimizer.variables]

    assert layout(fused.optimizer) == layout(plain.optimizer)
    for a, b in zip(fused.optimizer.variables, plain.optimizer.variables):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_dense_updates_are_xla_clusters():
    """The update is compiled (not silently Adam's own kernels): one call marked
    _XlaMustCompile per variable in the traced step."""
    import tensorflow as tf

    variables = [keras.Variable(np.ones((3, 4), "float32")), keras.Variable(np.ones((4,), "float32"))]
    optimizer = ks.FusedAdam(1e-2)
    optimizer.build(variables)
    graph = tf.function(lambda g: optimizer.apply(g, variables)).get_concrete_function(
        [tf.TensorSpec((3, 4)), tf.TensorSpec((4,))]
    ).graph
    compiled = [op for op in graph.get_operations()
                if "_XlaMustCompile" in op.node_def.attr and op.get_attr("_XlaMustCompile")]
    assert len(compiled) == 2


def test_eager_training_compiles_each_update_once():
    keras.utils.set_random_seed(0)
    model = voxel_regression_model((8, 8, 8, 2))
    optimizer = ks.FusedAdam(1e-2)
    model.compile(optimizer=optimizer, loss="mse", run_eagerly=True)
    x = np.random.default_rng(1).standard_normal((6, 8, 8, 8, 2)).astype("float32")
    model.fit(x, np.tanh(x[..., :1]), batch_size=2, epochs=1, verbose=0)
    assert len(optimizer._compiled_updates) == len(model.trainable_variables)
    assert all(f.experimental_get_tracing_count() == 1 for f in optimizer._compiled_updates.values())


def test_two_optimizers_never_share_a_compiled_update():
    """Variables of the same shape, made and dropped one after another (Python may reuse
    the ids): each update reaches its own variables."""
    for value in (1.0, 2.0, 3.0):
        variable = keras.Variable(np.full((4,), value, "float32"))
        optimizer = ks.FusedAdam(0.5)
        optimizer.build([variable])
        optimizer.apply([np.ones((4,), "float32")], [variable])
        np.testing.assert_allclose(np.asarray(variable), value - 0.5, rtol=1e-4)  # epsilon: 3e-6
        del variable, optimizer


def _fit_initial_weights():
    keras.utils.set_random_seed(0)
    return voxel_regression_model((8, 8, 8, 2)).get_weights()


def test_fused_adam_under_distributed_optimizer_of_one_process():
    plain = _fit(ks.FusedAdam(1e-2))
    wrapped = _fit(ks.SpatialStrategy().distribute_optimizer(ks.FusedAdam(1e-2)))
    for a, b in zip(wrapped.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_sparse_gradients_take_adams_own_update():
    def embedding_model():
        inputs = keras.Input((3,), dtype="int32")
        y = keras.layers.Embedding(10, 4)(inputs)
        return keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Flatten()(y)))

    def fit(optimizer):
        keras.utils.set_random_seed(0)
        model = embedding_model()
        model.compile(optimizer=optimizer, loss="mse")
        x = np.random.default_rng(0).integers(0, 10, (8, 3)).astype("int32")
        model.fit(x, np.ones((8, 1), "float32"), batch_size=4, epochs=2, verbose=0)
        return model

    for a, b in zip(fit(ks.FusedAdam(1e-2)).get_weights(), fit(keras.optimizers.Adam(1e-2)).get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_fused_adam_config_round_trips_and_saves(tmp_path):
    optimizer = ks.FusedAdam(3e-3, beta_2=0.99, amsgrad=True)
    config = optimizer.get_config()
    assert config["name"] == "fused_adam"
    assert ks.FusedAdam.from_config(config).get_config() == config
    model = _fit(ks.DistributedOptimizer(ks.FusedAdam(3e-3)))
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded.optimizer.inner_optimizer) is ks.FusedAdam
    for a, b in zip(loaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fused_adam_updates_in_place():
    """Adam's update of a 32 MiB variable allocates two temporaries of its size; the fused
    one none (XLA writes the variable and both moments in place). TensorFlow's BFC
    allocator reports the peak, so this runs in its own process."""
    adam_peak, fused_peak = allocator_peaks(
        """
        import numpy as np, tensorflow as tf, keras
        import keras_spatial as ks
        peaks = []
        for optimizer in (keras.optimizers.Adam(1e-3), ks.FusedAdam(1e-3)):
            variables = [keras.Variable(np.zeros((8192, 1024), "float32"))]
            optimizer.build(variables)
            gradients = [tf.ones((8192, 1024))]
            step = tf.function(lambda g: optimizer.apply(g, variables))
            peaks.append(peak_rise_mib(lambda: step(gradients)))
        print("PEAKS", *peaks)
        """
    )
    assert adam_peak >= 32, f"the measurement does not see Adam's temporaries ({adam_peak} MiB)"
    assert fused_peak < 1, f"FusedAdam allocated {fused_peak} MiB during its update"
