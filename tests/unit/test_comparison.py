"""The comparison helper of the spatial-vs-plain tests never lets NaN or inf pass."""

import math

import numpy as np

from tests.comparison import excess, failures


def test_within_and_beyond_tolerance():
    b = np.array([1.0, -2.0, 3.0])
    assert excess(b + 1e-6, b) <= 0
    assert excess(b + np.array([0, 0, 1e-3]), b) > 0
    assert excess(b + 1e-3, b, rtol=1e-3, atol=1e-3) <= 0


def test_nan_or_inf_in_the_result_fails():
    b = np.ones(4)
    for bad in (np.nan, np.inf, -np.inf):
        a = b.copy()
        a[2] = bad
        assert excess(a, b) == math.inf
        assert failures({"output": excess(a, b)}) == {"output": math.inf}


def test_nan_in_the_reference_only_fails_and_matching_nan_agrees():
    a = np.array([1.0, 2.0])
    b = np.array([1.0, np.nan])
    assert excess(a, b) == math.inf
    assert excess(b, b) <= 0
    assert excess(np.array([np.inf, 1.0]), np.array([-np.inf, 1.0])) == math.inf


def test_shape_mismatch_fails():
    assert excess(np.ones((2, 3)), np.ones((3, 2))) == math.inf


def test_failures_counts_nan_numbers_as_failures():
    numbers = {"output": -1e-7, "grad_kernel": float("nan"), "extents": [4, 4], "loss": 0.5}
    assert failures(numbers) == {"grad_kernel": numbers["grad_kernel"], "loss": 0.5}
