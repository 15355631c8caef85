"""Reductions over the spatial axes of a volume split across the ranks of a group."""

import tensorflow as tf

from keras_spatial import comm

SPATIAL_AXES = (1, 2, 3)


def global_mean(x, process_set, fraction=None):
    """Mean over the spatial axes of the whole volume, `(batch, 1, 1, 1, channels)`.

    Each rank averages its shard; with equal shards (`fraction` None) the shard means are
    averaged over `process_set`, otherwise each is weighted by the shard's `fraction` of
    the volume's voxels and the weighted means are summed. The gradient is the adjoint:
    every voxel receives the average (or the sum, times its shard's fraction) over the
    group of the ranks' upstream gradients, divided by its shard's voxel count
    (`comm.allreduce`'s registered gradient).

    Args:
        x: the local shard `(batch, d, h, w, channels)`.
        process_set: the Horovod process set of the ranks holding the volume.
        fraction: this shard's voxels over the whole volume's, or None when every
            shard holds as many voxels.
    """
    local_mean = tf.reduce_mean(x, axis=SPATIAL_AXES, keepdims=True)
    if fraction is None:
        return comm.allreduce(local_mean, process_set, name="ks_global_mean", op="average")
    weighted = local_mean * tf.constant(fraction, local_mean.dtype)
    return comm.allreduce(weighted, process_set, name="ks_global_mean", op="sum")


def global_max(x, process_set):
    """Max over the spatial axes of the whole volume, `(batch, 1, 1, 1, channels)`.

    Forward: each rank's local max, gathered over `process_set`, and the max of the
    gathered values. Backward (the adjoint of `tf.reduce_max` on the whole volume, ties
    included): the upstream gradients summed over the group, shared equally by every
    voxel of the whole volume that attains the maximum.

    Args:
        x: the local shard `(batch, d, h, w, channels)`.
        process_set: the Horovod process set of the ranks holding the volume.
    """

    @tf.custom_gradient
    def _global_max(local):
        local_max = tf.reduce_max(local, axis=SPATIAL_AXES, keepdims=True)
        per_rank = comm.allgather(local_max, process_set, name="ks_global_max")
        per_rank = tf.reshape(per_rank, tf.concat([[-1], tf.shape(local_max)], axis=0))
        maximum = tf.reduce_max(per_rank, axis=0)
        attains = tf.cast(tf.equal(local, maximum), local.dtype)
        count = comm.allreduce(
            tf.reduce_sum(attains, axis=SPATIAL_AXES, keepdims=True), process_set,
            name="ks_global_max_count", op="sum",
        )
        mark = comm.mark_forward(maximum)

        def grad(upstream):
            with comm.backward_of(mark, process_set):
                total = comm.allreduce(upstream, process_set, name="grad", op="sum")
            return attains / count * total

        return maximum, grad

    return _global_max(x)
