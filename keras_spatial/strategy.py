"""`SpatialStrategy`: the mesh of ranks and the entry point of the user's program."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Sequence

import keras
import tensorflow as tf

from keras_spatial import comm
from keras_spatial import context
from keras_spatial.callbacks import MetricAverage
from keras_spatial.callbacks import ReplicatedLayerSync
from keras_spatial.callbacks import rank_zero_callbacks
from keras_spatial.context import get_strategy
from keras_spatial.data.pipeline import distribute_dataset
from keras_spatial.mesh import Mesh
from keras_spatial.ops.gather import gather_volume
from keras_spatial.optimizer import DistributedOptimizer
from keras_spatial.optimizer import broadcast_variables
from keras_spatial.cost_model import as_hardware
from keras_spatial.cost_model import format_predictions
from keras_spatial.cost_model import model_costs
from keras_spatial.plan import format_plan
from keras_spatial.plan import summary
from keras_spatial.spatialize import spatialize

__all__ = ["SpatialStrategy", "get_strategy"]


def _product(values: Sequence[int]) -> int:
    result = 1
    for value in values:
        result *= int(value)
    return max(result, 1)


class SpatialStrategy:
    """Hybrid data x spatial parallelism over Horovod.

    The world of N ranks is arranged as N/S data groups of S = sd*sh*sw spatial ranks;
    each spatial group shares one sample, split into an sd x sh x sw grid of equal
    sub-volumes (see `keras_spatial.mesh.Mesh`). Horovod is initialized on creation when
    the process was started by a Horovod launcher (horovodrun, mpirun, srun); a plain
    `python` process is a world of one rank and needs no Horovod.

    Several strategies with different meshes may be created one after another in one
    process; the latest one (or the one whose `scope()` is active) is used by layers.

    Args:
        spatial_shape: shards per sample along (depth, height, width).
            Defaults to `(1, 1, 1)` (pure data parallelism).

    Raises:
        ValueError: if the world size is not a multiple of the spatial size, or a
            spatial split is asked for outside a Horovod launch.

    Example:
    ```python
    strategy = keras_spatial.SpatialStrategy(spatial_shape=(2, 1, 1))
    with strategy.scope():
        x = keras_spatial.Input((64, 64, 64, 4))
        y = keras_spatial.layers.SpatialConv3D(8, 3, padding="same")(x)
        model = keras.Model(x, y)
    y_local = model(strategy.shard(x_global))
    ```
    """

    def __init__(self, spatial_shape: Sequence[int] = (1, 1, 1)):
        if comm.launched_by_horovod():
            if not comm.available():
                raise ImportError(
                    "This process was started by a Horovod launcher, but "
                    "`horovod.tensorflow` cannot be imported. Build it with "
                    "`bash tools/install_horovod.sh` (see the README)."
                )
            rank, size = comm.initialize(spatial_size=_product(spatial_shape))
        else:
            rank, size = 0, 1
        self._rank = rank
        self.mesh = Mesh(world_size=size, spatial_shape=tuple(spatial_shape))
        self._spatial_set = self._set_of(self.mesh.spatial_group(self.data_index))
        self._position_set = self._set_of(self.mesh.position_group(self.spatial_index))
        self._world_set = self._set_of(range(size))
        if rank != 0:
            # Progress bars and Keras's printed logs on rank 0 only.
            keras.config.disable_interactive_logging()
        context.set_latest(self)

    @staticmethod
    def _set_of(ranks: Sequence[int]) -> Any:
        ranks = list(ranks)
        return comm.process_set(ranks) if len(ranks) > 1 else None

    # Mesh facts about this rank ---------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank in the world."""
        return self._rank

    @property
    def size(self) -> int:
        """Number of ranks in the world."""
        return self.mesh.world_size

    @property
    def spatial_shape(self) -> tuple[int, int, int]:
        """Shards per sample along (depth, height, width)."""
        return self.mesh.spatial_shape

    @property
    def spatial_size(self) -> int:
        """Ranks per sample (S)."""
        return self.mesh.spatial_size

    @property
    def data_size(self) -> int:
        """Number of data-parallel groups."""
        return self.mesh.data_size

    @property
    def data_index(self) -> int:
        """This rank's data group."""
        return self.mesh.data_index(self.rank)

    @property
    def spatial_index(self) -> int:
        """This rank's position inside its spatial group."""
        return self.mesh.spatial_index(self.rank)

    @property
    def coords(self) -> tuple[int, int, int]:
        """This rank's (i_d, i_h, i_w) shard coordinates."""
        return self.mesh.coords(self.rank)

    @property
    def is_spatial(self) -> bool:
        """Whether samples are split (S > 1)."""
        return self.spatial_size > 1

    @property
    def spatial_process_set(self) -> Any:
        """Horovod process set of this rank's spatial group (None if S == 1)."""
        return self._spatial_set

    @property
    def position_process_set(self) -> Any:
        """Horovod process set of this spatial position across data groups."""
        return self._position_set

    @property
    def world_process_set(self) -> Any:
        """Horovod process set of the whole world (None for one rank)."""
        return self._world_set

    # Scope ------------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self) -> Iterator["SpatialStrategy"]:
        """Make this strategy the one layers and `keras_spatial.Input` use."""
        context.push_scope(self)
        try:
            yield self
        finally:
            context.pop_scope()

    # Shapes -----------------------------------------------------------------------
    def local_shape(self, global_shape: Sequence[Optional[int]]) -> tuple:
        """The shard shape of a channels-last (batch, D, H, W, C) global shape.

        Extents that do not divide by their shards split as `keras_spatial.halo.
        split_bounds` does: the first shards hold one plane more.

        Raises:
            ValueError: if the shape is not 5D or a spatial extent is unknown or smaller
                than its number of shards.
        """
        global_shape = tuple(global_shape)
        if len(global_shape) != 5:
            raise ValueError(
                "Expected a channels-last 5D shape (batch, depth, height, width, "
                f"channels). Received: shape={global_shape}"
            )
        local = self.mesh.local_extents(global_shape[1:4], self.coords)
        return (global_shape[0],) + local + (global_shape[4],)

    def _bounds(self, global_extents: Sequence[int]) -> list[slice]:
        return [slice(start, stop) for start, stop in self.mesh.shard_bounds(global_extents, self.coords)]

    # Data movement ----------------------------------------------------------------
    def shard(self, array: Any, split_batch: bool = False) -> Any:
        """This rank's sub-volume of a global (batch, D, H, W, C) array.

        Args:
            array: a NumPy array or tensor holding the whole volume.
            split_batch: also take this data group's equal part of the batch (for
                feeding a global batch to data groups). Defaults to False.

        Returns:
            The same kind of array, of the local shape.
        """
        shape = tuple(array.shape)
        self.local_shape(shape)  # validates
        index = [slice(None)] + self._bounds(shape[1:4]) + [slice(None)]
        if split_batch:
            if shape[0] is None or shape[0] % self.data_size:
                raise ValueError(
                    f"The batch of {shape[0]} cannot be split evenly over "
                    f"{self.data_size} data groups. Received: shape={shape}"
                )
            per_group = shape[0] // self.data_size
            index[0] = slice(self.data_index * per_group, (self.data_index + 1) * per_group)
        return array[tuple(index)]

    def gather(self, tensor: Any, global_extents: Optional[Sequence[int]] = None) -> tf.Tensor:
        """The whole volume from the local shards, on every rank of the spatial group.

        Differentiable: the gradient is summed over the spatial group and each rank
        keeps its own slice (docs/design.md, "Gradient rule").

        Args:
            tensor: this rank's shard, (batch, d, h, w, C).
            global_extents: the whole volume's (D, H, W). Needed when an extent does not
                divide by its shards; by default the local extents times the shards.
        """
        return gather_volume(tf.convert_to_tensor(tensor), self, global_extents=global_extents)

    def allreduce(self, value: Any, op: str = "sum", group: str = "world") -> tf.Tensor:
        """Sum or average `value` over a group of ranks (differentiable).

        Args:
            value: a tensor or array, the same shape on every rank of the group.
            op: 'sum' or 'average'. Defaults to 'sum'.
            group: 'world', 'spatial' (this rank's spatial group) or 'data' (this
                spatial position across data groups). Defaults to 'world'.
        """
        sets = {"world": self._world_set, "spatial": self._spatial_set, "data": self._position_set}
        if group not in sets:
            raise ValueError(f"`group` must be one of {sorted(sets)}. Received: group={group!r}")
        if op not in ("sum", "average"):
            raise ValueError(f"`op` must be 'sum' or 'average'. Received: op={op!r}")
        value = tf.convert_to_tensor(value)
        if sets[group] is None:
            return value
        return comm.allreduce(value, sets[group], name=f"ks_{group}_{op}", op=op)

    def barrier(self) -> None:
        """Wait until every rank of the world gets here (e.g. before a rank exits while
        others may still be communicating)."""
        if self._world_set is not None:
            self.allreduce(tf.zeros([1]), "sum", "world").numpy()

    def world_sum(self, value: Any) -> tf.Tensor:
        """`value` summed over every rank of the world."""
        return self.allreduce(value, "sum", "world")

    # Training --------------------------------------------------------------------
    def distribute_optimizer(self, optimizer, bucket_bytes=None, shard_update=False):
        """Wrap a Keras optimizer so that gradients are averaged over the world.

        See `keras_spatial.optimizer.DistributedOptimizer` (`bucket_bytes`: average the
        gradients in buckets of about that many bytes, so that the allreduce can overlap
        the backward pass; None, the default, for one fused allreduce. `shard_update`:
        each rank of a spatial group updates only its share of the variables, then one
        allgather; False by default).
        """
        return DistributedOptimizer(optimizer, bucket_bytes=bucket_bytes, shard_update=shard_update)

    def callbacks(self, *callbacks) -> list:
        """The callback list for `model.fit`/`evaluate` on this mesh.

        Puts `keras_spatial.callbacks.MetricAverage` first (global loss and metrics in
        the progress bar, History and every later callback, so EarlyStopping stops all
        ranks together), then `keras_spatial.callbacks.ReplicatedLayerSync` (gradients
        of the replicated head are not averaged inside a spatial group; its dropout
        masks agree there), and keeps file-writing callbacks (ModelCheckpoint,
        TensorBoard, CSVLogger) on rank 0 only.

        Example:
        ```python
        model.fit(ds, epochs=5, callbacks=strategy.callbacks(
            keras.callbacks.ModelCheckpoint("ckpt.keras"),
            keras.callbacks.EarlyStopping(patience=2)))
        ```
        """
        return [MetricAverage(self), ReplicatedLayerSync(self)] + rank_zero_callbacks(
            callbacks, self.rank
        )

    def broadcast_variables(self, variables, root: int = 0) -> None:
        """Give every rank rank `root`'s values of `variables` (e.g. `model.variables`)."""
        broadcast_variables(variables, self, root)

    def summary(self, model, print_fn=print, *, hardware=None, batch_size: int = 1) -> list:
        """Print the layout plan of `model` on this mesh; return its rows.

        Args:
            model: a functional model built inside `self.scope()`, or with no spatial
                strategy (then the layout is checked before anything is computed).
            print_fn: called with the formatted text. Defaults to `print`.
            hardware: a machine to predict on: a `keras_spatial.cost_model.Hardware`, a
                dict of its fields, a profile name of
                `keras_spatial.hardware_profiles.PROFILES` or a JSON file. When given,
                the predicted time and memory of every layer and the step follow the
                plan (`keras_spatial.cost_model.format_predictions`). Defaults to None.
            batch_size: samples per rank. Defaults to 1.

        Returns:
            The plan rows (`keras_spatial.plan.summary`).

        Raises:
            ValueError: for a layout the mesh cannot serve, or a bad hardware description.
        """
        machine = None if hardware is None else as_hardware(hardware)
        rows = summary(model, self, print_fn=None, batch_size=batch_size)
        text = format_plan(rows, self.mesh, self.rank, batch_size)
        if machine is not None:
            costs = model_costs(model, self.spatial_shape, world_size=self.size,
                                batch_size=batch_size, rows=rows)
            text += "\n" + format_predictions(costs, self.mesh, machine, batch_size * self.data_size)
        if print_fn is not None:
            print_fn(text)
        return rows

    def spatialize(self, model):
        """The spatial model of a plain Keras 3D model on this mesh, with its weights;
        see `keras_spatial.spatialize`."""
        return spatialize(model, self)

    def distribute_dataset(self, dataset, batch_size: int, **kwargs):
        """A `tf.data.Dataset` of this rank's shards; see
        `keras_spatial.data.distribute_dataset` for the arguments."""
        return distribute_dataset(self, dataset, batch_size, **kwargs)

    def __repr__(self) -> str:
        return (
            f"SpatialStrategy(spatial_shape={self.spatial_shape}, world_size={self.size}, "
            f"data_size={self.data_size}, rank={self.rank}, coords={self.coords})"
        )

