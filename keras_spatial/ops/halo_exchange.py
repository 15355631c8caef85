"""Differentiable halo exchange: extend a local shard to the inputs its outputs need.

Axes are exchanged one after another (depth, height, width), each exchange including
the halos already received, so corner and edge regions arrive without extra messages.
Each exchange is one `alltoall` inside the spatial process set that carries only the
halo planes (ranks that are not neighbours along the axis send and receive nothing).
Its gradient, the alltoall with the splits swapped, adds the gradient of every received
plane to the sender's boundary plane: the adjoint of the exchange.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from keras_spatial import comm
from keras_spatial.halo import AxisPlan
from keras_spatial.mesh import SPATIAL_AXES, Mesh


def _to_front(x: tf.Tensor, axis: int) -> tf.Tensor:
    perm = [axis] + [a for a in range(x.shape.rank) if a != axis]
    return tf.transpose(x, perm)


def _from_front(x: tf.Tensor, axis: int) -> tf.Tensor:
    rank = x.shape.rank
    perm = list(range(1, axis + 1)) + [0] + list(range(axis + 1, rank))
    return tf.transpose(x, perm)


def slice_axis(x: tf.Tensor, axis: int, start: int, stop: int) -> tf.Tensor:
    """x[start:stop] along tensor axis `axis` (0 is the batch), with static sizes."""
    begin = [0] * x.shape.rank
    size = [-1] * x.shape.rank
    begin[axis], size[axis] = start, stop - start
    return tf.slice(x, begin, size)


def _fill_like(x: tf.Tensor, axis: int, planes: int, value: float) -> tf.Tensor:
    shape = tf.tensor_scatter_nd_update(tf.shape(x), [[axis]], [planes])
    return tf.fill(shape, tf.constant(value, x.dtype))


def _line_peers(mesh: Mesh, coords: Sequence[int], axis: int) -> list[int | None]:
    """For each spatial index of the group: its shard index along `axis` if it lies on
    this rank's line along `axis` (same coordinates on the other axes), else None."""
    peers = []
    for index in range(mesh.spatial_size):
        other = mesh.coords_of_spatial_index(index)
        same_line = all(other[b] == coords[b] for b in range(3) if b != axis)
        peers.append(other[axis] if same_line else None)
    return peers


def exchange_axis(
    x: tf.Tensor,
    spatial_axis: int,
    plan: AxisPlan,
    mesh: Mesh,
    coords: Sequence[int],
    process_set,
    name: str,
    empty_from: tf.Tensor | None = None,
    flatten: bool = False,
) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
    """Receive the halo planes of `x` along one spatial axis from this rank's neighbours.

    One `alltoall` in the spatial process set sends this rank's planes that the others
    need and receives the planes it needs (`plan.transfer`). Every rank of the set must
    call it when `plan.exchanges`, with the same `name`.

    A rank that sends nothing still sends an empty buffer that depends on `x`, so that
    the backward alltoall runs on it exactly when it runs on the others. Cut from `x`,
    its gradient is a zero tensor of `x`'s full size added to `x`'s gradient; pass
    `empty_from`, a smaller tensor computed from `x` (e.g. the layer's output on the
    shard), to cut it from that instead.

    `flatten`: send the planes as one flat buffer (`comm.alltoall`), needed when ranks of
    the set hold planes of different shapes (uneven shards on another axis:
    `flat_exchange(plans)`). Ranks on one line along the axis hold equally shaped planes.

    Returns:
        (before, after): the received slabs that lie before / after this rank's shard
        along the axis, each in global order. A rank that receives nothing gets
        `([], [empty])`: the alltoall's empty result, shaped like `x` with extent 0
        along the axis. The caller must USE it as data (concatenate it somewhere): its
        gradient is the backward alltoall every rank takes part in, and a result that
        feeds nothing is removed from the graph, leaving the other ranks waiting.
    """
    axis = spatial_axis + 1
    me = coords[spatial_axis]
    own_start = plan.owned[me][0]
    peers = _line_peers(mesh, coords, spatial_axis)
    chunks, send_splits, recv_splits, sources = [], [], [], []
    for peer in peers:
        sent = plan.transfer(me, peer) if peer is not None else None
        got = plan.transfer(peer, me) if peer is not None else None
        send_splits.append(0 if sent is None else sent[1] - sent[0])
        recv_splits.append(0 if got is None else got[1] - got[0])
        if sent is not None:
            chunks.append(slice_axis(x, axis, sent[0] - own_start, sent[1] - own_start))
        if got is not None:
            sources.append(peer)
    if chunks:
        buffer = tf.concat([_to_front(c, axis) for c in chunks], axis=0)
    elif empty_from is None:  # this rank sends nothing: an empty buffer of the right shape
        buffer = _to_front(slice_axis(x, axis, 0, 0), axis)
    else:
        front_shape = [0] + [x.shape[a] for a in range(x.shape.rank) if a != axis]
        buffer = tf.reshape(slice_axis(empty_from, axis, 0, 0), front_shape)
    received = comm.alltoall(
        buffer, send_splits, recv_splits, process_set,
        name=f"{name}_{SPATIAL_AXES[spatial_axis]}", after=[x], flatten=flatten,
    )
    if not sources:
        return [], [_from_front(received, axis)]
    before, after = [], []
    sizes = [s for s in recv_splits if s]
    pieces = tf.split(received, sizes, axis=0) if len(sizes) > 1 else [received]
    for source, piece in zip(sources, pieces):
        (before if source < me else after).append(_from_front(piece, axis))
    return before, after


def flat_exchange(plans: Sequence[AxisPlan]) -> bool:
    """Whether exchanges under these per-axis plans must send flat buffers
    (`exchange_axis`'s `flatten`): some shards differ in extent on some axis."""
    return not all(plan.even for plan in plans)


