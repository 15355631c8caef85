"""One comparison of a spatial result with plain Keras's, shared by every test module.

`excess` is a number a worker process can send back (a float survives Horovod's and
JSON's round trips where an array of booleans would not); `failures` picks the entries
of a result that are not within tolerance. NaN or infinity never pass: `max` over an
array with a NaN is NaN, and NaN > 0 is False, so a plain `v > 0` filter would count a
NaN output as a pass.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np


def excess(actual, expected, rtol: float = 1e-5, atol: float = 1e-5) -> float:
    """max(|a - b| - (atol + rtol |b|)) over the elements: <= 0 means within tolerance.

    Returns inf when the shapes differ, or when `actual` is not finite where `expected`
    is (or the other way round); positions where both hold the same NaN or infinity
    agree. An empty pair agrees (-inf)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    if actual.shape != expected.shape:
        return float("inf")
    finite = np.isfinite(expected)
    if not np.array_equal(np.isfinite(actual), finite):
        return float("inf")
    if not np.array_equal(actual[~finite], expected[~finite], equal_nan=True):
        return float("inf")
    if not finite.any():
        return float("-inf")
    a, b = actual[finite], expected[finite]
    return float(np.max(np.abs(a - b) - (atol + rtol * np.abs(b))))


def failures(numbers: Mapping[str, object]) -> dict:
    """The float entries of `numbers` that are not <= 0 (so NaN is a failure)."""
    return {k: v for k, v in numbers.items() if isinstance(v, float) and not v <= 0}


def assert_reloads_identically(model, x, path):
    """Saves `model` to the `.keras` file `path`, loads it back, and checks that the
    loaded model has the same layer classes and predicts exactly the same on `x`.

    Returns:
        (loaded model, the original model's prediction on `x`).
    """
    import keras

    model.save(path)
    loaded = keras.saving.load_model(path)
    assert [type(layer).__name__ for layer in loaded.layers] == [type(layer).__name__ for layer in model.layers]
    expected = model.predict(x, verbose=0)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), expected)
    return loaded, expected
