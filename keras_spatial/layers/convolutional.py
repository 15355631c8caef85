"""Spatially split 3D convolution."""

import keras
import tensorflow as tf
from keras import ops

from keras_spatial.halo import Window
from keras_spatial.ops.halo_convolution import (
    boundary_plane_axis,
    convolve_halo_parts,
    convolve_with_boundary_planes,
)
from keras_spatial.ops.halo_exchange import exchange_axis, flat_exchange
from keras_spatial.layers.spatial_window import (
    SpatialWindowMixin,
    active_spatial_strategy,
    check_channels_last,
)


@keras.saving.register_keras_serializable(package="keras_spatial")
class SpatialConv3D(SpatialWindowMixin, keras.layers.Conv3D):
    """3D convolution over a volume split across the ranks of a spatial group.

    Takes exactly the arguments of `keras.layers.Conv3D`. Each rank holds one shard
    of the volume; before convolving, it receives from its neighbours the halo planes
    its outputs need (and crops what they do not need), then runs a 'valid'
    convolution locally, so that the shards of the output are exactly the output of
    `keras.layers.Conv3D` on the whole volume. Without an active spatial strategy
    (one process, or `spatial_shape=(1, 1, 1)`) it is `keras.layers.Conv3D`.

    Supported: any kernel size (even ones too), strides, dilation (Keras forbids
    strides > 1 together with dilation > 1), 'same' and 'valid', groups, bias and
    activation; channels_last only.

    How the shard is convolved (`keras_spatial.ops.halo_convolution`):
    - 'same' padding, stride 1, no dilation, one group, and halos exchanged along one
      axis only (e.g. a 2x1x1 or 1x4x1 split): the shard is convolved as it is, and
      the taps that read its neighbours' planes are added in place to the boundary
      output planes afterwards. No extended copy of the shard is made, forward or
      backward. (The exchange does not overlap that convolution yet: TensorFlow's
      executor runs the convolution before the send; docs/benchmarks.md.)
      The boundary outputs may differ from
      `keras.layers.Conv3D` on the whole volume by float32 rounding (their sum is
      split in two); all other outputs are computed as TensorFlow computes them.
    - otherwise the shard is extended by its halo planes and zero padding and
      convolved 'valid'; without dilation and groups, the extended shard is not kept
      for the backward pass, but assembled again from the shard and the received
      planes. Results are then bit for bit those of a 'valid' Conv3D of the
      extended shard.

    Input shape:
        LOCAL shard `(batch, d, h, w, channels)` of the global input
        (`keras_spatial.halo.split_bounds`: extents that do not divide by the shards
        leave the first shards one plane more).

    Output shape:
        LOCAL shard `(batch, d_out, h_out, w_out, filters)` of the global output.

    Raises:
        SpatialNotSupportedError: for data_format='channels_first'.
        ValueError: at build time, if an axis's global input or output extent has fewer
            planes than shards (the message names layer, axis, extents and mesh).

    Example:
    ```python
    with strategy.scope():
        x = keras_spatial.Input((64, 64, 64, 4))
        y = SpatialConv3D(16, 3, padding="same", activation="relu")(x)
    ```
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_channels_last(self)

    def _windows(self):
        return tuple(
            Window(k, s, d, self.padding)
            for k, s, d in zip(self.kernel_size, self.strides, self.dilation_rate)
        )

    def convolution_op(self, inputs, kernel):
        strategy = active_spatial_strategy()
        if strategy is None:
            return super().convolution_op(inputs, kernel)
        plans = self.axis_plans(strategy.spatial_shape, inputs.shape)
        axis = boundary_plane_axis(
            plans, self.kernel_size, self.strides, self.dilation_rate, self.padding,
            self.groups,
        )
        if axis is not None:
            before, after = exchange_axis(
                inputs, axis, plans[axis], strategy.mesh, strategy.coords,
                strategy.spatial_process_set, name="ks_halo", flatten=flat_exchange(plans),
            )
            return convolve_with_boundary_planes(
                inputs,
                tf.concat(before, axis + 1) if before else None,
                tf.concat(after, axis + 1) if after else None,
                kernel,
                axis,
            )
        halo = self._exchange(inputs, strategy, plans, fill_value=0.0)
        if self.groups == 1 and all(rate == 1 for rate in self.dilation_rate):
            return convolve_halo_parts(halo, kernel, self.strides)
        # Dilated and grouped convolutions: TensorFlow runs them as other ops
        # (space-to-batch, XLA), whose gradients convolve_halo_parts does not reproduce.
        return ops.conv(
            halo.extended(),
            kernel,
            strides=list(self.strides),
            padding="valid",
            dilation_rate=self.dilation_rate,
            data_format=self.data_format,
        )

    def compute_output_shape(self, input_shape):
        strategy = active_spatial_strategy()
        if strategy is None:
            return super().compute_output_shape(input_shape)
        return self._spatial_output_shape(strategy, input_shape, self.filters)

