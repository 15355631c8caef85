"""Convolutions of a shard and the halo planes received from its neighbours.

`convolve_with_boundary_planes` (what `SpatialConv3D` runs for 'same', stride 1, halos
along one axis) convolves the shard where it lies and adds the neighbours' taps in place
to its boundary output planes: no extended copy at all. `convolve_halo_parts` (what it
runs otherwise, without dilation and groups) convolves the extended shard without keeping
it.

`convolve_halo_parts`:

TensorFlow's gradient of a convolution needs the convolution's input, so a plain
`conv(extend_to_halo(x))` keeps the extended shard (a copy of `x` with the halo planes and
the zero padding around it) alive from the forward pass until the convolution's
backward pass. When `x` is itself kept (a model input, a tensor that a ReLU or a max pool
needs for its own gradient, a U-Net skip connection), that copy is extra memory of the
size of the shard at the moment of the peak. Here the gradient keeps `x` and the
received planes instead, and assembles the extended shard again (slices, one
concatenation, one padding: no communication) just before the convolution's backward
pass. The forward and backward kernels are the ones TensorFlow's own gradient of
Conv3D runs, with the same attributes, so results are bit for bit the same.
"""

from __future__ import annotations

import math
from typing import Sequence

import tensorflow as tf

from keras_spatial.ops.halo_exchange import HaloParts


def _conv3d_gradients(inputs, weights, d_outputs, strides, padding):
    """(d_inputs, d_weights) of `tf.nn.conv3d(inputs, weights, strides, padding)`: the
    kernels TensorFlow's registered gradient of Conv3D runs, with the same attributes."""
    d_inputs = tf.raw_ops.Conv3DBackpropInputV2(
        input_sizes=tf.shape(inputs), filter=weights, out_backprop=d_outputs,
        strides=strides, padding=padding,
    )
    d_weights = tf.raw_ops.Conv3DBackpropFilterV2(
        input=inputs, filter_sizes=tf.shape(weights), out_backprop=d_outputs,
        strides=strides, padding=padding,
    )
    return d_inputs, d_weights


def convolve_halo_parts(halo: HaloParts, kernel, strides: Sequence[int]) -> tf.Tensor:
    """A 'valid' Conv3D of `halo.extended()` (channels last, no dilation, one group),
    whose gradient recomputes the extended shard instead of keeping it.

    Args:
        halo: the exchanged halos of a shard (`keras_spatial.ops.halo_exchange.exchange_halos`).
        kernel: the convolution kernel (d, h, w, in_channels, out_channels).
        strides: the 3 spatial strides.

    Returns:
        The convolution of the extended shard, as `tf.nn.conv3d(..., padding="VALID")`.
    """
    strides = [1, *strides, 1]
    kernel = tf.convert_to_tensor(kernel)

    @tf.custom_gradient
    def convolve(*tensors):
        *parts, weights = tensors
        outputs = tf.nn.conv3d(halo.assemble(*parts), weights, strides, "VALID")

        def gradient(d_outputs):
            # Recomputed in the backward pass: the copies depend on the output gradient,
            # so that Grappler cannot merge this assembly with the forward one (which
            # would keep the forward's extended shard alive after all).
            with tf.control_dependencies([d_outputs]):
                copies = [tf.identity(part) for part in parts]
            with tf.GradientTape() as tape:
                tape.watch(copies)
                extended = halo.assemble(*copies)
            d_extended, d_weights = _conv3d_gradients(extended, weights, d_outputs, strides, "VALID")
            d_parts = tape.gradient(extended, copies, output_gradients=d_extended)
            return (*d_parts, d_weights)

        return outputs, gradient

    return convolve(*halo.tensors, kernel)


def _rows(x: tf.Tensor, axis: int) -> tf.Tensor:
    """`x` as a matrix whose rows are indexed by (batch, ..., axis): a free reshape."""
    return tf.reshape(x, [-1, math.prod(x.shape[axis + 1:])])


def _row_ids(x: tf.Tensor, axis: int, start: int, count: int) -> tf.Tensor:
    """The rows of `_rows(x, axis)` that hold planes [start, start + count) along `axis`."""
    leading = tf.shape(x)[0] * math.prod(x.shape[1:axis])
    planes = tf.range(start, start + count)
    return tf.reshape(tf.range(leading)[:, None] * x.shape[axis] + planes[None, :], [-1])


def _kernel_taps(kernel: tf.Tensor, spatial_axis: int, start: int, stop: int) -> tf.Tensor:
    index = [slice(None)] * 5
    index[spatial_axis] = slice(start, stop)
    return kernel[tuple(index)]


def same_padding(kernel_size: int) -> tuple[int, int]:
    """(before, after) zero planes of TensorFlow's 'same' padding for stride 1."""
    return (kernel_size - 1) // 2, kernel_size - 1 - (kernel_size - 1) // 2


