"""Differentiable collectives over Horovod process sets.

Every op takes an explicit `name`. Horovod matches a collective across ranks by its op
name, and names that TensorFlow derives from input tensors can differ between ranks whose
local graphs differ (a shard that crops, a shard that pads), so callers name ops after the
layer and purpose; TensorFlow's own uniquifying keeps repeated calls apart in one graph.
Each op's gradient is written beside it, named after the op, as the adjoint of the
forward operation (DESIGN.md, "Gradient rule").
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import tensorflow as tf


def _hvd():
    import horovod.tensorflow as hvd

    return hvd


def alltoall(
    x: tf.Tensor,
    send_splits: Sequence[int],
    recv_splits: Sequence[int],
    process_set: Any,
    name: str,
) -> tf.Tensor:
    """Send `x[offsets[r]:offsets[r]+send_splits[r]]` to rank r of `process_set`.

    Both split lists are known statically by the caller (they follow from the global
    geometry), so the received tensor has a static leading extent `sum(recv_splits)`.
    The gradient is an alltoall with the splits swapped: each received row's gradient
    goes back to the rank that sent the row.
    """
    hvd = _hvd()
    send = [int(s) for s in send_splits]
    recv = [int(s) for s in recv_splits]
    out_shape = [sum(recv)] + list(x.shape[1:])
    in_shape = list(x.shape)

    @tf.custom_gradient
    def _alltoall(tensor):
        received, _ = hvd.alltoall(
            tensor, splits=tf.constant(send, tf.int32), name=name, process_set=process_set
        )
        received = tf.ensure_shape(received, out_shape)

        def grad(upstream):
            returned, _ = hvd.alltoall(
                upstream,
                splits=tf.constant(recv, tf.int32),
                name=f"{name}_grad",
                process_set=process_set,
            )
            return tf.ensure_shape(returned, in_shape)

        return received, grad

    return _alltoall(x)


def allreduce(
    x: tf.Tensor, process_set: Any, name: str, op: str = "sum"
) -> tf.Tensor:
    """Sum (op='sum') or average (op='average') `x` over `process_set`.

    The gradient of a sum over ranks, where every rank's output feeds its own loss, is the
    sum of the upstream gradients over the same ranks (and the average's is the average).
    """
    hvd = _hvd()
    reduce_op = {"sum": hvd.Sum, "average": hvd.Average}[op]

    @tf.custom_gradient
    def _allreduce(tensor):
        reduced = hvd.allreduce(tensor, op=reduce_op, name=name, process_set=process_set)

        def grad(upstream):
            return hvd.allreduce(
                upstream, op=reduce_op, name=f"{name}_grad", process_set=process_set
            )

        return reduced, grad

    return _allreduce(x)


def allgather(x: tf.Tensor, process_set: Any, name: str) -> tf.Tensor:
    """Concatenate `x` from every rank of `process_set` along axis 0, in rank order.

    Not differentiable here on purpose: Horovod's registered allgather gradient averages,
    which is not the adjoint of the spatial gather (see `keras_spatial.ops.gather`).
    """
    hvd = _hvd()
    return hvd.allgather(tf.stop_gradient(x), name=name, process_set=process_set)


def grouped_allreduce(
    tensors: Sequence[tf.Tensor], process_set: Any, name: str, op: str = "average"
) -> list[tf.Tensor]:
    """Reduce many tensors in one fused Horovod request (no gradient)."""
    hvd = _hvd()
    reduce_op = {"sum": hvd.Sum, "average": hvd.Average}[op]
    return hvd.grouped_allreduce(
        list(tensors), op=reduce_op, name=name, process_set=process_set
    )


def broadcast(x: tf.Tensor, root: int, process_set: Any, name: str) -> tf.Tensor:
    """`x` of rank `root` (a rank of the world) on every rank of `process_set`."""
    hvd = _hvd()
    return hvd.broadcast(x, root, name=name, process_set=process_set)


def broadcast_object(obj: Any, root: int = 0, name: Optional[str] = None) -> Any:
    """A picklable Python object of world rank `root`, on every rank."""
    return _hvd().broadcast_object(obj, root_rank=root, name=name)


def allgather_object(obj: Any, name: Optional[str] = None) -> list:
    """The picklable `obj` of every rank, as a list in world rank order."""
    return _hvd().allgather_object(obj, name=name)
