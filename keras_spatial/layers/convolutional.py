"""Spatially split 3D convolution."""

import keras
from keras import ops

from keras_spatial.halo import Window
from keras_spatial.ops.halo_convolution import convolve_halo_parts
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

    Memory: without dilation and groups, the extended shard (the shard with its halo
    planes and zero padding) is not kept for the backward pass; the gradient assembles
    it again from the shard and the received planes (`keras_spatial.ops.halo_convolution`).
    That saves a copy of the shard wherever the shard is kept anyway (the model's input,
    a ReLU's output, a max pool's input or output), for one extra copy per step.

    Input shape:
        LOCAL shard `(batch, d, h, w, channels)`, where (d, h, w) is the global extent
        divided by the strategy's `spatial_shape`.

    Output shape:
        LOCAL shard `(batch, d_out, h_out, w_out, filters)` of the global output.

    Raises:
        SpatialNotSupportedError: for data_format='channels_first'.
        ValueError: at build time, if an axis's global output extent cannot be split
            evenly over its shards (the message names layer, axis, extents and mesh).

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
        plans = self._axis_plans(strategy, inputs.shape)
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
