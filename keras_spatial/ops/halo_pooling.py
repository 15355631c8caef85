"""Pooling of a shard whose windows reach its neighbours' planes.

`SpatialMaxPooling3D` and `SpatialAveragePooling3D` either pool the extended shard (like
a convolution, `keras_spatial.ops.halo_exchange`) or, where the shards line up with the
windows and one axis exchanges, pool the shard where it lies and complete its boundary
output planes from the neighbours' planes (`pool_shard_in_place`). `border_scale`
rescales averages of the extended shard at the global border, where 'same' padding is
left out of the mean.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from keras import ops

from keras_spatial.halo import local_window_boundary
from keras_spatial.ops.halo_exchange import exchange_axis, flat_exchange, slice_axis


def in_place_layout(plans, coords, kind):
    """How to pool a shard where it lies: (exchanging axis or None, this shard's boundary
    outputs along it), or None when the shard must be extended first.

    Pooling the shard's own planes with the layer's padding gives every output exactly
    when, on every axis and every shard (so that all ranks decide alike), the local op's
    outputs line up with the shard's (`local_window_boundary`), and at most one axis has
    outputs that read a neighbour's planes. Max pooling also needs that axis to be the
    depth, and at most one such plane per side, so that ties go where MaxPool3D's
    gradient sends them (to the first tap in depth, height, width order): received
    planes before the shard then come first, those after it last, and a maximum over
    several received planes would share a tie's gradient among them.
    """
    exchanging = [axis for axis, plan in enumerate(plans) if plan.exchanges]
    if len(exchanging) > 1 or (kind == "max" and exchanging and exchanging[0] != 0):
        return None
    mine = ()
    for axis, plan in enumerate(plans):
        per_shard = [local_window_boundary(plan, shard) for shard in range(plan.shards)]
        if any(boundary is None for boundary in per_shard):
            return None
        if axis not in exchanging and any(per_shard):
            return None
        if kind == "max" and any(
            span is not None and span[1] - span[0] > 1
            for boundary in per_shard
            for output in boundary
            for span in (output.before, output.after)
        ):
            return None
        if axis in exchanging:
            mine = per_shard[coords[axis]]
    return (exchanging[0] if exchanging else None), mine


def pool_shard_in_place(inputs, pool_size, strides, padding, kind, plans, mesh, coords, process_set):
    """Pool the shard without building an extended copy of it, or None if that cannot
    give the exact result (see `in_place_layout`).

    Args:
        inputs: the local shard, channels last.
        pool_size, strides, padding: the 3D pooling's attributes.
        kind: 'max' or 'average'.
        plans: the layer's `keras_spatial.halo.AxisPlan`s.
        mesh, coords, process_set: the strategy's mesh, this rank's shard coordinates
            and its spatial group's Horovod process set.

    The shard's own planes are pooled with the layer's padding ('same' leaves padding
    out of averages and maxima, as for the whole volume), over the other axes first and
    then along the exchanging one; the few output planes whose windows reach a
    neighbour's planes are then completed from the neighbours' planes pooled over the
    other axes: averages as the tap-weighted mean of the local result and the received
    planes, maxima as the larger of the two. Only output-sized planes are concatenated,
    where extending the input copies all of it (twice with the padding of the other
    axes) and its gradient again; a rank that sends planes gets their gradient back at
    the size of the reduced planes.
    """
    layout = in_place_layout(plans, coords, kind)
    if layout is None:
        return None
    pool = ops.max_pool if kind == "max" else ops.average_pool
    spatial_axis, boundary = layout
    if spatial_axis is None:
        return pool(inputs, pool_size, strides, padding, "channels_last")
    axis = spatial_axis + 1
    # Pool over the other axes first, then along the exchanging one: the box is separable
    # (its 'same' tap count is the product of the axes' counts), and the planes that
    # neighbours need, and the gradient they send back, are then already reduced.
    across = [1 if other == spatial_axis else k for other, k in enumerate(pool_size)]
    across_strides = [1 if other == spatial_axis else t for other, t in enumerate(strides)]
    along = [pool_size[other] if other == spatial_axis else 1 for other in range(3)]
    along_strides = [strides[other] if other == spatial_axis else 1 for other in range(3)]
    reduced = inputs
    if any(k > 1 for k in across) or any(t > 1 for t in across_strides):
        reduced = pool(inputs, across, across_strides, padding, "channels_last")
    local = pool(reduced, along, along_strides, padding, "channels_last")
    before, after = exchange_axis(
        reduced, spatial_axis, plans[spatial_axis], mesh, coords, process_set,
        name="ks_halo", empty_from=local, flatten=flat_exchange(plans),
    )
    if not boundary:
        # Nothing arrives here (`after` holds the alltoall's empty result): keep that
        # result as data (it has the output's extent along the other axes).
        return tf.concat([local, after[0]], axis=axis)
    blocks = {
        "before": tf.concat(before, axis=axis) if before else None,
        "after": tf.concat(after, axis=axis) if after else None,
    }
    pieces, done = [], 0
    for output in boundary:
        if output.index > done:
            pieces.append(slice_axis(local, axis, done, output.index))
        value = slice_axis(local, axis, output.index, output.index + 1)
        spans = [(side, slice_axis(blocks[side], axis, start, stop), stop - start)
                 for side, span in (("before", output.before), ("after", output.after)) if span
                 for start, stop in [span]]
        if kind == "max":
            for side, planes, _ in spans:
                received = tf.reduce_max(planes, axis=axis, keepdims=True)
                # Ties go to the earlier tap, as in MaxPool3D's gradient.
                value = tf.maximum(received, value) if side == "before" else tf.maximum(value, received)
        else:
            taps = output.local_taps + sum(count for _, _, count in spans)
            terms = [value * tf.constant(output.local_taps / taps, value.dtype)]
            for _, planes, _ in spans:
                terms.append(tf.reduce_sum(planes, axis=axis, keepdims=True) * tf.constant(1.0 / taps, value.dtype))
            value = tf.add_n(terms)
        pieces.append(value)
        done = output.index + 1
    if done < local.shape[axis]:
        pieces.append(slice_axis(local, axis, done, local.shape[axis]))
    return tf.concat(pieces, axis=axis)


def border_scale(plans, coords, pool_size):
    """Per local output: window volume / taps inside the volume; None if all full."""
    factors = []
    for plan, index, size in zip(plans, coords, pool_size):
        counts = np.asarray(plan.valid_counts(index), dtype=np.float64)
        factors.append(size / counts)
    if all(np.all(f == 1.0) for f in factors):
        return None
    scale = np.einsum("i,j,k->ijk", *factors)
    return scale[None, :, :, :, None].astype(np.float32)