def convolve_with_boundary_planes(x, before, after, kernel, spatial_axis: int) -> tf.Tensor:
    """Stride-1 'same' Conv3D of a shard whose neighbours' planes along one axis are
    given, without building the extended shard.

    The result is the 'valid' convolution of `concat([before, x, after])` along
    `spatial_axis`, zero padded as 'same' along the two other axes: the shard's part of
    a 'same' convolution of the whole volume split along that axis. It is computed as:

    1. the 'same' convolution of `x` alone, with nothing copied: only the outputs
       within reach of the shard's two faces are missing the taps that read the
       neighbours' planes (read as zeros there);
    2. those taps, a convolution of the few received planes with the matching slice
       of the kernel, added in place to the boundary output planes (`InplaceAdd` on
       the freshly computed output).

    Step 1 needs no received plane, so it could run while the exchange is in flight
    (whether it does is up to the executor; docs/benchmarks.md).
    The gradient is the same decomposition transposed: TensorFlow's own gradient
    kernels on `x` and on the received planes, nothing copied at the size of the
    shard. A boundary output is one sum split into two partial sums, so it may differ
    from the whole-volume convolution by float32 rounding; every other output is
    computed exactly as TensorFlow computes it on the shard.

    Args:
        x: the shard, channels last (batch, d, h, w, in_channels), static d, h, w.
        before, after: the planes of the neighbours before / after the shard along
            `spatial_axis` (`same_padding` of the kernel's size along that axis:
            that many planes), or None where the shard touches the volume's face
            (zeros there: nothing to add) or where that padding is 0.
        kernel: (kd, kh, kw, in_channels, out_channels).
        spatial_axis: 0, 1 or 2 (depth, height, width).

    Returns:
        (batch, d, h, w, out_channels), like `tf.nn.conv3d(x, kernel, 1, 'SAME')` with
        the neighbours' planes taken into account.
    """
    axis = spatial_axis + 1
    size = kernel.shape[spatial_axis]
    p_before, p_after = same_padding(size)
    extent = x.shape[axis]
    if max(p_before, p_after) > extent:
        raise ValueError(
            f"convolve_with_boundary_planes needs halos no wider than the shard. "
            f"Received: kernel size {size}, shard extent {extent} along spatial axis "
            f"{spatial_axis}"
        )
    for name, planes, expected in (("before", before, p_before), ("after", after, p_after)):
        if planes is not None and (expected == 0 or planes.shape[axis] != expected):
            raise ValueError(
                f"`{name}` must hold {expected} planes along spatial axis {spatial_axis} "
                f"for a kernel of size {size}. Received: shape {tuple(planes.shape)}"
            )
    # The other axes are zero padded as 'same' would; along `spatial_axis` the received
    # planes are followed (before) or preceded (after) by the zeros that stand for the
    # shard's own planes, so that a 'valid' convolution with the taps that reach outside
    # gives one correction per boundary output plane.
    paddings = [[0, 0]] + [list(same_padding(k)) for k in kernel.shape[:3]] + [[0, 0]]
    sides = []
    if before is not None:
        pads = [list(p) for p in paddings]
        pads[axis] = [0, p_before - 1]
        sides.append((before, pads, (0, p_before), 0))
    if after is not None:
        pads = [list(p) for p in paddings]
        pads[axis] = [p_after - 1, 0]
        sides.append((after, pads, (size - p_after, size), extent - p_after))
    strides = [1] * 5

    @tf.custom_gradient
    def convolve(x, weights, *planes):
        outputs = tf.nn.conv3d(x, weights, strides, "SAME")
        shape = tf.shape(outputs)
        slabs = [tf.pad(received, side[1]) for received, side in zip(planes, sides)]
        taps_kernels = [_kernel_taps(weights, spatial_axis, *side[2]) for side in sides]
        corrections = [
            tf.nn.conv3d(slab, taps_kernel, strides, "VALID")
            for slab, taps_kernel in zip(slabs, taps_kernels)
        ]
        rows = _rows(outputs, axis)
        if corrections:
            # InplaceAdd writes into its input's buffer. Snapshot hands that buffer on
            # when it is the only reader, and copies it otherwise: TensorFlow merges
            # identical ops, so two calls with the same shard and kernel tensors share
            # one 'same' convolution. Depending on all of this call's corrections keeps
            # the Snapshots of such calls apart (and no call's adds can then be merged
            # with another's while the rest of the adds are not).
            with tf.control_dependencies(corrections):
                rows = tf.raw_ops.Snapshot(input=rows)
        for correction, side in zip(corrections, sides):
            rows = tf.raw_ops.InplaceAdd(
                x=rows, i=_row_ids(outputs, axis, side[3], correction.shape[axis]),
                v=tf.reshape(correction, [-1, rows.shape[1]]),
            )
        outputs = tf.reshape(rows, shape)

        def gradient(d_outputs):
            d_x, d_weights = _conv3d_gradients(x, weights, d_outputs, strides, "SAME")
            d_rows = _rows(d_outputs, axis)
            d_planes = []
            for slab, taps_kernel, correction, (received, pads, taps, first) in zip(
                slabs, taps_kernels, corrections, sides
            ):
                d_correction = tf.reshape(
                    tf.gather(d_rows, _row_ids(d_outputs, axis, first, correction.shape[axis])),
                    tf.shape(correction),
                )
                d_slab, d_taps = _conv3d_gradients(slab, taps_kernel, d_correction, strides, "VALID")
                taps_padding = [[0, 0]] * 5
                taps_padding[spatial_axis] = [taps[0], size - taps[1]]
                d_weights += tf.pad(d_taps, taps_padding)
                d_planes.append(tf.slice(
                    d_slab, [p[0] for p in pads], tf.shape(received)
                ))
            return (d_x, d_weights, *d_planes)

        return outputs, gradient

    return convolve(x, tf.convert_to_tensor(kernel), *[side[0] for side in sides])


