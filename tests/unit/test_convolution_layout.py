"""Which spatial convolutions are computed on the shard as it is, with the neighbours'
taps added to the boundary planes (`convolve_with_boundary_planes`), and which on an
extended copy of the shard. Pure geometry: no ranks, no Horovod. The numbers themselves
are checked against plain Keras on 2, 4 and 8 ranks in test_distributed_layers.py."""

from keras_spatial.halo import Window, plan_axis
from keras_spatial.ops.halo_convolution import boundary_plane_axis


def _axis(global_extents, spatial_shape, kernel=3, strides=1, dilation=1, padding="same", groups=1):
    kernel, strides, dilation = ((v,) * 3 if isinstance(v, int) else v for v in (kernel, strides, dilation))
    plans = tuple(
        plan_axis(extent, shards, Window(k, s, d, padding))
        for extent, shards, k, s, d in zip(global_extents, spatial_shape, kernel, strides, dilation)
    )
    return boundary_plane_axis(plans, kernel, strides, dilation, padding, groups)


def test_same_stride_one_on_one_split_axis_uses_the_boundary_planes():
    assert _axis((128,) * 3, (2, 1, 1)) == 0  # CosmoFlow's blocks 1-3, 2x1x1
    assert _axis((64,) * 3, (1, 2, 1)) == 1
    assert _axis((64,) * 3, (1, 1, 4)) == 2
    assert _axis((64,) * 3, (4, 1, 1), kernel=(5, 3, 1)) == 0
    assert _axis((64,) * 3, (2, 1, 1), kernel=4) == 0  # even: one plane before, two after


def test_other_convolutions_extend_the_shard():
    assert _axis((64,) * 3, (2, 2, 1)) is None  # two exchanging axes (corners)
    assert _axis((64,) * 3, (1, 1, 1)) is None  # nothing exchanged
    assert _axis((64,) * 3, (2, 1, 1), padding="valid") is None
    assert _axis((64,) * 3, (2, 1, 1), strides=(1, 2, 1)) is None
    assert _axis((64,) * 3, (2, 1, 1), dilation=2) is None
    assert _axis((64,) * 3, (2, 1, 1), groups=2) is None
    assert _axis((64,) * 3, (2, 1, 1), kernel=2) is None  # the last shard receives nothing
    assert _axis((8, 8, 8), (4, 1, 1), kernel=7) is None  # halo wider than a shard
