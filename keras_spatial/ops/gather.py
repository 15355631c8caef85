"""Gather a sharded volume onto every rank of its spatial group, and its adjoint."""

from __future__ import annotations

import tensorflow as tf

from keras_spatial import comm


def gather_volume(x: tf.Tensor, strategy, name: str = "ks_gather", global_extents=None) -> tf.Tensor:
    """The global (batch, D, H, W, C) volume from each rank's local shard.

    Forward: an allgather in the spatial group, rearranged from rank order into the
    sd x sh x sw grid. Backward: the upstream gradient is summed over the spatial group
    (every rank's copy of the volume feeds its own loss) and each rank keeps its slice.
    Horovod's own allgather gradient averages instead, which is not the adjoint.

    `global_extents`: the volume's (D, H, W); by default the local extents times the
    shards (equal shards). With uneven shards (`keras_spatial.halo.split_bounds`) the
    shards travel as one flat buffer and are put together by their bounds.
    """
    if not strategy.is_spatial:
        return x
    sd, sh, sw = strategy.spatial_shape
    process_set = strategy.spatial_process_set
    _, d, h, w, c = x.shape
    if global_extents is None:
        global_extents = (sd * d, sh * h, sw * w)
    global_extents = tuple(int(e) for e in global_extents)
    mesh = strategy.mesh
    mine = mesh.shard_bounds(global_extents, strategy.coords)
    even = mesh.splits_evenly(global_extents)

    def assemble(stacked, batch):
        if even:
            grid = tf.reshape(stacked, [sd, sh, sw, -1, d, h, w, c])
            grid = tf.transpose(grid, [3, 0, 4, 1, 5, 2, 6, 7])
            return tf.reshape(grid, [-1, *global_extents, c])
        shapes = [mesh.local_extents(global_extents, mesh.coords_of_spatial_index(index))
                  for index in range(mesh.spatial_size)]
        sizes = [batch * (a * b * e * c) for a, b, e in shapes]
        pieces = tf.split(stacked, tf.stack(sizes), num=len(sizes))
        blocks = [tf.reshape(piece, [batch, *shape, c]) for piece, shape in zip(pieces, shapes)]
        planes = []
        for i_d in range(sd):
            rows = []
            for i_h in range(sh):
                row = [blocks[mesh.spatial_index_of((i_d, i_h, i_w))] for i_w in range(sw)]
                rows.append(tf.concat(row, axis=3) if sw > 1 else row[0])
            planes.append(tf.concat(rows, axis=2) if sh > 1 else rows[0])
        volume = tf.concat(planes, axis=1) if sd > 1 else planes[0]
        return tf.ensure_shape(volume, [None, *global_extents, c])

    @tf.custom_gradient
    def _gather(local):
        batch = tf.shape(local)[0]
        stacked = comm.allgather(local if even else tf.reshape(local, [-1]), process_set, name=name)
        mark = comm.mark_forward(stacked)
        volume = assemble(stacked, batch)

        def grad(upstream):
            with comm.backward_of(mark, process_set):
                total = comm.allreduce(upstream, process_set, name="grad", op="sum")
            (d0, d1), (h0, h1), (w0, w1) = mine
            return total[:, d0:d1, h0:h1, w0:w1, :]

        return volume, grad

    return _gather(x)
