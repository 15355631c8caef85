"""Which spatial pooling layouts pool each shard in place (no extended copy), and which
extend it first. Pure geometry: no ranks, no Horovod. The numbers themselves are checked
against plain Keras on 2, 4 and 8 ranks in test_distributed_layers.py."""

from keras_spatial.halo import Window, plan_axis
from keras_spatial.ops.halo_pooling import in_place_layout


def _plans(extent, spatial_shape, kernel, stride, padding):
    return tuple(plan_axis(extent, shards, Window(kernel, stride, 1, padding)) for shards in spatial_shape)


def test_cosmoflow_average_pool_on_depth_split_is_pooled_in_place():
    plans = _plans(128, (2, 1, 1), 3, 2, "same")
    axis, boundary = in_place_layout(plans, (0, 0, 0), "average")
    assert axis == 0 and [b.index for b in boundary] == [63 // 2]
    assert in_place_layout(plans, (1, 0, 0), "average") == (0, ())


def test_average_pool_on_height_split_is_pooled_in_place():
    axis, boundary = in_place_layout(_plans(64, (1, 4, 1), 3, 2, "same"), (0, 2, 0), "average")
    assert axis == 1 and len(boundary) == 1


def test_pool_without_exchange_needs_no_halo():
    assert in_place_layout(_plans(64, (2, 2, 1), 2, 2, "valid"), (1, 1, 0), "max") == (None, ())
    # Unsplit axes with 'same' padding need no padded copy either.
    assert in_place_layout(_plans(64, (1, 1, 1), 3, 2, "same"), (0, 0, 0), "average") == (None, ())


def test_max_pool_ties_keep_the_extended_path_off_depth():
    plans = _plans(64, (1, 2, 1), 3, 2, "same")
    assert in_place_layout(plans, (0, 0, 0), "average") is not None
    assert in_place_layout(plans, (0, 0, 0), "max") is None
    assert in_place_layout(_plans(64, (2, 1, 1), 3, 2, "same"), (0, 0, 0), "max") is not None


def test_two_exchanging_axes_are_extended():
    assert in_place_layout(_plans(64, (2, 2, 1), 3, 2, "same"), (0, 0, 0), "average") is None


def test_misaligned_shards_are_extended():
    # 'valid', window 3, stride 1: the second shard's first output starts one plane before it.
    assert in_place_layout(_plans(32, (2, 1, 1), 3, 1, "valid"), (1, 0, 0), "average") is None
