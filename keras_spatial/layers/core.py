"""`keras_spatial.Input`: models are written with GLOBAL shapes, run on LOCAL shards."""

import keras

from keras_spatial.context import get_strategy


@keras.saving.register_keras_serializable(package="keras_spatial")
class SpatialInputLayer(keras.layers.InputLayer):
    """An `InputLayer` whose config holds the GLOBAL shape of a sample.

    It declares the LOCAL (per-shard) shape of the active strategy to Keras, so the
    model accepts a shard, while `get_config` keeps the global shape: a saved model
    reloads in one process as an ordinary whole-volume model, or under another
    strategy as a model for that mesh.

    Args:
        shape: global shape without the batch, channels last: `(D, H, W, C)`.
        batch_size: optional fixed batch size.
        batch_shape: global shape with the batch (instead of `shape` and
            `batch_size`).
        Other arguments as `keras.layers.InputLayer`.

    Raises:
        ValueError: if the shape is not (D, H, W, C), or an extent is smaller than its
            number of shards.
    """

    def __init__(self, shape=None, batch_size=None, dtype=None, batch_shape=None, name=None, **kwargs):
        if kwargs.get("input_tensor") is not None:
            raise ValueError("SpatialInputLayer does not take `input_tensor`.")
        if shape is not None and batch_shape is not None:
            raise ValueError("You cannot pass both `shape` and `batch_shape` at the same time.")
        if shape is None and batch_shape is None:
            raise ValueError("You must pass a `shape` argument.")
        if batch_shape is None:
            batch_shape = (batch_size,) + tuple(shape)
        batch_shape = tuple(None if d is None else int(d) for d in batch_shape)
        if len(batch_shape) != 5:
            raise ValueError(
                "keras_spatial.Input takes the global channels-last shape (D, H, W, C) of "
                f"one sample. Received: shape={batch_shape[1:]}"
            )
        strategy = get_strategy()
        local_shape = strategy.local_shape(batch_shape) if strategy is not None else batch_shape
        super().__init__(batch_shape=local_shape, dtype=dtype, name=name, **kwargs)
        self.global_batch_shape = batch_shape

    def get_config(self):
        config = super().get_config()
        config["batch_shape"] = self.global_batch_shape
        return config


def Input(shape=None, batch_size=None, dtype=None, name=None, batch_shape=None, **kwargs):
    """A symbolic input of GLOBAL shape `(D, H, W, C)` that takes the LOCAL shard.

    Use it like `keras.Input`. Under a spatial strategy, the returned tensor has the
    shard's shape, e.g. `(None, 64, 128, 128, 4)` for a global 128^3 x 4 volume split
    (2, 1, 1); with no strategy it has the global shape.

    Returns:
        A `KerasTensor`.
    """
    layer = SpatialInputLayer(
        shape=shape, batch_size=batch_size, dtype=dtype, name=name, batch_shape=batch_shape, **kwargs
    )
    return layer.output
