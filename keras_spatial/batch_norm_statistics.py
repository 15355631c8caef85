"""Batch normalization's moving statistics recomputed from the trained weights.

During training a batch-normalization layer normalizes with the statistics of the
current batch and keeps, for inference, an exponential moving average of them. That
average mixes statistics of earlier weights: when the weights still change quickly
(a short training, a high learning rate) or the batch statistics themselves jump from
batch to batch (few large samples, e.g. 4 whole universes of a cosmology run), the
moving statistics lag the network and inference drifts from what training saw.
`recompute_batch_norm_statistics` replaces them by the average of the batch statistics
of the FINAL weights over a pass of training data ("precise BN"; Wu and Johnson,
"Rethinking 'Batch' in BatchNorm", 2021). `keras_spatial.callbacks.RecomputeBatchNormStatistics`
does it inside `model.fit`, before the last validation.
"""

from __future__ import annotations

from typing import Optional

import keras
import numpy as np
import tensorflow as tf

from keras_spatial.context import get_strategy


def batch_norm_layers(model) -> list:
    """The trainable `keras.layers.BatchNormalization` layers of `model` (including
    `SpatialBatchNormalization` and layers of nested models), in model order.

    Frozen layers (`trainable=False`) are left out: Keras runs them in inference mode
    even in training, so their moving statistics never change.
    """
    found, seen = [], set()

    def walk(layer):
        if id(layer) in seen:
            return
        seen.add(id(layer))
        if isinstance(layer, keras.layers.BatchNormalization):
            if layer.trainable:
                found.append(layer)
            return
        for inner in getattr(layer, "layers", ()):
            walk(inner)

    for layer in model.layers:
        walk(layer)
    return found


def check_steps(steps) -> None:
    """Raises ValueError unless `steps` is None or a positive integer (not a bool)."""
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, (int, np.integer))
                              or steps < 1):
        raise ValueError(f"`steps` must be a positive integer or None. Received: steps={steps!r}")


def recompute_batch_norm_statistics(model, dataset, steps: Optional[int] = None) -> int:
    """Set the moving statistics of every batch normalization of `model` to the average
    batch statistics of its current weights over `steps` batches of `dataset`.

    Each batch runs forward in training mode (no weight changes): every layer is then
    normalized by its batch's statistics, as in training, and reports them. The moving
    mean becomes the mean of the batch means (over equal batches: the mean of all the
    voxels seen) and the moving variance the mean of the batch variances, the quantity
    the layer's moving average estimates. The momentum and every other setting of the
    layers are kept. On several ranks, every rank must call it with the same number of
    steps (a dataset of `SpatialStrategy.distribute_dataset`, whose batches are local
    shards); `SpatialBatchNormalization` then takes its statistics over the volumes and
    the global batch exactly as in training, and the results are averaged over the
    world at the end so that they stay identical on every rank even where a layer sees
    rank-dependent inputs (e.g. after a dropout that is not aligned).

    Use a dataset of its own (not the one `fit` iterates): iterating a
    `distribute_dataset` advances its epoch counter, i.e. its shuffling and
    augmentation. Dropout layers draw masks during the pass, which moves their random
    streams on (the same way on every rank of a spatial group).

    Args:
        model: a built Keras model.
        dataset: a `tf.data.Dataset` (or iterable) of `x` or `(x, y[, sample_weight])`
            batches, as `model.fit` takes; only `x` is used.
        steps: batches to use. Defaults to all of a finite dataset.

    Returns:
        The number of batches used.

    Raises:
        ValueError: if `model` has no trainable batch normalization, `steps` is not a
            positive integer, the dataset is infinite without `steps`, or it yields no
            batch.

    Example:
    ```python
    stats_ds = strategy.distribute_dataset(train_files, batch_size=4, shuffle=False)
    keras_spatial.recompute_batch_norm_statistics(model, stats_ds)
    model.evaluate(val_ds)
    ```
    """
    layers = batch_norm_layers(model)
    if not layers:
        raise ValueError(
            "recompute_batch_norm_statistics: the model has no trainable BatchNormalization "
            f"layer, so there are no moving statistics to recompute. Received: model={model.name!r}"
        )
    check_steps(steps)
    if steps is None and isinstance(dataset, tf.data.Dataset):
        cardinality = int(dataset.cardinality())
        if cardinality == tf.data.INFINITE_CARDINALITY:
            raise ValueError("the dataset is infinite (e.g. `.repeat()`); give `steps`")
    momenta = [layer.momentum for layer in layers]
    originals = [[keras.ops.convert_to_numpy(v) for v in (layer.moving_mean, layer.moving_variance)]
                 for layer in layers]
    sums = [[np.zeros(layer.moving_mean.shape, np.float64),
             np.zeros(layer.moving_variance.shape, np.float64)] for layer in layers]
    used = 0
    completed = False
    try:
        for layer in layers:
            # With momentum 0 each training-mode call leaves the batch's statistics in
            # the moving variables (a fresh tf.function traces it with this value).
            layer.momentum = 0.0
        forward = tf.function(lambda x: model(x, training=True))
        for batch in dataset:
            if steps is not None and used == steps:
                break
            x = batch[0] if isinstance(batch, (tuple, list)) else batch
            forward(x)
            for layer, (mean_sum, variance_sum) in zip(layers, sums):
                mean_sum += keras.ops.convert_to_numpy(layer.moving_mean)
                variance_sum += keras.ops.convert_to_numpy(layer.moving_variance)
            used += 1
        completed = used > 0
    finally:
        for layer, momentum, saved in zip(layers, momenta, originals):
            layer.momentum = momentum
            if not completed:  # an error or no batch: the statistics as they were
                layer.moving_mean.assign(saved[0])
                layer.moving_variance.assign(saved[1])
    if used == 0:
        raise ValueError("recompute_batch_norm_statistics: the dataset yielded no batch")
    flat = np.concatenate([part.ravel() / used for pair in sums for part in pair])
    strategy = get_strategy()
    if strategy is not None and strategy.size > 1:
        flat = strategy.allreduce(flat, "average", "world").numpy()
    offset = 0
    for layer in layers:
        for variable in (layer.moving_mean, layer.moving_variance):
            size = int(np.prod(variable.shape))
            variable.assign(flat[offset:offset + size].reshape(variable.shape).astype(variable.dtype))
            offset += size
    return used
