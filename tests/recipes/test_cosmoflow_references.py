"""Reference estimators of the CosmoFlow claim: features, ridge fit, fit/score split."""

import numpy as np
import pytest

from recipes.cosmoflow import references
from recipes.cosmoflow.universe import UniverseConfig, generate_universe, power_spectrum

SIZE = 24


@pytest.fixture(scope="module")
def tiny_universes():
    """40 universes of 24^3 x 4 (labels drawn as in the data set)."""
    config = UniverseConfig(size=SIZE)
    samples = [generate_universe(3, i, config) for i in range(40)]
    return np.stack([s.counts for s in samples]), np.stack([s.unit_params for s in samples])


def test_binned_power_equals_the_universe_modules_power_spectrum():
    field = np.random.default_rng(0).standard_normal((SIZE,) * 3).astype(np.float32)
    edges = np.geomspace(2 * np.pi / SIZE, np.pi * (1 + 1e-9), references.POWER_BINS + 1)
    _, expected, _ = power_spectrum(field, box_size=float(SIZE), k_edges=edges)
    np.testing.assert_allclose(references.binned_power(field), expected, rtol=1e-5)


def test_feature_shapes_and_bad_input(tiny_universes):
    counts = tiny_universes[0][0]
    assert references.summary_features(counts).shape == (8,)
    assert references.power_spectrum_features(counts).shape == ((references.POWER_BINS + 4) * 4,)
    with pytest.raises(ValueError, match="one cubic sample"):
        references.summary_features(counts[:, :, :20])
    with pytest.raises(ValueError, match="bins without modes"):
        references.power_spectrum_features(counts[:4, :4, :4], bins=8)
    with pytest.raises(ValueError, match="holds no counts"):
        references.power_spectrum_features(np.zeros((8, 8, 8, 1), np.int16), bins=2)


def test_power_spectrum_fit_orders_sigma_8(tiny_universes):
    counts, labels = tiny_universes
    features = np.stack([references.power_spectrum_features(c) for c in counts])
    fit = references.RidgeFit().fit(features[:30], labels[:30])
    predicted = fit.predict(features[30:])[:, 1]
    truth = labels[30:, 1]
    # sigma_8 sets the amplitude of P(k): the held-out ordering is recovered (measured
    # correlation 0.87 from 30 training universes of 24^3).
    assert np.corrcoef(predicted, truth)[0, 1] > 0.75
    assert predicted[truth.argmax()] > predicted[truth.argmin()]
    assert fit.score(features[30:], labels[30:])[1] < 0.5 * truth.var()  # measured 0.33


def test_the_fit_never_sees_the_validation_set(tiny_universes):
    counts, labels = tiny_universes
    features = np.stack([references.summary_features(c) for c in counts])
    train = {"summary_fit": features[:30], "power_spectrum_fit": features[:30]}
    val = {"summary_fit": features[30:], "power_spectrum_fit": features[30:]}
    scores = references.reference_scores(train, labels[:30], val, labels[30:])
    fit = references.RidgeFit().fit(features[:30], labels[:30])
    shuffled = labels[30:][::-1]
    # Only the score changes with the validation labels; the fit (and its penalties,
    # chosen by cross-validation inside the training set) does not.
    again = references.RidgeFit().fit(features[:30], labels[:30])
    np.testing.assert_array_equal(fit.penalty_, again.penalty_)
    np.testing.assert_allclose(scores["summary_fit"], fit.score(features[30:], labels[30:]))
    assert not np.allclose(fit.score(features[30:], shuffled), scores["summary_fit"])


def test_ridge_recovers_an_exact_linear_relation():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((60, 5))
    y = np.c_[x @ [1.0, -2.0, 0.0, 0.5, 0.0] + 3.0, x[:, 0] * 0.1]
    fit = references.RidgeFit().fit(x[:40], y[:40])
    assert np.all(fit.score(x[40:], y[40:]) < 1e-6)
    assert fit.penalty_.tolist() == [1e-6, 1e-6]


def test_ridge_bad_arguments():
    with pytest.raises(ValueError, match="`folds` must be an integer of at least 2"):
        references.RidgeFit(folds=1)
    with pytest.raises(ValueError, match="`penalties` must be non-negative"):
        references.RidgeFit(penalties=(-1.0,))
    with pytest.raises(ValueError, match="need the same N"):
        references.RidgeFit().fit(np.zeros((10, 2)), np.zeros((9, 1)))
    with pytest.raises(ValueError, match="needs fit"):
        references.RidgeFit().predict(np.zeros((2, 2)))


def test_channel_columns_pick_one_channels_features(tiny_universes):
    counts = tiny_universes[0][0]
    summary = references.summary_features(counts)
    power = references.power_spectrum_features(counts)
    alone = counts[..., 2:3]
    np.testing.assert_allclose(summary[references.channel_columns("summary_fit", 2, 4)],
                               references.summary_features(alone))
    np.testing.assert_allclose(power[references.channel_columns("power_spectrum_fit", 2, 4)],
                               references.power_spectrum_features(alone), rtol=1e-6)
    with pytest.raises(ValueError, match="`channel` must be an integer in"):
        references.channel_columns("summary_fit", 4, 4)
    with pytest.raises(ValueError, match="`name` must be one of"):
        references.channel_columns("cnn", 0, 4)


def test_one_channel_cannot_see_what_only_the_ratio_of_channels_holds():
    # Label = the log-ratio of two channels' amplitudes, the second channel's amplitude
    # drawn independently: only the pair of channels determines it.
    rng = np.random.default_rng(2)
    amplitude = rng.uniform(1.0, 2.0, (80, 2))
    features = np.c_[amplitude, np.ones((80, 2))]  # [std_0, std_1, mean_0, mean_1]
    labels = np.log(amplitude[:, 1:] / amplitude[:, :1])
    train = {"summary_fit": features[:60], "power_spectrum_fit": np.zeros((60, 12))}
    val = {"summary_fit": features[60:], "power_spectrum_fit": np.zeros((20, 12))}
    both = references.RidgeFit().fit(features[:60], labels[:60]).score(features[60:], labels[60:])
    alone = references.single_channel_scores(train, labels[:60], val, labels[60:])["summary_fit"]
    assert both[0] < 0.1 * labels[60:].var()
    assert alone[0] > 0.5 * labels[60:].var()
