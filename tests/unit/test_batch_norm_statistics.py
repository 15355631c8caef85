"""recompute_batch_norm_statistics and the RecomputeBatchNormStatistics callback in one
process, against statistics computed by hand with numpy."""

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import keras_spatial as ks  # noqa: E402
from keras_spatial.callbacks import RecomputeBatchNormStatistics  # noqa: E402

SHAPE = (4, 3, 2, 2)
EPSILON = (1e-3, 1e-2)


def _model(seed=0):
    """BN on the input -> 1x1x1 conv (a matmul over channels) -> BN -> mean -> Dense."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input(SHAPE)
    y = keras.layers.BatchNormalization(momentum=0.9, epsilon=EPSILON[0], name="bn1")(inputs)
    y = keras.layers.Conv3D(3, 1, name="conv")(y)
    y = keras.layers.BatchNormalization(momentum=0.7, epsilon=EPSILON[1], name="bn2")(y)
    y = keras.layers.GlobalAveragePooling3D()(y)
    model = keras.Model(inputs, keras.layers.Dense(1, name="dense")(y))
    rng = np.random.default_rng(seed)
    for name in ("bn1", "bn2"):
        layer = model.get_layer(name)
        layer.gamma.assign(rng.uniform(0.5, 2.0, layer.gamma.shape).astype("float32"))
        layer.beta.assign(rng.standard_normal(layer.beta.shape).astype("float32"))
    return model


def _batches(count=3, batch=4, seed=1):
    rng = np.random.default_rng(seed)
    return [(1.5 + 2.0 * rng.standard_normal((batch, *SHAPE))).astype("float32") for _ in range(count)]


def _expected(model, batches):
    """Mean over batches of each BN's batch mean and (biased) variance, by numpy."""
    bn1, conv, bn2 = (model.get_layer(n) for n in ("bn1", "conv", "bn2"))
    kernel = conv.kernel.numpy().reshape(SHAPE[-1], -1)
    sums = np.zeros(4, dtype=object)
    for x in batches:
        x = x.astype(np.float64).reshape(-1, SHAPE[-1])
        m1, v1 = x.mean(0), x.var(0)
        n1 = bn1.gamma.numpy() * (x - m1) / np.sqrt(v1 + EPSILON[0]) + bn1.beta.numpy()
        h = n1 @ kernel + conv.bias.numpy()
        sums = sums + np.array([m1, v1, h.mean(0), h.var(0)], dtype=object)
    return [s / len(batches) for s in sums]


def _state(model):
    return [v.numpy().copy() for n in ("bn1", "bn2")
            for v in (model.get_layer(n).moving_mean, model.get_layer(n).moving_variance)]


def test_moving_statistics_are_the_average_batch_statistics():
    model = _model()
    batches = _batches()
    used = ks.recompute_batch_norm_statistics(model, tf.data.Dataset.from_tensor_slices(np.stack(batches)))
    assert used == 3
    for got, want in zip(_state(model), _expected(model, batches)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert [model.get_layer(n).momentum for n in ("bn1", "bn2")] == [0.9, 0.7]
    # A list of (x, y) batches works too, and `steps` takes the first ones only.
    pairs = [(x, np.zeros((len(x), 1), "float32")) for x in batches]
    assert ks.recompute_batch_norm_statistics(model, pairs, steps=2) == 2
    for got, want in zip(_state(model), _expected(model, batches[:2])):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_result_differs_from_the_moving_average_of_training():
    # The check above can fail: a training-mode pass with the layers' own momentum
    # leaves other values.
    model = _model()
    batches = _batches()
    for x in batches:
        model(x, training=True)
    expected = _expected(model, batches)
    assert not all(np.allclose(g, w, rtol=1e-3) for g, w in zip(_state(model), expected))


def test_bad_input_raises_and_leaves_the_statistics_as_they_were():
    model = _model()
    before = _state(model)
    plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="no trainable BatchNormalization"):
        ks.recompute_batch_norm_statistics(plain, _batches(1))
    for steps in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="`steps` must be a positive integer"):
            ks.recompute_batch_norm_statistics(model, _batches(1), steps=steps)
    with pytest.raises(ValueError, match="infinite"):
        ks.recompute_batch_norm_statistics(model, tf.data.Dataset.from_tensor_slices(np.stack(_batches(1))).repeat())
    with pytest.raises(ValueError, match="yielded no batch"):
        ks.recompute_batch_norm_statistics(model, [])
    wrong = _batches(1) + [np.zeros((2, 5, 5, 5, 5), "float32")]  # fails on the second batch
    with pytest.raises(ValueError):
        ks.recompute_batch_norm_statistics(model, wrong)
    for got, want in zip(_state(model), before):
        np.testing.assert_array_equal(got, want)
    assert [model.get_layer(n).momentum for n in ("bn1", "bn2")] == [0.9, 0.7]
    with pytest.raises(ValueError, match="`steps` must be a positive integer"):
        RecomputeBatchNormStatistics(_batches(1), steps=0)


def _fit(callbacks, epochs=3):
    model = _model(seed=3)
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    rng = np.random.default_rng(4)
    x = (1.5 + 2.0 * rng.standard_normal((16, *SHAPE))).astype("float32")
    y = x.mean(axis=(1, 2, 3, 4))[:, None]
    train = tf.data.Dataset.from_tensor_slices((x[:12], y[:12])).batch(4)
    val = tf.data.Dataset.from_tensor_slices((x[12:], y[12:])).batch(4)
    stats = tf.data.Dataset.from_tensor_slices((x[:12], y[:12])).batch(4)
    history = model.fit(train, validation_data=val, epochs=epochs, verbose=0, callbacks=callbacks(stats))
    return model, history.history, stats, val


def test_callback_recomputes_before_the_last_validation(capsys):
    model, history, stats, val = _fit(lambda stats: [RecomputeBatchNormStatistics(stats)])
    assert capsys.readouterr().out.count("RecomputeBatchNormStatistics: epoch 3,") == 1
    # The logged last validation is that of the recomputed model ...
    assert history["val_loss"][-1] == pytest.approx(model.evaluate(val, verbose=0), rel=1e-6)
    # ... whose statistics are those of its final weights (a second pass changes nothing).
    before = _state(model)
    ks.recompute_batch_norm_statistics(model, stats)
    for got, want in zip(_state(model), before):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    # Without the callback the moving statistics are those of the moving average.
    plain, _, stats, _ = _fit(lambda stats: [])
    moving = _state(plain)
    ks.recompute_batch_norm_statistics(plain, stats)
    assert not all(np.allclose(g, w, rtol=1e-4) for g, w in zip(_state(plain), moving))


def test_callback_every_epoch_and_without_validation(capsys):
    _fit(lambda stats: [RecomputeBatchNormStatistics(stats, every_epoch=True)])
    out = capsys.readouterr().out
    assert [out.count(f"epoch {e},") for e in (1, 2, 3)] == [1, 1, 1]
    model = _model()
    model.compile(optimizer="sgd", loss="mse")
    x = np.stack(_batches(1, batch=8))[0]
    stats = tf.data.Dataset.from_tensor_slices(x).batch(4)
    model.fit(x, x[:, 0, 0, 0, :1], epochs=2, batch_size=4, verbose=0,
              callbacks=[RecomputeBatchNormStatistics(stats)])
    assert capsys.readouterr().out.count("epoch 2,") == 1
    plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    plain.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="no trainable BatchNormalization"):
        plain.fit(np.zeros((4, 3)), np.zeros((4, 1)), verbose=0,
                  callbacks=[RecomputeBatchNormStatistics(stats)])
