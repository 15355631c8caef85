"""Global 3D pooling over a volume split across the ranks of a spatial group."""

import math

import keras
from keras import ops

from keras_spatial.layers.global_extents import GlobalExtentsMixin
from keras_spatial.layers.spatial_window import active_spatial_strategy, check_channels_last
from keras_spatial.ops.global_reductions import global_max, global_mean


def _keep_or_drop_dims(pooled, keepdims):
    """`pooled` is (batch, 1, 1, 1, channels)."""
    return pooled if keepdims else ops.reshape(pooled, (-1, pooled.shape[-1]))


@keras.saving.register_keras_serializable(package="keras_spatial")
class SpatialGlobalAveragePooling3D(GlobalExtentsMixin, keras.layers.GlobalAveragePooling3D):
    """Global average pooling of a volume split across the ranks of a spatial group.

    Takes exactly the arguments of `keras.layers.GlobalAveragePooling3D`. Each rank
    averages its shard, then the shard means are averaged over the spatial group
    (shards are equal, so this is the mean of the whole volume). The backward pass is
    the adjoint of that average: every voxel receives the average over the group of
    the ranks' upstream gradients, divided by its shard's voxel count. Without an
    active spatial strategy it is `keras.layers.GlobalAveragePooling3D`.

    Args:
        data_format: only `"channels_last"` is supported. Defaults to the Keras
            `image_data_format` (normally `"channels_last"`).
        keepdims: whether to keep the spatial axes with extent 1. Defaults to False.

    Input shape:
        LOCAL shard `(batch, d, h, w, channels)`.

    Output shape:
        `(batch, channels)`, or `(batch, 1, 1, 1, channels)` with `keepdims=True`:
        the pooling of the GLOBAL volume, REPLICATED on every rank of the spatial
        group.

    Raises:
        SpatialNotSupportedError: for data_format='channels_first'.

    Example:
    ```python
    with strategy.scope():
        x = keras_spatial.Input((64, 64, 64, 4))
        y = keras_spatial.layers.SpatialConv3D(8, 3, padding="same")(x)
        y = SpatialGlobalAveragePooling3D()(y)   # (None, 8) on every rank
        y = keras.layers.Dense(1)(y)
    ```
    """

    def __init__(self, data_format=None, keepdims=False, **kwargs):
        super().__init__(data_format=data_format, keepdims=keepdims, **kwargs)
        check_channels_last(self)

    def call(self, inputs):
        strategy = active_spatial_strategy()
        if strategy is None:
            return super().call(inputs)
        local = tuple(inputs.shape[1:4])
        extents = self.global_input_extents(local, strategy.spatial_shape)
        fraction = None
        if not strategy.mesh.splits_evenly(extents):
            fraction = math.prod(local) / math.prod(extents)
        pooled = global_mean(inputs, strategy.spatial_process_set, fraction)
        return _keep_or_drop_dims(pooled, self.keepdims)

    def global_output_extents(self, extents):
        return None  # the pooled volume is replicated


@keras.saving.register_keras_serializable(package="keras_spatial")
class SpatialGlobalMaxPooling3D(GlobalExtentsMixin, keras.layers.GlobalMaxPooling3D):
    """Global max pooling of a volume split across the ranks of a spatial group.

    Takes exactly the arguments of `keras.layers.GlobalMaxPooling3D`. Each rank takes
    the maximum of its shard; the per-rank maxima (one value per sample and channel)
    are gathered over the spatial group and reduced. The gradient follows TensorFlow's
    `reduce_max` on the whole volume exactly, ties included: the sum over the spatial
    group of the ranks' upstream gradients is shared equally by every voxel of the
    GLOBAL volume that attains the maximum. Without an active spatial strategy it is
    `keras.layers.GlobalMaxPooling3D`.

    Args:
        data_format: only `"channels_last"` is supported. Defaults to the Keras
            `image_data_format` (normally `"channels_last"`).
        keepdims: whether to keep the spatial axes with extent 1. Defaults to False.

    Input shape:
        LOCAL shard `(batch, d, h, w, channels)`.

    Output shape:
        `(batch, channels)`, or `(batch, 1, 1, 1, channels)` with `keepdims=True`:
        the pooling of the GLOBAL volume, REPLICATED on every rank of the spatial
        group.

    Raises:
        SpatialNotSupportedError: for data_format='channels_first'.

    Example:
    ```python
    with strategy.scope():
        x = keras_spatial.Input((64, 64, 64, 4))
        y = SpatialGlobalMaxPooling3D()(x)   # (None, 4) on every rank
    ```
    """

    def __init__(self, data_format=None, keepdims=False, **kwargs):
        super().__init__(data_format=data_format, keepdims=keepdims, **kwargs)
        check_channels_last(self)

    def call(self, inputs):
        strategy = active_spatial_strategy()
        if strategy is None:
            return super().call(inputs)
        pooled = global_max(inputs, strategy.spatial_process_set)
        return _keep_or_drop_dims(pooled, self.keepdims)

    def global_output_extents(self, extents):
        return None  # the pooled volume is replicated
