"""Halo arithmetic against a direct 1D windowed reduction, with no communication."""

import itertools

import numpy as np
import pytest

from keras_spatial.halo import (
    ShardAlignmentError,
    Window,
    local_window_boundary,
    plan_axis,
    plan_transposed_axis,
    plan_upsampling_axis,
    split_bounds,
)


def _global_window_op(signal, window: Window, fill=0.0):
    """Correlation with a ones kernel, as TF pads and strides it (the reference)."""
    extent = len(signal)
    out = window.output_extent(extent)
    p = window.pad_before(extent)
    result = []
    for o in range(out):
        taps = [o * window.stride - p + i * window.dilation for i in range(window.kernel)]
        result.append(sum(signal[t] * (i + 1) if 0 <= t < extent else fill for i, t in enumerate(taps)))
    return np.array(result)


def _sharded_window_op(signal, window: Window, shards: int):
    """Each shard: its own inputs, extended per the plan, then a local 'valid' op."""
    plan = plan_axis(len(signal), shards, window)
    outputs = []
    for j in range(shards):
        n0, n1 = plan.needed[j]
        extended = [signal[i] if 0 <= i < len(signal) else 0.0 for i in range(n0, n1)]
        assert len(extended) == plan.extended_extent(j)
        local = Window(window.kernel, window.stride, window.dilation, "valid")
        out = _global_window_op(np.array(extended), local)
        assert len(out) == plan.local_output_extent(j)
        outputs.append(out)
    return np.concatenate(outputs)


CASES = [
    (extent, shards, Window(k, t, d, pad))
    for extent, shards, k, t, d, pad in itertools.product(
        range(12, 25), (2, 3, 4), range(1, 6), (1, 2), (1, 2), ("same", "valid")
    )
    if not (t > 1 and d > 1)
]


def _servable(extent, shards, window):
    out = window.output_extent(extent)
    return extent >= shards and out >= shards


SERVABLE = [c for c in CASES if _servable(*c)]
UNEVEN = [c for c in SERVABLE if c[0] % c[1] or c[2].output_extent(c[0]) % c[1]]


def test_enough_cases_are_servable():
    assert len(SERVABLE) > 1000 and len(UNEVEN) > 500


@pytest.mark.parametrize("extent,shards,window", SERVABLE)
def test_sharded_op_equals_global_op(extent, shards, window):
    signal = np.random.default_rng(extent * 100 + shards).standard_normal(extent)
    np.testing.assert_allclose(
        _sharded_window_op(signal, window, shards), _global_window_op(signal, window), rtol=1e-12
    )


@pytest.mark.parametrize("extent,shards,window", [
    (3, 4, Window(1)),                       # fewer input planes than shards
    (8, 4, Window(3, 2, 1, "valid")),        # 3 outputs over 4 shards
    (5, 2, Window(5, 1, 1, "valid")),        # 1 output over 2 shards
    (12, 4, Window(3, 4, 1, "same")),        # 3 outputs over 4 shards
])
def test_unservable_split_raises(extent, shards, window):
    with pytest.raises(ShardAlignmentError):
        plan_axis(extent, shards, window)


def test_split_bounds_is_numpy_array_split():
    for extent in range(1, 40):
        for shards in range(1, min(extent, 9) + 1):
            parts = np.array_split(np.arange(extent), shards)
            assert split_bounds(extent, shards) == tuple((int(p[0]), int(p[-1]) + 1) for p in parts)
    with pytest.raises(ShardAlignmentError, match="at least one plane"):
        split_bounds(3, 4)


def test_mlperf_kernel_two_same_has_asymmetric_halo():
    plan = plan_axis(128, 2, Window(2, 1, 1, "same"))
    assert plan.halo(0) == (0, 1)
    assert plan.halo(1) == (0, 1)
    assert plan.padding_after(1) == 1 and plan.padding_before(0) == 0


