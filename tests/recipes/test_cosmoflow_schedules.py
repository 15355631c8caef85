"""The CosmoFlow trainer's learning-rate schedules, MLPerf HPC's reference in particular."""

import keras
import numpy as np
import pytest

from recipes.cosmoflow import schedules


def per_epoch(schedule, epochs, steps):
    return [float(schedule(epoch * steps + steps // 2)) for epoch in range(epochs)]


def reference_rate(epoch, base, peak, warmup, decay):
    """MLPerf HPC's `_lr_schedule` (cosmoflow/utils/optimizers.py), restated."""
    if epoch < warmup:
        return epoch * (peak - base) / warmup + base
    factor, last = 1.0, 0
    for boundary, value in decay:
        if boundary >= last and boundary < epoch:
            last, factor = boundary, value
    return peak * factor


def test_mlperf_schedule_at_full_length_is_the_reference():
    schedule = schedules.mlperf_schedule(global_batch=256, epochs=128, steps_per_epoch=3)
    assert schedule.peak == pytest.approx(0.004) and schedule.base == pytest.approx(0.001)
    expected = [reference_rate(e, 0.001, 0.004, 4, ((32, 0.25), (64, 0.125))) for e in range(128)]
    np.testing.assert_allclose(per_epoch(schedule, 128, 3), expected, rtol=1e-6)


def test_mlperf_schedule_scaled_to_a_short_run():
    schedule = schedules.mlperf_schedule(global_batch=4, epochs=16, steps_per_epoch=5)
    assert (schedule.warmup_epochs, schedule.boundaries) == (1, [4, 8])
    rates = per_epoch(schedule, 16, 5)
    peak = 0.001 * 4 / 64
    np.testing.assert_allclose(rates[0], 0.001)  # epoch 0 of the warm-up: the base rate
    np.testing.assert_allclose(rates[1:5], peak)
    np.testing.assert_allclose(rates[5:9], peak * 0.25)
    np.testing.assert_allclose(rates[9:], peak * 0.125)


def test_optimizers_of_each_schedule():
    sgd, text = schedules.make_optimizer("mlperf", 1.0, global_batch=8, epochs=8, steps_per_epoch=2)
    assert isinstance(sgd, keras.optimizers.SGD) and sgd.momentum == pytest.approx(0.9)
    assert "SGD momentum 0.9" in text
    adam, _ = schedules.make_optimizer("warmup-cosine", 1e-3, global_batch=4, epochs=4,
                                       steps_per_epoch=10, warmup_epochs=1)
    rate = adam.learning_rate  # a schedule: warm-up from 0, peak after 1 epoch, then decay
    assert float(adam._learning_rate(0)) == 0.0
    assert float(adam._learning_rate(10)) == pytest.approx(1e-3)
    assert float(adam._learning_rate(39)) < 2e-5
    assert rate is not None
    constant, text = schedules.make_optimizer("constant", 1e-4, global_batch=4, epochs=1, steps_per_epoch=1)
    assert text == "Adam 0.0001"
    with pytest.raises(ValueError, match="`schedule` must be one of"):
        schedules.make_optimizer("cyclic", 1e-3, global_batch=4, epochs=1, steps_per_epoch=1)


def test_schedule_round_trips_through_its_config():
    schedule = schedules.mlperf_schedule(global_batch=64, epochs=32, steps_per_epoch=4)
    again = schedules.EpochPiecewise.from_config(schedule.get_config())
    assert per_epoch(again, 32, 4) == per_epoch(schedule, 32, 4)
    with pytest.raises(ValueError, match="`boundaries` must be increasing"):
        schedules.EpochPiecewise(0.1, 0.2, 4, 1, boundaries=(8, 4), factors=(0.5, 0.25))
