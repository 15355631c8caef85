"""Callbacks that make `model.fit` behave on many ranks as on one."""

from __future__ import annotations

import numbers

import keras
import numpy as np

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
