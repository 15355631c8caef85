"""Callbacks that make `model.fit` behave on many ranks as on one."""

from __future__ import annotations

import numbers
import time

import keras
import numpy as np

from keras_spatial.batch_norm_statistics import batch_norm_layers, check_steps, recompute_batch_norm_statistics
from keras_spatial.context import get_strategy
from keras_spatial.optimizer import DistributedOptimizer
from keras_spatial.plan import replicated_layers

# Callbacks that write files: only rank 0 keeps them (see `rank_zero_callbacks`).
WRITING_CALLBACKS = (
    keras.callbacks.ModelCheckpoint,
    keras.callbacks.TensorBoard,
    keras.callbacks.CSVLogger,
)


class MetricAverage(keras.callbacks.Callback):
    """Make loss and metrics global: averaged over all ranks, identical everywhere.

    After every training and test batch it averages, over the world, (1) the state
    variables of the model's metrics (including the loss tracker) and (2) the numbers in
    the batch's logs. Every rank sees equal numbers of samples (or voxels), so for
    additive metric states (totals and counts: Keras's mean-based metrics, accuracy,
    AUC, ...) the average state gives exactly the global result; averaging after each
    batch keeps that true at all times. So the progress bar, `History`, what
    `evaluate` returns, validation metrics, and the callbacks after this one
    (EarlyStopping, ReduceLROnPlateau, ModelCheckpoint's monitor) all see the global
    values, and all ranks stop together. Metrics whose state is not additive (e.g. a
    running maximum) are not supported.

    Must come before the callbacks that read the logs; `SpatialStrategy.callbacks`
    puts it first.

    Args:
        strategy: the `SpatialStrategy`.
    """

    def __init__(self, strategy):
        super().__init__()
        self.strategy = strategy

    def _average(self, logs, with_metric_states: bool) -> None:
        """Average the metrics' state variables (optionally) and the numbers in `logs`
        over the world, in one allreduce."""
        if self.strategy.size == 1:
            return
        variables = []
        if with_metric_states and self.model is not None:
            variables = [v for metric in self.model.metrics for v in metric.variables]
            for metric in self.model.metrics:
                for v in metric.variables:
                    if not np.issubdtype(np.dtype(v.dtype), np.floating):
                        raise ValueError(
                            f"Metric {metric.name!r} keeps its state in {v.dtype} variable "
                            f"{v.name!r}; MetricAverage averages metric states over the ranks "
                            "and an integer state would be truncated. Create the metric with "
                            "a float dtype (e.g. dtype='float32'). Received: "
                            f"metric={type(metric).__name__}, dtype={v.dtype}"
                        )
        keys = sorted(k for k, v in (logs or {}).items() if _is_number(v))
        if not variables and not keys:
            return
        flat = np.concatenate(
            [np.asarray(v.numpy(), np.float64).ravel() for v in variables]
            + [np.array([float(logs[k]) for k in keys], dtype=np.float64)]
        )
        averaged = self.strategy.allreduce(flat, op="average", group="world").numpy()
        offset = 0
        for variable in variables:
            size = int(np.prod(variable.shape))
            value = averaged[offset : offset + size].reshape(variable.shape)
            variable.assign(value.astype(variable.dtype))
            offset += size
        for key, value in zip(keys, averaged[offset:]):
            logs[key] = float(value)

    def on_train_batch_end(self, batch, logs=None):
        self._average(logs, with_metric_states=True)

    def on_test_batch_end(self, batch, logs=None):
        self._average(logs, with_metric_states=True)

    def on_epoch_end(self, epoch, logs=None):
        self._average(logs, with_metric_states=False)  # already global; keeps hand-made logs global too


