"""3D U-Net (Çiçek et al. 2016, as in LBANN's applications/segmentation/unet3d).

Every layer is spatial: the output is one class-probability vector per voxel, sharded
like the input, so the whole network runs split across a spatial group (the paper splits
every layer along depth) and a saved model reloads in one process as a whole-volume model.

With `depth` = number of poolings and `F` = `base_filters`, encoder level l (0-based)
is two [Conv3D 3^3 'same' -> BatchNorm -> ReLU] blocks of F*2^l and F*2^(l+1) filters,
whose output is kept for the skip connection, then MaxPool 2^3. The bottom level has
F*2^depth and F*2^(depth+1) filters. Decoder level l (from depth-1 up to 0):
Conv3DTranspose 2^3 stride 2 with as many filters as it receives, concatenation with the
skip of level l, two conv blocks of F*2^(l+1) filters. Output: Conv3D 1^3 to `classes`,
softmax over classes. The paper's network (docs/science.md) is `depth=3, base_filters=32`:
encoder (32, 64), (64, 128), (128, 256), bottom (256, 512), decoder transposes of 512,
256 and 128 filters and convs (256, 256), (128, 128), (64, 64): 19,065,888 kernel
weights for one input channel and 3 classes, 19,076,131 parameters in all with batch
norm (4 numbers per channel, transposed and output convolutions with a bias) and
19,069,123 without (every convolution with a bias) - docs/science.md's "about 19 M".

Convolutions followed by batch norm have no bias (the norm's offset replaces it); without
batch norm they have one. The transposed convolutions are linear with a bias.

The metric is the Dice score (docs/science.md: per class, 2|P n G| / (|P| + |G|) on the argmax,
background excluded from the mean): `DiceScore` accumulates a confusion matrix of voxel
counts, an additive state, so under `keras_spatial.callbacks.MetricAverage` it is the
exact Dice of all voxels of all ranks; `confusion_matrix` and `dice_from_confusion` are
the same computation in NumPy.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import keras
import numpy as np
from keras import ops

import keras_spatial as ks

CONV_KERNEL = 3
POOL = 2
MIN_CLASSES = 2


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def normalize_input_shape(input_shape: Union[int, Sequence[int]]) -> tuple[int, int, int, int]:
    """The global sample shape (D, H, W, C) from an int W (a W^3 volume, 1 channel)
    or four positive ints.

    Raises:
        ValueError: for anything else.

    Example:
    >>> normalize_input_shape(32)
    (32, 32, 32, 1)
    """
    if _is_int(input_shape):
        shape = (input_shape,) * 3 + (1,)
    elif isinstance(input_shape, (tuple, list)) and all(_is_int(v) for v in input_shape):
        shape = tuple(input_shape)
    else:
        shape = ()
    if len(shape) != 4 or min(shape) < 1:
        raise ValueError(
            "`input_shape` must be one positive integer W (a W^3 volume with one channel) "
            "or four positive integers (depth, height, width, channels). "
            f"Received: input_shape={input_shape!r}"
        )
    return shape


def check_arguments(
    input_shape: Union[int, Sequence[int]], classes: int, depth: int, base_filters: int
) -> tuple[int, int, int, int]:
    """Validates `build_model`'s arguments; returns the normalized input shape.

    Raises:
        ValueError: naming the argument, what was expected and the value received.
    """
    shape = normalize_input_shape(input_shape)
    if not _is_int(classes) or classes < MIN_CLASSES:
        raise ValueError(
            f"`classes` must be an integer of at least {MIN_CLASSES} (background and one "
            f"foreground class). Received: classes={classes!r}"
        )
    if not _is_int(depth) or depth < 1:
        raise ValueError(
            f"`depth` (the number of 2x poolings) must be a positive integer. "
            f"Received: depth={depth!r}"
        )
    if not _is_int(base_filters) or base_filters < 1:
        raise ValueError(
            f"`base_filters` must be a positive integer. Received: base_filters={base_filters!r}"
        )
    factor = POOL**depth
    bad = [extent for extent in shape[:3] if extent % factor]
    if bad:
        raise ValueError(
            f"Each spatial extent must be divisible by 2**depth = {factor} so that every "
            "pooling halves it exactly and the up-sampled features align with their skips. "
            f"Received: input_shape={shape}, depth={depth}"
        )
    return shape


def check_split(
    input_shape: Union[int, Sequence[int]], depth: int, spatial_shape: Sequence[int]
) -> None:
    """Checks that every shard of a U-Net of `depth` poolings holds at least one plane.

    The extents halve at every pooling, so the smallest is the bottom one,
    extent / 2**depth; it need not divide by the shards (uneven shards,
    `keras_spatial.halo.split_bounds`), but it must be at least their number along every
    split axis. `build_model` calls it under a spatial strategy; the layers would refuse
    such a layout too, at build time, naming the first pooling that fails.

    Args:
        input_shape: as for `build_model`.
        depth: number of 2x poolings.
        spatial_shape: shards along (depth, height, width).

    Raises:
        ValueError: naming the axis, the extents, the split and the largest depth
            that would fit.

    Example:
    >>> check_split(16, 3, (2, 1, 1))   # bottom extent 2 over 2 shards: fine
    >>> check_split(40, 3, (2, 1, 1))   # bottom extent 5 over 2 shards: 3 and 2 planes
    """
    shape = normalize_input_shape(input_shape)
    for axis, (extent, shards) in enumerate(zip(shape[:3], spatial_shape)):
        bottom = extent // POOL**depth
        if bottom < shards:
            fitting = 0
            while extent // POOL ** (fitting + 1) >= shards and extent % POOL ** (fitting + 1) == 0:
                fitting += 1
            hint = f"Use depth <= {fitting}," if fitting else "No depth >= 1 fits; use"
            raise ValueError(
                f"A U-Net of depth {depth} reduces the {('depth', 'height', 'width')[axis]} "
                f"extent {extent} to {bottom} at its bottom, fewer planes than its "
                f"{shards} shards. {hint} a larger volume or a smaller split along "
                f"that axis. Received: input_shape={shape}, depth={depth}, "
                f"spatial_shape={tuple(spatial_shape)}"
            )


def _conv_block(x, filters: int, batch_norm: bool, momentum: float, name: str):
    x = ks.layers.SpatialConv3D(
        filters, CONV_KERNEL, padding="same", use_bias=not batch_norm, name=f"{name}_conv"
    )(x)
    if batch_norm:
        x = ks.layers.SpatialBatchNormalization(momentum=momentum, name=f"{name}_bn")(x)
    return keras.layers.ReLU(name=f"{name}_relu")(x)


def build_model(
    input_shape: Union[int, Sequence[int]] = 64,
    classes: int = 3,
    depth: int = 3,
    base_filters: int = 32,
    batch_norm: bool = True,
    name: Optional[str] = None,
    batch_norm_momentum: float = 0.9,
) -> keras.Model:
    """The 3D U-Net for volumes of GLOBAL shape `input_shape`.

    Build it inside `strategy.scope()` for a spatially split model (every layer is
    split; each rank feeds its shard and gets its shard of the probabilities), or with
    no spatial strategy for a model that is plain Keras in all but class names.

    Args:
        input_shape: `(D, H, W, C)` of one sample, or one int W for `(W, W, W, 1)`.
            Each of D, H, W must be divisible by 2**depth. Defaults to 64.
        classes: number of classes (background included), at least 2. Defaults to 3.
        depth: number of 2x max-poolings (and of up-sampling steps). Defaults to 3,
            the paper's.
        base_filters: filters F of the first convolution; level l uses F*2^l and
            F*2^(l+1). Defaults to 32, the paper's.
        batch_norm: put a `SpatialBatchNormalization` (statistics over the whole
            global batch) between every 3^3 convolution and its ReLU. Defaults to True.
        name: model name. Defaults to "unet3d_d{depth}_f{base_filters}".
        batch_norm_momentum: momentum of the moving statistics. Defaults to 0.9
            (LBANN's decay; Keras's 0.99 leaves the inference statistics near their
            initial values during short runs).

    Input shape:
        GLOBAL `(batch, D, H, W, C)`; each rank feeds its LOCAL shard.

    Output shape:
        `(batch, D, H, W, classes)` softmax probabilities, LOCAL (sharded like the
        input) under a spatial strategy.

    Returns:
        A functional, uncompiled `keras.Model` (the paper trains it with per-voxel
        cross-entropy and Adam 1e-3).

    Raises:
        ValueError: for a bad argument or an extent not divisible by 2**depth; under a
            spatial strategy, also when a bottom extent (extent / 2**depth) is smaller
            than the split along its axis (see `check_split`).

    Example:
    ```python
    model = build_model((64, 64, 64, 1))           # the paper's network, 19,076,131 parameters
    with strategy.scope():                         # e.g. spatial_shape=(2, 1, 1)
        model = build_model(32, depth=2, base_filters=8)
    ```
    """
    shape = check_arguments(input_shape, classes, depth, base_filters)
    strategy = ks.get_strategy()
    if strategy is not None and strategy.is_spatial:
        check_split(shape, depth, strategy.spatial_shape)
    batch_norm = bool(batch_norm)
    if not 0.0 <= batch_norm_momentum < 1.0:
        raise ValueError(
            "`batch_norm_momentum` must be in [0, 1). "
            f"Received: batch_norm_momentum={batch_norm_momentum!r}"
        )
    inputs = ks.Input(shape, name="image")
    x = inputs
    skips = []
    for level in range(depth):
        filters = base_filters * 2**level
        x = _conv_block(x, filters, batch_norm, batch_norm_momentum, f"down{level}_a")
        x = _conv_block(x, 2 * filters, batch_norm, batch_norm_momentum, f"down{level}_b")
        skips.append(x)
        x = ks.layers.SpatialMaxPooling3D(POOL, name=f"down{level}_pool")(x)
    bottom = base_filters * 2**depth
    x = _conv_block(x, bottom, batch_norm, batch_norm_momentum, "bottom_a")
    x = _conv_block(x, 2 * bottom, batch_norm, batch_norm_momentum, "bottom_b")
    for level in reversed(range(depth)):
        x = ks.layers.SpatialConv3DTranspose(
            x.shape[-1], POOL, strides=POOL, name=f"up{level}_transpose"
        )(x)
        x = keras.layers.Concatenate(name=f"up{level}_concat")([x, skips[level]])
        filters = base_filters * 2 ** (level + 1)
        x = _conv_block(x, filters, batch_norm, batch_norm_momentum, f"up{level}_a")
        x = _conv_block(x, filters, batch_norm, batch_norm_momentum, f"up{level}_b")
    logits = ks.layers.SpatialConv3D(classes, 1, name="logits")(x)
    probabilities = keras.layers.Softmax(axis=-1, dtype="float32", name="probabilities")(logits)
    return keras.Model(inputs, probabilities, name=name or f"unet3d_d{depth}_f{base_filters}")


def confusion_matrix(labels: np.ndarray, predicted: np.ndarray, classes: int) -> np.ndarray:
    """Voxel counts of (true, predicted) class pairs.

    Args:
        labels: integer class labels, any shape.
        predicted: predicted classes, the shape of `labels`.
        classes: number of classes.

    Returns:
        `[classes, classes]` float64; entry [t, p] counts voxels of class t predicted p.
    """
    pairs = np.asarray(labels, np.int64).ravel() * classes + np.asarray(predicted, np.int64).ravel()
    counts = np.bincount(pairs, minlength=classes * classes)
    return counts.reshape(classes, classes).astype(np.float64)


def dice_from_confusion(confusion: np.ndarray) -> np.ndarray:
    """Per-class Dice 2|P n G| / (|P| + |G|) from a confusion matrix.

    Args:
        confusion: `[classes, classes]` voxel counts (entry [t, p]: true t, predicted
            p), or any common multiple of them (e.g. totals / world size).

    Returns:
        `[classes]` float64; a class absent from both truth and prediction scores 1.

    Example:
    >>> dice_from_confusion(np.array([[3.0, 1.0], [0.0, 2.0]])).round(3).tolist()
    [0.857, 0.8]
    """
    confusion = np.asarray(confusion, dtype=np.float64)
    overlap = 2.0 * np.diag(confusion)
    sizes = confusion.sum(axis=0) + confusion.sum(axis=1)
    return np.where(sizes > 0, overlap / np.where(sizes > 0, sizes, 1.0), 1.0)


@keras.saving.register_keras_serializable(package="unet3d")
class DiceScore(keras.metrics.Metric):
    """Dice score on the argmax, from a confusion matrix over every voxel seen.

    The state is one `[classes, classes]` matrix of voxel counts. It is additive, which
    is what `keras_spatial.callbacks.MetricAverage` needs: after every batch that
    callback replaces each rank's state by the world average of the states. If all
    ranks hold T / W before a batch (T: the world's counts so far, W: the world size)
    and rank r adds its counts c_r, the average is (T + sum_r c_r) / W, so the state
    is always the world's total counts divided by W, identical on every rank. The
    Dice ratios do not depend on that common factor: the result (and so the epoch's
    logs, History and validation metrics, which Keras reads from the states) is the
    exact Dice of all voxels of all ranks - a global Dice, not an average of per-rank
    or per-batch scores. In one process it is the Dice of all voxels seen since the
    last reset. Float states matter: an integer state would be truncated by the
    average.

    Args:
        classes: number of classes (background is class 0). Defaults to 3.
        class_id: the class whose Dice is the result; None for the mean over the
            foreground classes 1 .. classes-1. Defaults to None.
        name: metric name. Defaults to "dice" or "dice_{class_id}".
        dtype: dtype of the state and the result. Defaults to "float64", so that counts
            stay exact beyond 2**24 voxels.

    Input shape:
        `y_true`: integer labels `(batch, d, h, w)` (or with a trailing axis of 1);
        `y_pred`: class scores `(batch, d, h, w, classes)`; LOCAL shards in a spatial
        model. `sample_weight` is not supported.

    Raises:
        ValueError: for `classes` < 2 or `class_id` out of range; in `update_state`,
            if a `sample_weight` is given.

    Example:
    ```python
    model.compile(loss="sparse_categorical_crossentropy",
                  metrics=[DiceScore(3), DiceScore(3, class_id=1)])
    ```
    """

    def __init__(self, classes=3, class_id=None, name=None, dtype="float64"):
        if not _is_int(classes) or classes < MIN_CLASSES:
            raise ValueError(
                f"`classes` must be an integer of at least {MIN_CLASSES}. Received: classes={classes!r}"
            )
        if class_id is not None and (not _is_int(class_id) or not 0 <= class_id < classes):
            raise ValueError(
                f"`class_id` must be None or an integer in [0, {classes}). "
                f"Received: class_id={class_id!r}"
            )
        default_name = "dice" if class_id is None else f"dice_{class_id}"
        super().__init__(name=name or default_name, dtype=dtype)
        self.classes = classes
        self.class_id = class_id
        self.confusion = self.add_variable(
            shape=(classes, classes), initializer="zeros", dtype=self.dtype, name="confusion"
        )

    def update_state(self, y_true, y_pred, sample_weight=None):
        """Adds the (true, argmax) voxel counts of one batch to the state."""
        if sample_weight is not None:
            raise ValueError("DiceScore does not support `sample_weight`. Received: a sample_weight.")
        y_true = ops.convert_to_tensor(y_true)
        if len(y_true.shape) == len(y_pred.shape):
            y_true = ops.squeeze(y_true, axis=-1)
        truth = ops.cast(y_true, "int32")
        predicted = ops.cast(ops.argmax(y_pred, axis=-1), "int32")
        pairs = ops.reshape(truth * self.classes + predicted, (-1,))
        counts = ops.bincount(pairs, minlength=self.classes * self.classes)
        counts = ops.reshape(ops.cast(counts, self.dtype), (self.classes, self.classes))
        self.confusion.assign_add(counts)

    def result(self):
        """The Dice of `class_id`, or the mean foreground Dice."""
        confusion = ops.convert_to_tensor(self.confusion)
        overlap = 2.0 * ops.diagonal(confusion)
        sizes = ops.sum(confusion, axis=0) + ops.sum(confusion, axis=1)
        dice = ops.where(sizes > 0, overlap / ops.maximum(sizes, 1.0), ops.ones_like(sizes))
        if self.class_id is None:
            return ops.mean(dice[1:])
        return dice[self.class_id]

    def get_config(self):
        """The constructor arguments (JSON-able)."""
        return {"classes": self.classes, "class_id": self.class_id, "name": self.name,
                "dtype": self.dtype}


def dice_metrics(classes: int = 3) -> list:
    """The recipe's metrics: `dice` (mean over the foreground classes) and the per-class
    `dice_0` (background) ... `dice_{classes-1}`, each a `DiceScore`."""
    return [DiceScore(classes)] + [DiceScore(classes, class_id=c) for c in range(classes)]
