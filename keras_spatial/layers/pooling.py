"""Spatially split 3D max and average pooling."""

import keras
import numpy as np
from keras import ops

from keras_spatial.halo import Window
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
    result equals `keras.layers.MaxPooling3D` on the whole volume. Without an active
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
        extended = self._extend(inputs, strategy, plans, fill_value=float("-inf"))
        return ops.max_pool(extended, self.pool_size, self.strides, "valid", self.data_format)


@keras.saving.register_keras_serializable(package="keras_spatial")
class SpatialAveragePooling3D(_SpatialPoolingMixin, keras.layers.AveragePooling3D):
    """3D average pooling over a volume split across the ranks of a spatial group.

    Takes exactly the arguments of `keras.layers.AveragePooling3D`. As in Keras,
    padding at the global border is left out of the mean ('same'): each output at the
    border is rescaled by window volume / number of taps inside the volume, a constant
    that depends only on the geometry. Without an active spatial strategy it is
    `keras.layers.AveragePooling3D`.

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
        extended = self._extend(inputs, strategy, plans, fill_value=0.0)
        pooled = ops.average_pool(extended, self.pool_size, self.strides, "valid", self.data_format)
        scale = _border_scale(plans, strategy.coords, self.pool_size)
        if scale is None:
            return pooled
        return pooled * ops.convert_to_tensor(scale, dtype=pooled.dtype)


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
