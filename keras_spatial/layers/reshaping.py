"""Flatten a volume split across the ranks of a spatial group, for a replicated head."""

import math

import keras

from keras_spatial.errors import SpatialNotSupportedError
from keras_spatial.layers.global_extents import GlobalExtentsMixin
from keras_spatial.layers.spatial_window import active_spatial_strategy, check_channels_last


@keras.saving.register_keras_serializable(package="keras_spatial")
class SpatialFlatten(GlobalExtentsMixin, keras.layers.Flatten):
    """Gathers the whole volume over the spatial group, then flattens it.

    Takes exactly the arguments of `keras.layers.Flatten`. The features come in the
    order `keras.layers.Flatten` gives on the whole volume (depth, height, width,
    channels), so a dense head after it has the same weights as in a single-device
    model. The gather's backward pass sums the upstream gradients over the spatial
    group and keeps each rank's slice (docs/design.md, "Gradient rule"). Without an
    active spatial strategy it is `keras.layers.Flatten`.

    Every rank of the spatial group receives the whole volume: use it after the
    volume has been reduced to a small extent.

    Args:
        data_format: only `"channels_last"` is supported. Defaults to the Keras
            `image_data_format` (normally `"channels_last"`).

    Input shape:
        LOCAL shard `(batch, d, h, w, channels)`.

    Output shape:
        `(batch, D * H * W * channels)` of the GLOBAL volume, REPLICATED on every
        rank of the spatial group.

    Raises:
        SpatialNotSupportedError: for data_format='channels_first', or, under a
            spatial strategy, for inputs that are not 5D shards.

    Example:
    ```python
    with strategy.scope():                       # spatial_shape=(2, 1, 1)
        x = keras_spatial.Input((8, 8, 8, 4))    # each rank holds (4, 8, 8, 4)
        y = SpatialFlatten()(x)                  # (None, 2048) on every rank
        y = keras.layers.Dense(10)(y)
    ```
    """

    def __init__(self, data_format=None, **kwargs):
        super().__init__(data_format=data_format, **kwargs)
        check_channels_last(self)

    def _check_shard(self, input_shape):
        if len(input_shape) != 5 or any(d is None for d in input_shape[1:]):
            raise SpatialNotSupportedError(
                f"{type(self).__name__} under a spatial strategy flattens a sharded volume "
                "and needs a 5D input (batch, depth, height, width, channels) with known "
                f"extents. Received: input_shape={tuple(input_shape)}, layer={self.name!r}"
            )

    def call(self, inputs):
        strategy = active_spatial_strategy()
        if strategy is None:
            return super().call(inputs)
        self._check_shard(inputs.shape)
        extents = self.global_input_extents(inputs.shape[1:4], strategy.spatial_shape)
        return super().call(strategy.gather(inputs, extents))

    def compute_output_shape(self, input_shape):
        strategy = active_spatial_strategy()
        if strategy is None:
            return super().compute_output_shape(input_shape)
        self._check_shard(input_shape)
        global_extents = self.global_input_extents(input_shape[1:4], strategy.spatial_shape)
        return (input_shape[0], math.prod(global_extents) * input_shape[4])

    def global_output_extents(self, extents):
        return None  # the flattened volume is replicated
