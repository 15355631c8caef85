"""`DistributedOptimizer`: average gradients over the world, then apply any Keras optimizer."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from keras_spatial import comm
from keras_spatial.context import get_strategy


@keras.saving.register_keras_serializable(package="keras_spatial")
class DistributedOptimizer(keras.optimizers.Optimizer):
    """Wraps a Keras optimizer for hybrid data x spatial training over Horovod.

    Before every update, the gradients of all ranks are averaged over the whole world
    in one fused (grouped) allreduce — the gradient rule of docs/design.md, which makes the
    update exactly the one a single device would compute from the global batch. When
    the optimizer is built (before the first step of `model.fit`), the variables it will
    train are broadcast from rank 0, so every rank starts from the same weights; as
    every rank then applies the same averaged gradients, weights stay identical.

    Any Keras optimizer works (SGD, Adam, AdamW, learning-rate schedules, ...): its
    state and schedule are the inner optimizer's. Without a multi-rank strategy this is
    the inner optimizer. Made by `SpatialStrategy.distribute_optimizer(optimizer)`.

    Replicated weights: the gradients of layers that run on gathered, whole volumes (a
    dense head after `SpatialFlatten`) are already identical on the ranks of a spatial
    group, so averaging them over the world is wasted traffic (half of the paper's
    CosmoFlow parameters). Once told which variables those are
    (`set_replicated_variables`, done at the start of `fit` by the
    `keras_spatial.callbacks.ReplicatedLayerSync` callback that
    `SpatialStrategy.callbacks` adds), their gradients are averaged over the data
    groups only, and not communicated at all with one data group; the other gradients
    are still averaged over the world. Until then every gradient is averaged over the
    world, which is exact too, only slower.

    Overlap with the backward pass: one fused allreduce waits for the last gradient.
    With `bucket_bytes`, the gradients are averaged in buckets of about that many bytes,
    in reverse variable order (the order the backward pass produces them, from the
    output layers back), each bucket its own fused allreduce; in a `tf.function` (as in
    `model.fit`) a bucket's allreduce can then run while the backward pass computes the
    gradients of earlier layers. The average is the same either way (with more than 2
    ranks, up to float32 rounding: the order in which ranks' values are summed may
    differ); which is faster depends on the network and on the cores free to overlap.

    Sharded update: every rank of a spatial group holds all the weights and, by default,
    computes the same update of all of them. With `shard_update=True`, the variables are
    dealt out over the ranks of the spatial group (`update_owners`: largest first, each
    to the rank with the fewest elements so far); each rank applies the inner optimizer
    to its own variables only, then one allgather per dtype inside the spatial group
    gives every rank the new values of all of them. The result is the same as without
    (each variable's update is computed by the same ops from the same averaged
    gradient, on one rank instead of all); the optimizer's arithmetic per rank falls by
    about the spatial group's size, at the cost of the allgather. The optimizer's state
    (Adam's moments) stays allocated for every variable, and is kept current only by the
    variable's owner: keep the same mesh when resuming from a checkpoint with it. Refused
    (at construction, or when built) where an update of some variables depends on the
    others or on every rank applying it: `global_clipnorm`, `use_ema`,
    `gradient_accumulation_steps`, a `LossScaleOptimizer`, and fewer trainable
    variables than ranks in a spatial group. Without a split mesh it changes nothing.

    Args:
        inner_optimizer: the `keras.optimizers.Optimizer` to wrap.
        name: optional name. Defaults to "distributed_" + the inner optimizer's name.
        bucket_bytes: None (the default) for one fused allreduce of all gradients, or a
            positive number of bytes per bucket (a gradient larger than that is a bucket
            of its own).
        shard_update: whether each rank of a spatial group updates only its share of
            the variables (see above). Defaults to False.

    Example:
    ```python
    model.compile(optimizer=strategy.distribute_optimizer(keras.optimizers.Adam(1e-3)),
                  loss="mse")
    ```
    """

    def __init__(self, inner_optimizer, name=None, bucket_bytes=None, shard_update=False, **kwargs):
        if bucket_bytes is not None and (
            isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1
        ):
            raise ValueError(
                "`bucket_bytes` must be None or a positive integer. "
                f"Received: bucket_bytes={bucket_bytes!r}"
            )
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise ValueError(
                "DistributedOptimizer wraps a keras.optimizers.Optimizer instance. "
                f"Received: inner_optimizer={inner_optimizer!r}"
            )
        if isinstance(inner_optimizer, DistributedOptimizer):
            raise ValueError("The optimizer is already a DistributedOptimizer.")
        if not isinstance(shard_update, bool):
            raise ValueError(f"`shard_update` must be True or False. Received: shard_update={shard_update!r}")
        if shard_update:
            _check_shardable(inner_optimizer)
        super().__init__(learning_rate=0.0, name=name or f"distributed_{inner_optimizer.name}", **kwargs)
        self.inner_optimizer = inner_optimizer
        self.bucket_bytes = bucket_bytes
        self.shard_update = shard_update
        # A restored optimizer (load_model, clone_model) comes with weights that are
        # already identical wherever the same file was loaded; and it may be built on
        # one rank only (e.g. rank 0 loading a checkpoint), where a broadcast would hang.
        self.broadcast_on_build = True
        self._replicated_ids: frozenset = frozenset()

    def set_replicated_variables(self, variables) -> None:
        """Declare the variables whose gradients are identical across a spatial group.

        Their gradients are then averaged over data groups only (see the class
        docstring). Call before the first training step (the step's graph is built
        then); `SpatialStrategy.callbacks` does it for `model.fit`. For a custom
        loop: `optimizer.set_replicated_variables(v for layer in
        keras_spatial.plan.replicated_layers(model, strategy) for v in
        layer.trainable_variables)`.

        Declaring a variable whose gradient differs across the spatial group makes the
        ranks' weights drift apart; the layers of `keras_spatial.plan.replicated_layers`
        qualify as long as they are deterministic or their random seeds agree across the
        spatial group (`ReplicatedLayerSync` aligns Keras seed generators).

        Args:
            variables: an iterable of Keras variables (of the model being trained).
        """
        self._replicated_ids = frozenset(id(v) for v in variables)

    def _world(self):
        strategy = get_strategy()
        return strategy if strategy is not None and strategy.size > 1 else None

    def build(self, var_list):
        strategy = self._world()
        if strategy is not None and self.broadcast_on_build:
            with tf.init_scope():  # eager, once, even if first built inside a tf.function
                broadcast_variables(var_list, strategy)
        if self._shards(strategy) and len(var_list) < strategy.spatial_size:
            raise ValueError(
                f"shard_update=True deals the trainable variables out over the "
                f"{strategy.spatial_size} ranks of a spatial group, but the model has only "
                f"{len(var_list)}: some rank would own none. Use shard_update=False."
            )
        self.inner_optimizer.build(var_list)
        super().build(var_list)

    @property
    def variables(self):
        return self._variables + self.inner_optimizer.variables

    def average_gradients(self, grads, variables=None):
        """The average of `grads` over the world (None entries stay None); gradients of
        variables declared replicated (see `set_replicated_variables`) are averaged over
        data groups only.

        Args:
            grads: gradients, one per variable.
            variables: the variables of `grads`, in the same order; None treats every
                gradient as one to average over the world. Defaults to None.
        """
        strategy = self._world()
        result = list(grads)
        if strategy is None:
            return result
        present = [i for i, g in enumerate(grads) if g is not None]
        replicated = []
        if variables is not None and self._replicated_ids and strategy.spatial_size > 1:
            variables = list(variables)
            replicated = [i for i in present if id(variables[i]) in self._replicated_ids]
            present = [i for i in present if id(variables[i]) not in self._replicated_ids]
        groups = [(present, strategy.world_process_set, "ks_gradient_average")]
        if strategy.data_size > 1:  # with one data group, replicated gradients are final
            groups.append((replicated, strategy.position_process_set, "ks_replicated_gradient_average"))
        for indices, process_set, name in groups:
            tensors = {i: tf.convert_to_tensor(grads[i]) for i in indices}
            for k, bucket in enumerate(gradient_buckets(tensors, self.bucket_bytes)):
                averaged = comm.grouped_allreduce(
                    [tensors[i] for i in bucket], process_set,
                    name=name if self.bucket_bytes is None else f"{name}_{k}", op="average",
                )
                for i, g in zip(bucket, averaged):
                    result[i] = g
        return result

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if not grads:
            return
        if not self.built:
            trainable_variables = list(trainable_variables)
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        trainable_variables = list(trainable_variables or self._trainable_variables)
        averaged = self.average_gradients(grads, trainable_variables)
        strategy = self._world()
        if self._shards(strategy):
            self._apply_sharded(averaged, trainable_variables, strategy)
        else:
            self.inner_optimizer.apply(averaged, trainable_variables)

    def _shards(self, strategy) -> bool:
        """Whether updates are dealt out: `shard_update` on a mesh with a split."""
        return self.shard_update and strategy is not None and strategy.spatial_size > 1

    def _apply_sharded(self, grads, variables, strategy):
        """The inner update of this rank's variables, then every variable's new value
        from its owner (one allgather per dtype in the spatial group)."""
        owners = update_owners([v.shape for v in variables], strategy.spatial_size)
        me = strategy.spatial_index
        mine = [i for i, owner in enumerate(owners) if owner == me]
        self.inner_optimizer.apply([grads[i] for i in mine], [variables[i] for i in mine])
        unread = [g for i, g in enumerate(grads) if owners[i] != me and g is not None]
        by_dtype: dict = {}
        for i, variable in enumerate(variables):
            by_dtype.setdefault(str(variable.dtype), []).append(i)
        for k, (dtype, indices) in enumerate(sorted(by_dtype.items())):
            local = [tf.reshape(tf.convert_to_tensor(variables[i]), [-1]) for i in indices if owners[i] == me]
            local = tf.concat(local, 0) if local else tf.zeros([0], dtype)
            gathered = comm.allgather(local, strategy.spatial_process_set, name=f"ks_sharded_update_{k}")
            order = [i for rank in range(strategy.spatial_size) for i in indices if owners[i] == rank]
            parts = tf.split(gathered, [_num_elements(variables[i].shape) for i in order])
            if all(owners[i] == me for i in indices):
                unread.append(gathered)
            for i, part in zip(order, parts):
                if owners[i] != me:
                    variables[i].assign(tf.reshape(part, variables[i].shape))
        # In a tf.function, graph optimization removes ops whose outputs nothing reads,
        # and Horovod's collectives count as such ops: a gradient allreduce (or bucket)
        # holding none of this rank's variables, or an allgather that brings this rank
        # nothing new, would run on the other ranks only, and they would wait for it
        # forever. An assertion that always holds reads them.
        if unread and not tf.executing_eagerly():
            tf.debugging.Assert(True, unread, name="ks_keep_collectives")

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise NotImplementedError(
            "DistributedOptimizer runs on the TensorFlow backend only (stateless_apply is "
            "for JAX)."
        )

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def get_config(self):
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "bucket_bytes": self.bucket_bytes,
            "shard_update": self.shard_update,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        optimizer = cls(inner, **config)
        optimizer.broadcast_on_build = False
        return optimizer


def _check_shardable(inner) -> None:
    refused = []
    if isinstance(inner, keras.optimizers.LossScaleOptimizer):
        refused.append("a LossScaleOptimizer (its update of every variable depends on all gradients)")
    else:
        if getattr(inner, "global_clipnorm", None):
            refused.append("global_clipnorm (the norm is over all gradients)")
        if getattr(inner, "use_ema", False):
            refused.append("use_ema (every rank must average every variable)")
        if getattr(inner, "gradient_accumulation_steps", None):
            refused.append("gradient_accumulation_steps")
    if refused:
        raise ValueError(
            "shard_update=True updates each variable on one rank of the spatial group, which "
            f"this inner optimizer does not allow: {'; '.join(refused)}. Use shard_update=False."
        )


def _num_elements(shape) -> int:
    return int(np.prod(tuple(shape)))  # 1 for a scalar's ()


def update_owners(shapes, ranks: int) -> list:
    """The rank (0 .. ranks-1 of a spatial group) that updates each variable of `shapes`
    with `shard_update`: largest variable first (ties: lower index), each to the rank
    with the fewest elements so far (ties: lower rank)."""
    sizes = [_num_elements(shape) for shape in shapes]
    loads = [0] * ranks
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        owners[i] = rank
        loads[rank] += sizes[i]
    return owners


def gradient_buckets(tensors, bucket_bytes):
    """The keys of `tensors` (a dict, in variable order) grouped into allreduce buckets:
    all of them in one bucket when `bucket_bytes` is None, else in reverse order, a new
    bucket starting where adding a tensor would pass `bucket_bytes` (static sizes)."""
    keys = list(tensors)
    if not keys:
        return []
    if bucket_bytes is None:
        return [keys]
    buckets, current, size = [], [], 0
    for key in reversed(keys):
        tensor = tensors[key]
        nbytes = (tensor.shape.num_elements() or 0) * tensor.dtype.size
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(key)
        size += nbytes
    buckets.append(current)
    return buckets


def broadcast_variables(variables, strategy, root: int = 0) -> None:
    """Assign rank `root`'s value of every variable on all ranks (eager, collective)."""
    if strategy is None or strategy.size == 1:
        return
    for index, variable in enumerate(variables):
        value = comm.broadcast(
            tf.convert_to_tensor(variable), root, strategy.world_process_set,
            name=f"ks_broadcast_{index}",
        )
        variable.assign(value)