def test_stride_two_kernel_one_crops():
    plan = plan_axis(16, 2, Window(1, 2, 1, "valid"))
    assert plan.halo(0) == (0, -1)
    assert plan.kept(0) == (0, 7)
    assert not plan.exchanges


def test_valid_halo_depends_on_shard():
    plan = plan_axis(16, 2, Window(3, 1, 1, "valid"))
    assert plan.halo(0) == (0, 1)
    assert plan.halo(1) == (1, 0)
    assert plan.transfer(1, 0) == (8, 9)
    assert plan.transfer(0, 1) == (7, 8)


def test_halo_wider_than_a_shard_comes_from_two_neighbours():
    plan = plan_axis(16, 4, Window(5, 1, 3, "same"))  # reach 6 on each side, shards of 4
    assert plan.halo(2) == (6, 6)
    assert plan.transfer(0, 2) == (2, 4)
    assert plan.transfer(1, 2) == (4, 8)
    assert plan.transfer(3, 2) == (12, 16)
    assert plan.padding_after(2) == 2


def test_valid_counts_leave_padding_out():
    plan = plan_axis(8, 2, Window(3, 2, 1, "same"))
    assert plan.valid_counts(0) + plan.valid_counts(1) == [3, 3, 3, 2]  # TF pads after


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(kernel=0), "kernel"),
        (dict(kernel=3, stride=0), "stride"),
        (dict(kernel=3, dilation=-1), "dilation"),
        (dict(kernel=3, padding="causal"), "padding"),
    ],
)
def test_bad_window_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Window(**kwargs)


def test_window_too_large_for_valid_raises():
    with pytest.raises(ShardAlignmentError, match="larger than the input"):
        plan_axis(4, 2, Window(5, 1, 1, "valid"))


def _pool_1d(signal, window: Window, kind):
    """Average (padding left out of the mean) or maximum over each window, as TF does."""
    extent = len(signal)
    p = window.pad_before(extent)
    result = []
    for o in range(window.output_extent(extent)):
        taps = [o * window.stride - p + i * window.dilation for i in range(window.kernel)]
        inside = [signal[t] for t in taps if 0 <= t < extent]
        result.append(np.mean(inside) if kind == "average" else np.max(inside))
    return np.array(result)


def _pool_shards_in_place(signal, window: Window, shards: int, kind):
    """Each shard pools its own planes, then completes its boundary outputs from the
    planes it would receive (what SpatialAveragePooling3D/SpatialMaxPooling3D do)."""
    plan = plan_axis(len(signal), shards, window)
    outputs = []
    for j in range(shards):
        boundary = local_window_boundary(plan, j)
        if boundary is None:
            return None
        (i0, i1), (n0, n1) = plan.owned[j], plan.needed[j]
        local = _pool_1d(signal[i0:i1], window, kind)
        before, after = signal[max(n0, 0):i0], signal[i1:min(n1, len(signal))]
        for output in boundary:
            spans = [block[a:b] for block, span in ((before, output.before), (after, output.after))
                     if span for a, b in [span]]
            if kind == "average":
                taps = output.local_taps + sum(len(s) for s in spans)
                local[output.index] = (local[output.index] * output.local_taps + sum(np.sum(s) for s in spans)) / taps
            else:
                local[output.index] = max([local[output.index]] + [np.max(s) for s in spans])
        outputs.append(local)
    return np.concatenate(outputs)


POOL_CASES = [c for c in SERVABLE if c[2].dilation == 1]


@pytest.mark.parametrize("kind", ["average", "max"])
def test_pooling_shards_in_place_equals_global_pooling(kind):
    served = served_even = 0
    for extent, shards, window in POOL_CASES:
        signal = np.random.default_rng(extent * 100 + shards).standard_normal(extent)
        result = _pool_shards_in_place(signal, window, shards, kind)
        if result is None:
            continue
        served += 1
        served_even += (extent, shards, window) not in UNEVEN
        np.testing.assert_allclose(result, _pool_1d(signal, window, kind), rtol=1e-12,
                                   err_msg=f"{extent=} {shards=} {window=}")
    even = [c for c in POOL_CASES if c not in UNEVEN]
    assert served_even > len(even) // 2 and served > served_even, (served, served_even, len(even))