def boundary_plane_axis(plans, kernel_size, strides, dilation_rate, padding, groups):
    """The one exchanging axis if `convolve_with_boundary_planes` gives a Conv3D's
    output on every rank, else None (convolve the extended shard instead). Every rank
    of the group decides alike (the answer depends on the plans only).

    `plans` are the layer's `keras_spatial.halo.AxisPlan`s; the other arguments are
    the Conv3D's attributes.

    It does for 'same' padding, stride 1, no dilation, one group, halos exchanged along
    one axis only, and along that axis at least one plane on each side (so every shard
    receives something) and no more than the smallest shard holds. Every shard's needed interval
    must then be its own one widened by TensorFlow's 'same' padding, on every axis.
    """
    if (
        padding != "same"
        or groups != 1
        or any(rate != 1 for rate in dilation_rate)
        or any(stride != 1 for stride in strides)
    ):
        return None
    exchanging = [axis for axis, plan in enumerate(plans) if plan.exchanges]
    if len(exchanging) != 1:
        return None
    axis = exchanging[0]
    halo = same_padding(kernel_size[axis])
    smallest = min(plans[axis].local_input_extent(shard) for shard in range(plans[axis].shards))
    if min(halo) < 1 or max(halo) > smallest:
        return None
    for plan, size in zip(plans, kernel_size):
        if any(plan.halo(shard) != same_padding(size) for shard in range(plan.shards)):
            return None
    return axis


def transposed_convolution_shard(extended, kernel, plans, coords: Sequence[int]) -> tf.Tensor:
    """A shard's outputs of a transposed convolution of the whole volume, from its
    extended inputs: the 'valid' transposed convolution of `extended`, cropped (and, where
    the shard's first outputs lie in a gap no input reaches, zero-padded) along every
    axis to the shard's outputs. No bias, no activation.

    Args:
        extended: the shard extended to every axis's `needed` inputs (channels last).
        kernel: the `Conv3DTranspose` kernel (kd, kh, kw, filters, in_channels).
        plans: one `keras_spatial.halo.TransposedAxisPlan` per spatial axis.
        coords: this rank's mesh coordinates.

    Returns:
        (batch, local outputs along D, H, W, filters).
    """
    kernel = tf.convert_to_tensor(kernel)
    strides = [plan.window.stride for plan in plans]
    lengths = [
        extent * plan.window.stride + max(plan.window.kernel - plan.window.stride, 0)
        for extent, plan in zip(extended.shape[1:4], plans)
    ]
    output_shape = tf.stack([tf.shape(extended)[0], *lengths, kernel.shape[-2]])
    outputs = tf.nn.conv3d_transpose(extended, kernel, output_shape, [1, *strides, 1], "VALID")
    outputs = tf.ensure_shape(outputs, [None, *lengths, kernel.shape[-2]])
    for spatial_axis, (plan, shard) in enumerate(zip(plans, coords)):
        axis = spatial_axis + 1
        start, count = plan.output_start(shard), plan.local_output_extent(shard)
        if start < 0:
            pad = [[0, 0]] * 5
            pad[axis] = [-start, 0]
            outputs, start = tf.pad(outputs, pad), 0
        if start + count > outputs.shape[axis]:
            raise ValueError(
                f"The transposed convolution of the extended shard has {outputs.shape[axis]} "
                f"planes along axis {spatial_axis}; the shard's outputs need "
                f"[{start}, {start + count})."
            )
        if start or count != outputs.shape[axis]:
            outputs = outputs[(slice(None),) * axis + (slice(start, start + count),)]
    return outputs
