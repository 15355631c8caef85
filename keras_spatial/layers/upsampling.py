"""Spatially split 3D nearest-neighbour up-sampling."""

import keras

from keras_spatial.layers.spatial_window import check_channels_last


@keras.saving.register_keras_serializable(package="keras_spatial")
class SpatialUpSampling3D(keras.layers.UpSampling3D):
    """3D nearest-neighbour up-sampling of a volume split across a spatial group.

    Repeating every voxel `size` times along each axis is local: the up-sampled shard
    is exactly the shard of `keras.layers.UpSampling3D` applied to the whole volume,
    so each rank runs the Keras layer on its own shard and nothing is exchanged. The
    class exists so that a spatial model says what it means and refuses the layouts it
    cannot serve (channels_first).

    Args:
        size: int or 3 ints, the up-sampling factors along depth, height and width.
            Defaults to `(2, 2, 2)`.
        data_format: must be 'channels_last' (the default when Keras's
            `image_data_format` is unchanged).

    Input shape:
        LOCAL shard `(batch, d, h, w, channels)`.

    Output shape:
        LOCAL shard `(batch, d * size[0], h * size[1], w * size[2], channels)` of the
        global output.

    Raises:
        SpatialNotSupportedError: for data_format='channels_first'.

    Example:
    ```python
    with strategy.scope():
        x = keras_spatial.Input((32, 32, 32, 8))
        y = SpatialUpSampling3D(2)(x)  # global 64^3, local shard
    ```
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_channels_last(self)
