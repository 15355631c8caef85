"""Differentiable collectives over Horovod process sets.

Every op takes an explicit `name`. Horovod matches a collective across ranks by its op
name, and names that TensorFlow derives from input tensors can differ between ranks whose
local graphs differ (a shard that crops, a shard that pads), so callers name ops after the
layer and purpose; TensorFlow's own uniquifying keeps repeated calls apart in one graph.
Each op's gradient is written beside it, named after the op, as the adjoint of the
forward operation (docs/design.md, "Gradient rule").

Collectives created by a gradient function need more care, because automatic
differentiation visits a model's ops in an order that depends on each rank's local graph
(breadth first from the loss), and those graphs differ between ranks. When two
collectives do not depend on each other (parallel branches of a model), ranks can reach
their gradients in different orders. `backward_of` makes that safe:

* in a `tf.function` (how `model.fit` runs), a gradient's collectives are named after
  their forward op, so Horovod pairs them by name whatever the order, and carry a control
  dependency on that op, so that graph optimization never merges two of them whose
  inputs happen to be equal on one rank (a rank that receives nothing back gets equal,
  empty gradients from every branch) but not on another;
* run eagerly, each collective completes before the next starts, so the order itself
  must agree: the ranks first compare which forward collective they are differentiating
  (one small allgather), and raise `SpatialNotSupportedError` instead of pairing one
  branch's gradient with another's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
from typing import Any, Iterator, Optional, Sequence

import tensorflow as tf

from keras_spatial.errors import SpatialNotSupportedError


def _hvd():
    import horovod.tensorflow as hvd

    return hvd


_eager_sequence = itertools.count()
_backward = threading.local()


@dataclasses.dataclass(frozen=True)
class ForwardMark:
    """The forward op of a differentiable collective, as its gradient function needs it.

    Attributes:
        op: the forward op, in a graph (None when executing eagerly).
        sequence: run eagerly, the number of forward collectives this process marked
            before this one. Every rank runs the same forward program in the same order,
            so equal marks have equal sequence numbers on all ranks. None in a graph.
    """

    op: Any
    sequence: Optional[int]


def mark_forward(tensor: tf.Tensor) -> ForwardMark:
    """Mark `tensor`'s op (the result of a collective) as a forward op whose gradient
    function will communicate inside `backward_of` the returned mark."""
    if tf.executing_eagerly():
        return ForwardMark(op=None, sequence=next(_eager_sequence))
    return ForwardMark(op=tensor.op, sequence=None)


@contextlib.contextmanager
def backward_of(mark: ForwardMark, process_set: Any) -> Iterator[None]:
    """Scope of a gradient function's collectives (see the module docstring).

    In a graph, collectives created inside are named `<forward op name>_<name>` and run
    after the forward op. Executing eagerly, the ranks of `process_set` first check that
    they all differentiate the same forward collective.

    Raises:
        SpatialNotSupportedError: executing eagerly, when the ranks of `process_set`
            reach the gradients of different collectives: the model has branches that
            communicate without depending on each other. Run the step in a
            `tf.function` (the default of `model.fit`; not `run_eagerly=True`).
    """
    if mark.op is None:
        _check_backward_order(mark, process_set)
        yield
        return
    stack = getattr(_backward, "stack", None)
    if stack is None:
        stack = _backward.stack = []
    stack.append(mark.op.name)
    try:
        with tf.control_dependencies([mark.op]):
            yield
    finally:
        stack.pop()


def _check_backward_order(mark: ForwardMark, process_set: Any) -> None:
    sequences = _hvd().allgather(
        tf.constant([mark.sequence], tf.int64), name="ks_backward_order", process_set=process_set
    ).numpy()
    if (sequences != mark.sequence).any():
        raise SpatialNotSupportedError(
            "Run eagerly, the ranks of one collective's process set reached the gradients "
            "of different collectives (forward collective numbers by rank: "
            f"{sequences.tolist()}). The model has branches that exchange halos or reduce "
            "over ranks without depending on each other, and automatic differentiation "
            "visits them in an order that depends on each rank's shard. Run the training "
            "step in a tf.function (model.fit does unless run_eagerly=True), where such "
            "collectives are paired by name."
        )


def _named(name: str) -> str:
    """`name`, prefixed by the forward op's name inside a graph's `backward_of`."""
    stack = getattr(_backward, "stack", None)
    if stack and not tf.executing_eagerly():
        return f"{stack[-1]}_{name}"
    return name


def alltoall(
    x: tf.Tensor,
    send_splits: Sequence[int],
    recv_splits: Sequence[int],
    process_set: Any,
    name: str,
    after: Sequence[tf.Tensor] = (),
    flatten: bool = False,
) -> tf.Tensor:
    """Send `x[offsets[r]:offsets[r]+send_splits[r]]` to rank r of `process_set`.

    Both split lists are known statically by the caller (they follow from the global
    geometry), so the received tensor has a static leading extent `sum(recv_splits)`.
    The gradient is an alltoall with the splits swapped: each received row's gradient
    goes back to the rank that sent the row.

    Horovod needs every rank's tensor to have the same shape past axis 0. Where the
    ranks of the set hold rows of different shapes (uneven shards), pass
    `flatten=True`: the rows travel as one flat buffer, and each received row takes the
    shape of `x`'s rows, so every rank that sends to this one must send rows shaped as
    this rank's.

    `after`: tensors the exchange runs after, in a graph. Pass the tensor `x` was cut
    from: it keeps apart, in graph optimization, exchanges of different tensors whose
    buffers look alike on one rank (empty ones, where a rank sends nothing).
    """
    hvd = _hvd()
    send = [int(s) for s in send_splits]
    recv = [int(s) for s in recv_splits]
    out_shape = [sum(recv)] + list(x.shape[1:])
    in_shape = list(x.shape)

    def exchange(tensor, splits, op_name):
        """(the alltoall's own output, a function shaping it into rows)."""
        if not flatten:
            received, _ = hvd.alltoall(
                tensor, splits=tf.constant(splits, tf.int32), name=op_name, process_set=process_set
            )
            return received, lambda raw, rows: raw
        row_shape = tf.shape(tensor)[1:]
        per_row = tf.cast(tf.reduce_prod(row_shape), tf.int32)
        received, _ = hvd.alltoall(
            tf.reshape(tensor, [-1]), splits=tf.constant(splits, tf.int32) * per_row,
            name=op_name, process_set=process_set,
        )
        return received, lambda raw, rows: tf.reshape(raw, tf.concat([[rows], row_shape], axis=0))

    @tf.custom_gradient
    def _alltoall(tensor):
        with tf.control_dependencies(list(after)):
            raw, shape_rows = exchange(tensor, send, _named(name))
        # The mark is the alltoall itself: its name, ours, is the same on every rank, and
        # the gradient's collective is named after it (`backward_of`).
        mark = mark_forward(raw)
        received = tf.ensure_shape(shape_rows(raw, sum(recv)), out_shape)

        def grad(upstream):
            with backward_of(mark, process_set):
                raw_back, shape_back = exchange(upstream, recv, _named("grad"))
            return tf.ensure_shape(shape_back(raw_back, sum(send)), in_shape)

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
        reduced = hvd.allreduce(tensor, op=reduce_op, name=_named(name), process_set=process_set)
        mark = mark_forward(reduced)

        def grad(upstream):
            with backward_of(mark, process_set):
                return hvd.allreduce(
                    upstream, op=reduce_op, name=_named("grad"), process_set=process_set
                )

        return reduced, grad

    return _allreduce(x)


def allgather(x: tf.Tensor, process_set: Any, name: str) -> tf.Tensor:
    """Concatenate `x` from every rank of `process_set` along axis 0, in rank order.

    Not differentiable here on purpose: Horovod's registered allgather gradient averages,
    which is not the adjoint of the spatial gather (see `keras_spatial.ops.gather`).
    """
    hvd = _hvd()
    return hvd.allgather(tf.stop_gradient(x), name=_named(name), process_set=process_set)


def grouped_allreduce(
    tensors: Sequence[tf.Tensor], process_set: Any, name: str, op: str = "average"
) -> list[tf.Tensor]:
    """Reduce many tensors in one fused Horovod request (no gradient)."""
    hvd = _hvd()
    reduce_op = {"sum": hvd.Sum, "average": hvd.Average}[op]
    return hvd.grouped_allreduce(
        list(tensors), op=reduce_op, name=_named(name), process_set=process_set
    )


def broadcast(x: tf.Tensor, root: int, process_set: Any, name: str) -> tf.Tensor:
    """`x` of rank `root` (a rank of the world) on every rank of `process_set`."""
    hvd = _hvd()
    return hvd.broadcast(x, root, name=_named(name), process_set=process_set)


def broadcast_object(obj: Any, root: int = 0, name: Optional[str] = None) -> Any:
    """A picklable Python object of world rank `root`, on every rank."""
    return _hvd().broadcast_object(obj, root_rank=root, name=name)


def allgather_object(obj: Any, name: Optional[str] = None) -> list:
    """The picklable `obj` of every rank, as a list in world rank order."""
    return _hvd().allgather_object(obj, name=name)
