"""`SpatialGather`: stop splitting — the whole volume on every rank of the group."""

import keras

from keras_spatial.layers.global_extents import GlobalExtentsMixin
from keras_spatial.layers.spatial_window import active_spatial_strategy


@keras.saving.register_keras_serializable(package="keras_spatial")
class SpatialGather(GlobalExtentsMixin, keras.layers.Identity):
    """Gather a sharded volume onto every rank of its spatial group.

    After this layer the volume is REPLICATED: every rank of the spatial group holds the
    whole tensor, and the following layers must be plain Keras layers
    (`keras.layers.Conv3D`, `AveragePooling3D`, `Flatten`, ...), which then compute the
    same thing on every rank. Use it to stop splitting where volumes become too small
    to divide over the shards (LBANN stops CosmoFlow's spatial split before the last
    pools), or before a head that needs the whole volume. The gradient follows the rule
    of docs/design.md ("Gradient rule"): summed over the spatial group, each rank keeps
    its own slice. Without an active spatial strategy it is `keras.layers.Identity`.

    Input shape:
        LOCAL shard `(batch, d, h, w, channels)`.

    Output shape:
        GLOBAL volume `(batch, D, H, W, channels)`, replicated.

    Example:
    ```python
    with strategy.scope():
        x = keras_spatial.Input((128, 128, 128, 4))
        y = keras_spatial.layers.SpatialConv3D(16, 3, padding="same")(x)
        y = keras_spatial.layers.SpatialAveragePooling3D(3, strides=2, padding="same")(y)
        y = keras_spatial.layers.SpatialGather()(y)             # 64^3 on every rank
        y = keras.layers.Conv3D(32, 3, padding="same")(y)      # plain Keras from here
    ```
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_jit = False

    def call(self, inputs):
        strategy = active_spatial_strategy()
        if strategy is None:
            return super().call(inputs)
        return strategy.gather(inputs, self.global_input_extents(inputs.shape[1:4], strategy.spatial_shape))

    def compute_output_spec(self, inputs):
        return keras.KerasTensor(self.compute_output_shape(inputs.shape), dtype=inputs.dtype)

    def global_output_extents(self, extents):
        return None  # the gathered volume is replicated

    def compute_output_shape(self, input_shape):
        strategy = active_spatial_strategy()
        if strategy is None:
            return tuple(input_shape)
        if len(input_shape) != 5:
            raise ValueError(
                "SpatialGather takes a 5D (batch, depth, height, width, channels) shard. "
                f"Received: input_shape={tuple(input_shape)}, layer={self.name!r}"
            )
        extents = tuple(self.global_input_extents(input_shape[1:4], strategy.spatial_shape))
        return (input_shape[0],) + extents + (input_shape[4],)