def test_cosmoflow_pool_reads_one_plane_of_the_next_shard():
    plan = plan_axis(128, 2, Window(3, 2, 1, "same"))
    first, last = local_window_boundary(plan, 0), local_window_boundary(plan, 1)
    assert [(b.index, b.local_taps, b.before, b.after) for b in first] == [(31, 2, None, (0, 1))]
    assert last == ()  # its last window ends at the volume's edge


def test_misaligned_local_pooling_is_refused():
    # 'same', window 2, stride 1 on 3 shards of 6: the global op pads after, and so does
    # each shard's own op, so shards line up; 'valid' with a crop at the start does not.
    assert local_window_boundary(plan_axis(18, 3, Window(2, 1, 1, "same")), 1) is not None
    assert local_window_boundary(plan_axis(16, 2, Window(3, 1, 1, "valid")), 1) is None


def _transposed_1d(signal, kernel, stride, pad, out_extent):
    """out[o] = sum of signal[i] * kernel[m] over i * stride + m = o + pad."""
    out = np.zeros(out_extent)
    for i, value in enumerate(signal):
        for m, weight in enumerate(kernel):
            o = i * stride + m - pad
            if 0 <= o < out_extent:
                out[o] += value * weight
    return out


@pytest.mark.parametrize("extent", [5, 7, 9, 13, 17])
@pytest.mark.parametrize("shards", [2, 3, 4])
def test_uneven_transposed_plan_gives_each_shard_its_outputs(extent, shards):
    rng = np.random.default_rng(extent * 10 + shards)
    for kernel, stride, padding, output_padding in itertools.product(
            (1, 2, 3, 4), (1, 2, 3), ("valid", "same"), (None, 0, 1)):
        if output_padding is not None and output_padding >= stride:
            continue
        plan = plan_transposed_axis(extent, shards, kernel, stride, padding, output_padding)
        signal, weights = rng.standard_normal(extent), rng.standard_normal(kernel)
        whole = _transposed_1d(signal, weights, stride, plan.pad_before, plan.output_extent)
        pieces = []
        for j in range(shards):
            n0, n1 = plan.needed[j]
            extended = np.array([signal[i] if 0 <= i < extent else 0.0 for i in range(n0, n1)])
            raw = _transposed_1d(extended, weights, stride, 0, (n1 - n0 - 1) * stride + kernel + stride)
            start, count = plan.output_start(j), plan.local_output_extent(j)
            if start < 0:
                raw, start = np.concatenate([np.zeros(-start), raw]), 0
            pieces.append(raw[start:start + count])
        np.testing.assert_allclose(np.concatenate(pieces), whole, rtol=1e-12, atol=1e-12,
                                   err_msg=f"{kernel=} {stride=} {padding=} {output_padding=}")
        assert [b - a for a, b in plan.outputs] == [len(p) for p in np.array_split(whole, shards)]


@pytest.mark.parametrize("extent", [3, 5, 7, 8, 13])
@pytest.mark.parametrize("shards", [2, 3])
@pytest.mark.parametrize("size", [1, 2, 3])
def test_upsampling_plan_gives_each_shard_its_outputs(extent, shards, size):
    signal = np.arange(extent, dtype=float)
    plan = plan_upsampling_axis(extent, shards, size)
    pieces = []
    for j in range(shards):
        n0, n1 = plan.needed[j]
        assert 0 <= n0 < n1 <= extent
        repeated = np.repeat(signal[n0:n1], size)
        start = plan.outputs[j][0] - n0 * size
        pieces.append(repeated[start:start + plan.local_output_extent(j)])
    np.testing.assert_array_equal(np.concatenate(pieces), np.repeat(signal, size))
    assert (plan.needed == plan.owned) == (not plan.exchanges)
    if extent % shards == 0:
        assert plan.needed == plan.owned  # even shards repeat their own planes