def extend_axis(
    x: tf.Tensor,
    spatial_axis: int,
    plan: AxisPlan,
    mesh: Mesh,
    coords: Sequence[int],
    process_set,
    fill_value: float,
    name: str,
    flatten: bool = False,
) -> tf.Tensor:
    """Extend `x` (batch, D, H, W, C) along one spatial axis to its needed interval."""
    before, after = [], []
    if plan.exchanges:
        before, after = exchange_axis(x, spatial_axis, plan, mesh, coords, process_set, name,
                                      flatten=flatten)
    return _assemble_axis(x, before, after, spatial_axis, plan, coords[spatial_axis], fill_value)


def _assemble_axis(x, before, after, spatial_axis, plan, me, fill_value) -> tf.Tensor:
    """The local part of `extend_axis`: crop `x` to the kept planes and concatenate the
    received planes and the padding around them."""
    axis = spatial_axis + 1
    own_start = plan.owned[me][0]
    kept = plan.kept(me)
    if kept == plan.owned[me]:
        middle = [x]
    elif kept is not None:
        middle = [slice_axis(x, axis, kept[0] - own_start, kept[1] - own_start)]
    else:
        middle = []
    pad_before, pad_after = plan.padding_before(me), plan.padding_after(me)
    parts = (
        ([_fill_like(x, axis, pad_before, fill_value)] if pad_before else [])
        + list(before)
        + middle
        + list(after)
        + ([_fill_like(x, axis, pad_after, fill_value)] if pad_after else [])
    )
    return parts[0] if len(parts) == 1 else tf.concat(parts, axis=axis)


class HaloParts:
    """A shard's halo exchange, done, with its local assembly still to do.

    `tensors` are what the assembly reads: the shard (or, when several axes exchange,
    the shard already extended along the earlier ones), then the planes received along
    the last exchanging axis. `assemble(*tensors)` builds the extended shard from them
    with slices, concatenations and one padding, and no communication, so it can be
    recomputed (see `keras_spatial.layers.SpatialConv3D`). Made by `exchange_halos`.
    """

    def __init__(self, tensors, assemble):
        self.tensors = list(tensors)
        self.assemble = assemble

    def extended(self) -> tf.Tensor:
        """The extended shard (what `extend_to_halo` returns)."""
        return self.assemble(*self.tensors)


def exchange_halos(
    x: tf.Tensor,
    plans: Sequence[AxisPlan],
    mesh: Mesh,
    coords: Sequence[int],
    process_set,
    fill_value: float = 0.0,
    name: str = "ks_halo",
) -> HaloParts:
    """`extend_to_halo` up to its last concatenation: every exchange done, the local
    assembly of the last exchanging axis and the cropping and padding of the axes that
    exchange nothing left to `HaloParts.assemble`. Arguments as for `extend_to_halo`."""
    exchanging = [axis for axis, plan in enumerate(plans) if plan.exchanges]
    last = exchanging[-1] if exchanging else -1
    flatten = flat_exchange(plans)
    # Axes that exchange nothing (unsplit ones, and split ones whose window stays inside
    # each shard) only crop and pad: one slice each and ONE tf.pad for all of them,
    # instead of a concatenation (a full copy of the shard) per axis.
    paddings = [[0, 0] for _ in range(5)]
    crops = []  # (axis, start, stop) of the axes after the last exchanging one
    before, after = [], []
    for spatial_axis, plan in enumerate(plans):
        me = coords[spatial_axis]
        if plan.exchanges:
            if spatial_axis < last:
                x = extend_axis(x, spatial_axis, plan, mesh, coords, process_set, fill_value, name,
                                flatten=flatten)
            else:
                before, after = exchange_axis(x, spatial_axis, plan, mesh, coords, process_set, name,
                                              flatten=flatten)
            continue
        kept, owned = plan.kept(me), plan.owned[me]
        if kept != owned:
            crop = (spatial_axis + 1, kept[0] - owned[0], kept[1] - owned[0])
            if spatial_axis < last:
                x = slice_axis(x, *crop)
            else:
                crops.append(crop)
        paddings[spatial_axis + 1] = [plan.padding_before(me), plan.padding_after(me)]
    received = len(before)

    def assemble(shard, *planes):
        extended = shard
        if last >= 0:
            extended = _assemble_axis(
                shard, planes[:received], planes[received:], last, plans[last], coords[last], fill_value
            )
        for crop in crops:
            extended = slice_axis(extended, *crop)
        if any(pad_before or pad_after for pad_before, pad_after in paddings):
            extended = tf.pad(extended, paddings, constant_values=tf.constant(fill_value, extended.dtype))
        return extended

    return HaloParts([x, *before, *after], assemble)


def extend_to_halo(
    x: tf.Tensor,
    plans: Sequence[AxisPlan],
    mesh: Mesh,
    coords: Sequence[int],
    process_set,
    fill_value: float = 0.0,
    name: str = "ks_halo",
) -> tf.Tensor:
    """Extend a local shard along all three spatial axes (see `extend_axis`).

    Args:
        x: the local shard, channels last (batch, d, h, w, C).
        plans: one `AxisPlan` per spatial axis, from `keras_spatial.halo.plan_axis`.
        mesh, coords: the mesh and this rank's shard coordinates.
        process_set: the spatial group's Horovod process set (None when S == 1).
        fill_value: value outside the global volume (0 for convolution, -inf for max
            pooling).
        name: prefix of the collective ops' names.

    Returns:
        The shard extended (or cropped) to every axis's needed interval, on which a
        'valid' window op gives exactly this shard's outputs.
    """
    return exchange_halos(x, plans, mesh, coords, process_set, fill_value, name).extended()