class ReplicatedLayerSync(keras.callbacks.Callback):
    """Skip needless gradient traffic for layers replicated across a spatial group.

    At the start of `fit` it finds the layers that run on gathered, whole volumes
    (`keras_spatial.plan.replicated_layers`: a dense head after `SpatialFlatten`),
    (1) gives their Keras random-seed generators (Dropout, GaussianNoise, ...) the state
    of the first rank of each spatial group, so their random masks agree within a group
    as on one device (data groups keep their own), and (2) tells the model's
    `DistributedOptimizer` that their gradients are identical within a spatial group,
    so they are averaged over data groups only (see
    `DistributedOptimizer.set_replicated_variables`). Without this callback training is
    just as exact, but averages those gradients over the whole world and lets each rank
    draw its own dropout masks in the head.

    `SpatialStrategy.callbacks` adds it. Does nothing on a world of one rank or without
    a spatial split.

    Args:
        strategy: the `SpatialStrategy`.
    """

    def __init__(self, strategy):
        super().__init__()
        self.strategy = strategy

    def on_train_begin(self, logs=None):
        if self.strategy.size == 1 or self.strategy.spatial_size == 1 or self.model is None:
            return
        layers = replicated_layers(self.model, self.strategy)
        self._align_seeds(layers)
        optimizer = getattr(self.model, "optimizer", None)
        if isinstance(optimizer, DistributedOptimizer):
            optimizer.set_replicated_variables(
                v for layer in layers for v in layer.trainable_variables
            )

    def _align_seeds(self, layers) -> None:
        states = [
            generator.state
            for layer in layers
            for generator in getattr(layer, "_seed_generators", [])
        ]
        # Every rank of the world joins, with the same number of states per rank (the
        # model is the same everywhere).
        if not states:
            return
        first = self.strategy.spatial_index == 0
        flat = np.concatenate([np.asarray(s.numpy(), np.float64).ravel() for s in states])
        chosen = self.strategy.allreduce(flat if first else np.zeros_like(flat), "sum", "spatial")
        chosen = chosen.numpy()
        offset = 0
        for state in states:
            size = int(np.prod(state.shape))
            state.assign(chosen[offset:offset + size].reshape(state.shape).astype(state.dtype))
            offset += size


class RecomputeBatchNormStatistics(keras.callbacks.Callback):
    """Recompute batch normalization's moving statistics before the last validation.

    At the end of the last epoch of `fit` (or of every epoch with `every_epoch=True`),
    before its validation, replaces the moving statistics of every batch normalization
    by the average batch statistics of the final weights over `dataset`
    (`keras_spatial.recompute_batch_norm_statistics`, "precise BN"). The validation
    metrics, `History`, and a `ModelCheckpoint` after this callback then see the model
    as it will be used for inference. Without validation data it runs in `on_epoch_end`:
    put it before `ModelCheckpoint` in the list.

    Args:
        dataset: batches of training data for the pass, a dataset of its OWN (not the
            one `fit` iterates; e.g. `strategy.distribute_dataset(files, batch_size,
            shuffle=False)`).
        steps: batches per pass. Defaults to all of the dataset.
        every_epoch: recompute after every epoch, not only the last (costs a forward
            pass of `steps` batches each epoch). Defaults to False.
        verbose: 1 prints one line per pass on rank 0. Defaults to 1.

    Raises:
        ValueError: (at the start of `fit`) if the model has no trainable batch
            normalization, or `steps` is not a positive integer.

    Example:
    ```python
    stats_ds = strategy.distribute_dataset(train_files, batch_size=4, shuffle=False)
    model.fit(train_ds, validation_data=val_ds, epochs=16, callbacks=strategy.callbacks(
        keras_spatial.callbacks.RecomputeBatchNormStatistics(stats_ds),
        keras.callbacks.ModelCheckpoint("model.keras")))
    ```
    """

    def __init__(self, dataset, steps=None, every_epoch: bool = False, verbose: int = 1):
        super().__init__()
        check_steps(steps)
        self.dataset = dataset
        self.steps = steps
        self.every_epoch = bool(every_epoch)
        self.verbose = verbose
        self._fitting = False
        self._epoch = None
        self._done = True

    def on_train_begin(self, logs=None):
        if not batch_norm_layers(self.model):
            raise ValueError(
                "RecomputeBatchNormStatistics: the model has no trainable BatchNormalization "
                f"layer. Received: model={self.model.name!r}"
            )
        self._fitting = True

    def on_train_end(self, logs=None):
        self._fitting = False

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        last = self.params.get("epochs") if self.params else None
        self._done = not (self.every_epoch or last is None or epoch == last - 1)

    def on_test_begin(self, logs=None):
        # `fit` runs its validation through `evaluate`, which calls this first.
        if self._fitting and not self._done:
            self._recompute()

    def on_epoch_end(self, epoch, logs=None):
        if not self._done:  # no validation this epoch
            self._recompute()

    def _recompute(self) -> None:
        start = time.perf_counter()
        used = recompute_batch_norm_statistics(self.model, self.dataset, self.steps)
        self._done = True
        strategy = get_strategy()
        if self.verbose and (strategy is None or strategy.rank == 0):
            print(f"RecomputeBatchNormStatistics: epoch {self._epoch + 1}, moving statistics "
                  f"from {used} batches ({time.perf_counter() - start:.1f} s)", flush=True)


def _is_number(value) -> bool:
    if isinstance(value, numbers.Number):
        return True
    shape = getattr(value, "shape", None)
    return shape is not None and tuple(shape) == () and hasattr(value, "dtype")


def rank_zero_callbacks(callbacks, rank: int) -> list:
    """`callbacks` without the file-writing ones on ranks other than 0."""
    if rank == 0:
        return list(callbacks)
    return [c for c in callbacks if not isinstance(c, WRITING_CALLBACKS)]
