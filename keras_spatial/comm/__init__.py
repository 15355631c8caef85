"""Collective communication. The only package of keras_spatial that imports Horovod.

Everything here is a thin wrapper over one `horovod.tensorflow` op (or a small,
documented composition), with its gradient registered beside it where it has one.
Horovod is optional: without it, `available()` is False and only a world of one
process can be used.
"""

from keras_spatial.comm.runtime import available
from keras_spatial.comm.runtime import initialize
from keras_spatial.comm.runtime import launched_by_horovod
from keras_spatial.comm.runtime import process_set
from keras_spatial.comm.collectives import allgather
from keras_spatial.comm.collectives import allreduce
from keras_spatial.comm.collectives import alltoall
from keras_spatial.comm.collectives import broadcast
from keras_spatial.comm.collectives import grouped_allreduce
from keras_spatial.comm.collectives import broadcast_object
from keras_spatial.comm.collectives import allgather_object
from keras_spatial.comm.collectives import ForwardMark
from keras_spatial.comm.collectives import backward_of
from keras_spatial.comm.collectives import mark_forward

__all__ = [
    "available",
    "initialize",
    "launched_by_horovod",
    "process_set",
    "allgather",
    "allreduce",
    "alltoall",
    "broadcast",
    "grouped_allreduce",
    "broadcast_object",
    "allgather_object",
    "ForwardMark",
    "backward_of",
    "mark_forward",
]
