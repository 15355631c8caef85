"""Gather a sharded volume onto every rank of its spatial group, and its adjoint."""

from __future__ import annotations

import tensorflow as tf

from keras_spatial import comm


def gather_volume(x: tf.Tensor, strategy, name: str = "ks_gather") -> tf.Tensor:
    """The global (batch, D, H, W, C) volume from each rank's local shard.

    Forward: an allgather in the spatial group, rearranged from rank order into the
    sd x sh x sw grid. Backward: the upstream gradient is summed over the spatial group
    (every rank's copy of the volume feeds its own loss) and each rank keeps its slice.
    Horovod's own allgather gradient averages instead, which is not the adjoint.
    """
    if not strategy.is_spatial:
        return x
    sd, sh, sw = strategy.spatial_shape
    process_set = strategy.spatial_process_set
    _, d, h, w, c = x.shape
    i_d, i_h, i_w = strategy.coords

    @tf.custom_gradient
    def _gather(local):
        stacked = comm.allgather(local, process_set, name=name)
        mark = comm.mark_forward(stacked)
        grid = tf.reshape(stacked, [sd, sh, sw, -1, d, h, w, c])
        grid = tf.transpose(grid, [3, 0, 4, 1, 5, 2, 6, 7])
        volume = tf.reshape(grid, [-1, sd * d, sh * h, sw * w, c])

        def grad(upstream):
            with comm.backward_of(mark, process_set):
                total = comm.allreduce(upstream, process_set, name="grad", op="sum")
            return total[:, i_d * d : (i_d + 1) * d, i_h * h : (i_h + 1) * h, i_w * w : (i_w + 1) * w, :]

        return volume, grad

    return _gather(x)
