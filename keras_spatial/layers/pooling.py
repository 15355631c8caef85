"""Spatially split 3D max and average pooling."""

import keras
from keras import ops

from keras_spatial.halo import Window
from keras_spatial.ops.halo_pooling import border_scale, pool_shard_in_place
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
        ValueError: at build time, if a global input or output extent has fewer planes
            than shards.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_channels_last(self)

    def call(self, inputs):
        strategy = active_spatial_strategy()
        if strategy is None:
            return super().call(inputs)
        plans = self.axis_plans(strategy.spatial_shape, inputs.shape)
        pooled = pool_shard_in_place(
            inputs, self.pool_size, self.strides, self.padding, "max",
            plans, strategy.mesh, strategy.coords, strategy.spatial_process_set,
        )
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
        ValueError: at build time, if a global input or output extent has fewer planes
            than shards.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_channels_last(self)

    def call(self, inputs):
        strategy = active_spatial_strategy()
        if strategy is None:
            return super().call(inputs)
        plans = self.axis_plans(strategy.spatial_shape, inputs.shape)
        pooled = pool_shard_in_place(
            inputs, self.pool_size, self.strides, self.padding, "average",
            plans, strategy.mesh, strategy.coords, strategy.spatial_process_set,
        )
        if pooled is not None:
            return pooled
        extended = self._extend(inputs, strategy, plans, fill_value=0.0)
        pooled = ops.average_pool(extended, self.pool_size, self.strides, "valid", self.data_format)
        scale = border_scale(plans, strategy.coords, self.pool_size)
        if scale is None:
            return pooled
        return pooled * ops.convert_to_tensor(scale, dtype=pooled.dtype)


SpatialMaxPool3D = SpatialMaxPooling3D
SpatialAvgPool3D = SpatialAveragePooling3D
