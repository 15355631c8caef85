"""Spatially split 3D max and average pooling."""

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from keras_spatial.halo import Window, local_window_boundary
from keras_spatial.ops.halo_exchange import _slice_axis, exchange_axis
from keras_spatial.layers.spatial_window import (
    SpatialWindowMixin,
    active_spatial_strategy,
    check_channels_last,
)


class _SpatialPoolingMixin(SpatialWindowMixin):
    def _windows(self):
        return tuple(Window(k, s, 1, self.padding) for k, s in zip(self.pool_size, self.strides))

    def compute_output_shape(self, input_shape):
        strategy = active_spatial_strategy()
        if strategy is None:
            return super().compute_output_shape(input_shape)
        return self._spatial_output_shape(strategy, input_shape, input_shape[-1])


@keras.saving.register_keras_serializable(package="keras_spatial")
class SpatialMaxPooling3D(_SpatialPoolingMixin, keras.layers.MaxPooling3D):
    """3D max pooling over a volume split across the ranks of a spatial group.

    Takes exactly the arguments of `keras.layers.MaxPooling3D`; halos are exchanged
    as in `SpatialConv3D`, and positions outside the global volume hold -inf, so the
    result equals `keras.layers.MaxPooling3D` on the whole volume. When the shards line
    up with the windows and only the depth axis exchanges, at most one plane per side,
    each rank pools its own shard and takes the maximum with the received planes'
    pooled values for the boundary outputs, without copying the shard. Without an active
    spatial strategy it is `keras.layers.MaxPooling3D`.

    Input shape:
        LOCAL shard `(batch, d, h, w, channels)`.

    Output shape:
        LOCAL shard of the global pooled volume.

    Raises:
        SpatialNotSupportedError: for data_format='channels_first'.
        ValueError: at build time, if a global output extent cannot be split evenly.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_channels_last(self)

    def call(self, inputs):
        strategy = active_spatial_strategy()
        if strategy is None:
            return super().call(inputs)
        plans = self._axis_plans(strategy, inputs.shape)
        pooled = _pool_shard_in_place(self, inputs, strategy, plans, "max")
        if pooled is not None:
            return pooled
        extended = self._extend(inputs, strategy, plans, fill_value=float("-inf"))
        return ops.max_pool(extended, self.pool_size, self.strides, "valid", self.data_format)


@keras.saving.register_keras_serializable(package="keras_spatial")
class SpatialAveragePooling3D(_SpatialPoolingMixin, keras.layers.AveragePooling3D):
    """3D average pooling over a volume split across the ranks of a spatial group.

    Takes exactly the arguments of `keras.layers.AveragePooling3D`. As in Keras,
    padding at the global border is left out of the mean ('same'). Where the shards line
    up with the windows and only one axis exchanges (as for CosmoFlow's 3^3/2 'same'
    pools on a 2x1x1 or 4x1x1 mesh), each rank pools its own shard and completes the
    output planes whose windows reach a neighbour from the received halo planes, without
    copying the shard; otherwise it pools the extended shard like `SpatialConv3D`
    convolves it, rescaling border outputs by window volume / taps inside the volume.
    Without an active spatial strategy it is `keras.layers.AveragePooling3D`.

    Input shape:
        LOCAL shard `(batch, d, h, w, channels)`.

    Output shape:
        LOCAL shard of the global pooled volume.

    Raises:
        SpatialNotSupportedError: for data_format='channels_first'.
        ValueError: at build time, if a global output extent cannot be split evenly.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_channels_last(self)

    def call(self, inputs):
        strategy = active_spatial_strategy()
        if strategy is None:
            return super().call(inputs)
        plans = self._axis_plans(strategy, inputs.shape)
        pooled = _pool_shard_in_place(self, inputs, strategy, plans, "average")
        if pooled is not None:
            return pooled
        extended = self._extend(inputs, strategy, plans, fill_value=0.0)
        pooled = ops.average_pool(extended, self.pool_size, self.strides, "valid", self.data_format)
        scale = _border_scale(plans, strategy.coords, self.pool_size)
        if scale is None:
            return pooled
        return pooled * ops.convert_to_tensor(scale, dtype=pooled.dtype)


def _boundary_layout(plans, coords, kind):
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


def _pool_shard_in_place(layer, inputs, strategy, plans, kind):
    """Pool the shard without building an extended copy of it, or None if that cannot
    give the exact result (see `_boundary_layout`).

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
    layout = _boundary_layout(plans, strategy.coords, kind)
    if layout is None:
        return None
    pool = ops.max_pool if kind == "max" else ops.average_pool
    spatial_axis, boundary = layout
    if spatial_axis is None:
        return pool(inputs, layer.pool_size, layer.strides, layer.padding, layer.data_format)
    axis = spatial_axis + 1
    # Pool over the other axes first, then along the exchanging one: the box is separable
    # (its 'same' tap count is the product of the axes' counts), and the planes that
    # neighbours need, and the gradient they send back, are then already reduced.
    across = [1 if other == spatial_axis else k for other, k in enumerate(layer.pool_size)]
    across_strides = [1 if other == spatial_axis else t for other, t in enumerate(layer.strides)]
    along = [layer.pool_size[other] if other == spatial_axis else 1 for other in range(3)]
    along_strides = [layer.strides[other] if other == spatial_axis else 1 for other in range(3)]
    reduced = inputs
    if any(k > 1 for k in across) or any(t > 1 for t in across_strides):
        reduced = pool(inputs, across, across_strides, layer.padding, layer.data_format)
    local = pool(reduced, along, along_strides, layer.padding, layer.data_format)
    before, after = exchange_axis(
        reduced, spatial_axis, plans[spatial_axis], strategy.mesh, strategy.coords,
        strategy.spatial_process_set, name="ks_halo", empty_from=local,
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
            pieces.append(_slice_axis(local, axis, done, output.index))
        value = _slice_axis(local, axis, output.index, output.index + 1)
        spans = [(side, _slice_axis(blocks[side], axis, start, stop), stop - start)
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
        pieces.append(_slice_axis(local, axis, done, local.shape[axis]))
    return tf.concat(pieces, axis=axis)


def _border_scale(plans, coords, pool_size):
    """Per local output: window volume / taps inside the volume; None if all full."""
    factors = []
    for plan, index, size in zip(plans, coords, pool_size):
        counts = np.asarray(plan.valid_counts(index), dtype=np.float64)
        factors.append(size / counts)
    if all(np.all(f == 1.0) for f in factors):
        return None
    scale = np.einsum("i,j,k->ijk", *factors)
    return scale[None, :, :, :, None].astype(np.float32)


SpatialMaxPool3D = SpatialMaxPooling3D
SpatialAvgPool3D = SpatialAveragePooling3D
