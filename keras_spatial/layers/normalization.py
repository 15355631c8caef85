"""Batch normalization whose statistics span the ranks that share the batch."""

import keras

from keras_spatial.errors import SpatialNotSupportedError
from keras_spatial.context import get_strategy
from keras_spatial.ops.batch_norm_moments import global_moments


@keras.saving.register_keras_serializable(package="keras_spatial")
class SpatialBatchNormalization(keras.layers.BatchNormalization):
    """Batch normalization of tensors split across ranks, statistics over all of them.

    Takes the arguments of `keras.layers.BatchNormalization`. In training, the mean
    and variance of each channel are computed over every voxel of every sample the
    ranks hold together, from ONE allgather of every rank's count, mean and sum of
    squared deviations (see `global_moments`; the backward pass is one allreduce-SUM,
    docs/design.md "Gradient rule"):

    - `synchronized=True` (the default here; Keras's default is False): over the
      whole world, i.e. the whole GLOBAL batch. The layer then computes exactly what
      one `keras.layers.BatchNormalization` computes on one device holding the global
      batch, and the moving statistics are identical on every rank.
    - `synchronized=False`: over the spatial group only, i.e. over the sample volumes
      of this data group's batch, as LBANN does (and as Keras's `synchronized=False`
      uses one replica's batch: a replica here is a spatial group). The moving
      statistics are then averaged over data groups after each training step, so they
      stay identical on every rank (as a mirrored variable with MEAN aggregation).

    The statistics of a whole sample volume are always combined over its spatial
    group. A tensor replicated on the spatial group (e.g. after `SpatialFlatten`) is
    normalized correctly too: its sums and counts are both multiplied by the group
    size. In inference (`training=False`) the moving statistics are used locally and
    nothing is communicated. Without a strategy, or with a world of one rank, it is
    `keras.layers.BatchNormalization` with the same arguments.

    Args:
        axis: the channel axis; only the last axis is supported. Defaults to -1.
        synchronized: statistics over the whole world (True) or over each spatial
            group (False). Defaults to True.
        **kwargs: the other arguments of `keras.layers.BatchNormalization`
            (`momentum`, `epsilon`, `center`, `scale`, initializers, ...).

    Input shape:
        Any rank, channels last; LOCAL shard `(batch, d, h, w, channels)` in a
        spatial model, or a tensor replicated on the spatial group.

    Output shape:
        Same as the input (LOCAL if the input is a shard).

    Raises:
        SpatialNotSupportedError: at build time if `axis` is not the last axis.

    Example:
    ```python
    with strategy.scope():
        x = keras_spatial.Input((64, 64, 64, 4))
        y = keras_spatial.layers.SpatialConv3D(16, 3, padding="same")(x)
        y = SpatialBatchNormalization()(y)          # statistics of the global batch
        y = keras.layers.Activation("relu")(y)
    ```
    """

    def __init__(self, axis=-1, synchronized=True, **kwargs):
        super().__init__(axis=axis, synchronized=synchronized, **kwargs)

    def build(self, input_shape):
        rank = len(input_shape)
        if not -rank <= self.axis < rank or self.axis % rank != rank - 1:
            raise SpatialNotSupportedError(
                f"{type(self).__name__} normalizes the channel axis, which must be the "
                f"last axis (axis=-1). Received: axis={self.axis}, "
                f"input_shape={tuple(input_shape)}, layer={self.name!r}"
            )
        super().build(input_shape)

    def _statistics_process_set(self):
        """The process set of the ranks that share the statistics, or None."""
        strategy = get_strategy()
        if strategy is None or strategy.size == 1:
            return None
        if self.synchronized:
            return strategy.world_process_set
        if strategy.is_spatial:
            return strategy.spatial_process_set
        return None

    def _moments(self, inputs, mask):
        # Overrides the hook `keras.layers.BatchNormalization.call` uses for the batch
        # statistics in training (pinned by tests/unit/test_head_layers_single_process.py).
        process_set = self._statistics_process_set()
        if process_set is None:
            return super()._moments(inputs, mask)
        return global_moments(inputs, process_set, mask=mask)

    def call(self, inputs, training=None, mask=None):
        outputs = super().call(inputs, training=training, mask=mask)
        if training and self.trainable:
            self._average_state_over_data_groups()
        return outputs

    def _average_state_over_data_groups(self):
        strategy = get_strategy()
        if self.synchronized or strategy is None or strategy.data_size == 1:
            return
        for variable in self.non_trainable_variables:
            variable.assign(strategy.allreduce(variable, "average", "data"))
