"""`DistributedOptimizer`: average gradients over the world, then apply any Keras optimizer."""

from __future__ import annotations

import keras
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

    Args:
        inner_optimizer: the `keras.optimizers.Optimizer` to wrap.
        name: optional name. Defaults to "distributed_" + the inner optimizer's name.
        bucket_bytes: None (the default) for one fused allreduce of all gradients, or a
            positive number of bytes per bucket (a gradient larger than that is a bucket
            of its own).

    Example:
    ```python
    model.compile(optimizer=strategy.distribute_optimizer(keras.optimizers.Adam(1e-3)),
                  loss="mse")
    ```
    """

    def __init__(self, inner_optimizer, name=None, bucket_bytes=None, **kwargs):
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
        super().__init__(learning_rate=0.0, name=name or f"distributed_{inner_optimizer.name}", **kwargs)
        self.inner_optimizer = inner_optimizer
        self.bucket_bytes = bucket_bytes
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
        self.inner_optimizer.apply(
            self.average_gradients(grads, trainable_variables), trainable_variables
        )

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
