"""Batch normalization whose statistics span the ranks that share the batch."""

import keras
import tensorflow as tf

from keras_spatial import comm
from keras_spatial.errors import SpatialNotSupportedError
from keras_spatial.context import get_strategy


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
        SpatialNotSupportedError: at build time if `axis` is not the last axis; in a
            training call across ranks, if a mask is given.

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
        # statistics in training (pinned by tests/test_head_layers_single_process.py).
        process_set = self._statistics_process_set()
        if process_set is None:
            return super()._moments(inputs, mask)
        if mask is not None:
            raise SpatialNotSupportedError(
                f"{type(self).__name__} does not support masks when its statistics span "
                f"several ranks. Received: mask.shape={tuple(mask.shape)}, "
                f"layer={self.name!r}"
            )
        return global_moments(inputs, process_set)

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


def global_moments(x, process_set):
    """Per-channel mean and variance of `x` over every element the ranks of
    `process_set` hold together (all axes but the last).

    Forward: each rank computes its count n_r, mean m_r and sum of squared deviations
    M_r = sum (x - m_r)^2 (two passes over its own data, as `tf.nn.moments`), and ONE
    allgather brings every rank's (n_r, m_r, M_r). They are combined as Chan et al.'s
    parallel algorithm does: mean = sum n_r m_r / N, variance = (sum M_r + sum n_r
    (m_r - mean)^2) / N. No large sums are subtracted, so the result equals the
    two-pass moments of the whole batch to float32 rounding, with one collective where
    a sum followed by a sum of squared deviations from the global mean needs two in a
    row.

    Backward: as for `tf.nn.moments` on the whole batch (the mean is stopped inside the
    variance, whose gradient through the mean is zero anyway): d/dx = dmean / N +
    dvar * 2 (x - mean) / N, where dmean and dvar are the upstream gradients summed
    over the ranks (every rank's loss uses the same statistics): ONE allreduce-SUM.

    Cost: the allgather carries 2 C + 1 floats per rank (C channels), so it grows with
    the number of ranks P, where an allreduce of sums would not: 131 KB for P = 64 and
    C = 256, 2 MB for P = 1024. A single allreduce of sum, sum of squares and count
    (docs/design.md, "Batch-norm statistics") would stay at 2 C + 1 floats but loses
    about mean^2 / variance x float32 epsilon of the variance (an estimate: 5e-3
    relative for a mean of 300 and a standard deviation of 1), which is why it is not
    used.

    Args:
        x: a tensor, channels last.
        process_set: the Horovod process set of the ranks sharing the statistics.

    Returns:
        (mean, variance), each of shape (channels,).
    """
    axes = list(range(len(x.shape) - 1))
    channels = x.shape[-1]

    @tf.custom_gradient
    def _moments(inputs):
        count = tf.cast(tf.reduce_prod(tf.shape(inputs, out_type=tf.int64)[:-1]), inputs.dtype)
        local_mean = tf.reduce_mean(inputs, axis=axes)
        local_deviations = tf.reduce_sum(tf.square(inputs - local_mean), axis=axes)
        local = tf.concat([count[None], local_mean, local_deviations], axis=0)
        every_rank = comm.allgather(local[None], process_set, name="ks_moments")
        mark = comm.mark_forward(every_rank)
        counts = every_rank[:, :1]
        means = every_rank[:, 1 : 1 + channels]
        deviations = every_rank[:, 1 + channels :]
        total = tf.reduce_sum(counts)
        mean = tf.reduce_sum(counts * means, axis=0) / total
        spread = tf.reduce_sum(counts * tf.square(means - mean), axis=0)
        variance = (tf.reduce_sum(deviations, axis=0) + spread) / total

        def grad(upstream_mean, upstream_variance):
            upstream = [
                tf.zeros_like(mean) if g is None else g
                for g in (upstream_mean, upstream_variance)
            ]
            with comm.backward_of(mark, process_set):
                summed = comm.allreduce(tf.concat(upstream, axis=0), process_set, name="grad")
            d_mean, d_variance = summed[:channels], summed[channels:]
            return d_mean / total + d_variance * (2.0 / total) * (inputs - mean)

        return (mean, variance), grad

    return _moments(x)
