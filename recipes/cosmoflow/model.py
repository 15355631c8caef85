"""CosmoFlow models: the paper's network (Oyama et al. 2020, LBANN) and MLPerf HPC's.

Both are built from keras_spatial layers up to a `SpatialFlatten`, then a replicated
dense head, so the same function gives a spatially split model (inside a strategy's
`scope()`) and, with no spatial strategy, a model equivalent to plain Keras
(`keras_spatial.to_keras_model` of it has the same layers and weights).

"paper" (Oyama et al. 2020, the LBANN application): every conv has kernel 3, 'same', no bias,
Glorot uniform, then (optional batch norm and) LeakyReLU(0.01); every pool is AVERAGE,
window 3, stride 2, 'same'. Seven blocks of 16, 32, 64, 128 (conv stride 2), 256, 256, 256
filters; blocks 1-3 always pool; the pools of blocks 4-7 are applied only while the depth
extent entering them is above 2. That rule reproduces the table exactly (128^3: blocks 6
and 7 have no pool; 256^3: block 7 has none; 512^3: all pool) and is the generalisation
used for every other W in [32, 512] (e.g. 64^3: blocks 5-7 have no pool; 32^3: blocks 4-7
have none). The last volume is then always 2^3 x 256 = 2048 features, so the parameter
count is the same at every W: 9,437,636 (4,715,712 conv + 4,721,924 dense; batch norm adds
2 trainable + 2 statistics per channel). Head: Dropout -> Dense 2048 -> LeakyReLU ->
Dropout -> Dense 256 -> LeakyReLU -> Dropout -> Dense 4 (linear).

"mlperf" (MLPerf HPC's reference, mlcommons/hpc `cosmoflow/models/cosmoflow.py` with
`configs/cosmo.yaml`): 5 x [Conv3D(32*2^i, kernel 2, 'same', bias) -> LeakyReLU(0.3) ->
MaxPool3D(2)], Flatten, Dense 128 -> LeakyReLU(0.3) -> Dropout(0.5) -> Dense 64 ->
LeakyReLU(0.3) -> Dropout(0.5) -> Dense 4 tanh -> Rescaling(1.2): 5,597,604 parameters at
128^3. The even kernel with 'same' padding pads one voxel after each axis and none before
(Keras's rule), so its spatial split exchanges a one-sided halo. W must be a multiple of 32
(five 2x pools); the first dense layer grows with W ((W/32)^3 x 512 inputs). The input is
expected as log(1 + counts); that transform belongs to the data pipeline, not the model.

`head="gap"` (either variant) replaces the flatten by a global average over the last
volume (`SpatialGlobalAveragePooling3D`, or Keras's after a gather): the head then sees
the trunk's features averaged over the whole sample (256 of them for "paper", 512 for
"mlperf") instead of their 2^3 (or (W/32)^3) positions. The trunk is unchanged.
`head="gap-bn"` adds a `SpatialBatchNormalization` of those averages (statistics over the
global batch): the parameters live in small differences of the averages between samples
(a few percent of their value), which the normalization brings to unit scale.

Both variants can start with a fixed per-channel standardization (`input_mean`,
`input_std`: a `keras.layers.Normalization` with constant statistics, voxel by voxel, so
it runs on shards unchanged). Raw log counts have a mean near log(1 + mean count), about
4, and the paper's network without batch norm does not get past predicting the mean label
from them in a short run; standardized inputs train (docs/cosmoflow_claim.md).
"""

from __future__ import annotations

from typing import Optional

import keras
import numpy as np

import keras_spatial as ks
from keras_spatial import layers as ks_layers

VARIANTS = ("paper", "mlperf")
HEADS = ("flatten", "gap", "gap-bn")
MIN_SIZE, MAX_SIZE = 32, 512
PAPER_FILTERS = (16, 32, 64, 128, 256, 256, 256)
PAPER_CONV_STRIDES = (1, 1, 1, 2, 1, 1, 1)
PAPER_ALWAYS_POOLED_BLOCKS = 3
PAPER_FINAL_EXTENT = 2
PAPER_DROPOUT = 0.2
PAPER_NEGATIVE_SLOPE = 0.01
MLPERF_DROPOUT = 0.5
MLPERF_NEGATIVE_SLOPE = 0.3
MLPERF_BLOCKS = 5
MLPERF_KERNEL = 2
# Moving statistics decay of the optional batch norm (LBANN's 0.9): short CPU runs take only a
# few hundred steps, too few for Keras's 0.99 to forget the initial (0, 1) statistics.
BATCH_NORM_MOMENTUM = 0.9
# Batch renormalization (Ioffe 2017) of the trunk's batch norms: the clipping and the
# momentum of the statistics the corrections r and d are computed from.
BATCH_RENORM_CLIPPING = {"rmin": 1.0 / 3.0, "rmax": 3.0, "dmax": 5.0}
BATCH_RENORM_MOMENTUM = 0.99


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_arguments(input_size, variant, channels, dropout, outputs) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"`variant` must be one of {VARIANTS}. Received: variant={variant!r}")
    if not _is_int(input_size) or not MIN_SIZE <= input_size <= MAX_SIZE:
        raise ValueError(
            f"`input_size` must be an integer from {MIN_SIZE} to {MAX_SIZE} (the paper's "
            f"table gives 128, 256 and 512). Received: input_size={input_size!r}"
        )
    if variant == "mlperf" and input_size % 2**MLPERF_BLOCKS:
        raise ValueError(
            f"The 'mlperf' variant pools by 2 five times: `input_size` must be a multiple "
            f"of {2**MLPERF_BLOCKS} (32, 64, 96, 128, ..., 512). Received: "
            f"input_size={input_size}, variant='mlperf'"
        )
    if not _is_int(channels) or channels < 1:
        raise ValueError(f"`channels` must be a positive integer. Received: channels={channels!r}")
    if not _is_int(outputs) or outputs < 1:
        raise ValueError(f"`outputs` must be a positive integer. Received: outputs={outputs!r}")
    if dropout is not None and (
        isinstance(dropout, bool)
        or not isinstance(dropout, (int, float))
        or not 0.0 <= dropout < 1.0
    ):
        raise ValueError(f"`dropout` must be a number in [0, 1). Received: dropout={dropout!r}")


def _standardization(mean, std, channels: int):
    if mean is None and std is None:
        return None
    if mean is None or std is None:
        raise ValueError(
            "`input_mean` and `input_std` go together. "
            f"Received: input_mean={mean!r}, input_std={std!r}"
        )
    values = []
    for label, given in (("input_mean", mean), ("input_std", std)):
        flat = [float(v) for v in (given if hasattr(given, "__len__") else [given])]
        if len(flat) == 1:
            flat = flat * channels
        if len(flat) != channels or not all(v == v and abs(v) != float("inf") for v in flat):
            raise ValueError(
                f"`{label}` must be one finite number or {channels} (one per channel). "
                f"Received: {label}={given!r}"
            )
        values.append(flat)
    if min(values[1]) <= 0:
        raise ValueError(f"`input_std` must be positive. Received: input_std={std!r}")
    return values[0], values[1]


def _whitening(whitening, channels: int):
    if whitening is None:
        return None
    try:
        mean, matrix = whitening
        mean = np.asarray(mean, dtype=np.float64).reshape(-1)
        matrix = np.asarray(matrix, dtype=np.float64)
    except (TypeError, ValueError):
        mean = matrix = None
    if (mean is None or mean.shape != (channels,) or matrix.shape != (channels, channels)
            or not (np.all(np.isfinite(mean)) and np.all(np.isfinite(matrix)))):
        raise ValueError(
            f"`input_whitening` must be a pair (mean, matrix) of {channels} finite means and a "
            f"finite {channels} x {channels} matrix. Received: input_whitening={whitening!r}"
        )
    return mean, matrix


def whitening_statistics(samples) -> tuple[list, list]:
    """The channel means and the ZCA whitening matrix of voxels, for `input_whitening`.

    The log counts of the 4 redshift channels are about 95% correlated voxel by voxel
    (covariance eigenvalues about 3.2, 0.05, 0.04 and 0.02), and the parameters sit in
    the small differences between channels. W = U diag(1 / sqrt(e)) U^T (e, U: the
    eigenvalues and eigenvectors of the channel covariance) gives every direction unit
    variance while staying as close as possible to the input (ZCA), so those
    differences reach the first convolution at the scale of the common signal.

    Args:
        samples: an iterable of arrays whose last axis is the channels (voxels in any
            shape before it), e.g. preprocessed training universes.

    Returns:
        (mean, matrix) as lists: `channels` means and the `channels` x `channels` W.

    Raises:
        ValueError: if there are no voxels, or the covariance is singular (a channel
            constant or a copy of the others).
    """
    total = outer = None
    voxels = 0
    for sample in samples:
        flat = np.asarray(sample, dtype=np.float64).reshape(-1, np.shape(sample)[-1])
        total = flat.sum(axis=0) if total is None else total + flat.sum(axis=0)
        outer = flat.T @ flat if outer is None else outer + flat.T @ flat
        voxels += flat.shape[0]
    if not voxels:
        raise ValueError("whitening_statistics needs at least one voxel. Received: no samples")
    mean = total / voxels
    covariance = outer / voxels - np.outer(mean, mean)
    eigenvalues, eigenvectors = np.linalg.eigh(covariance)
    if not eigenvalues[0] > 1e-12 * max(eigenvalues[-1], 1e-300):
        raise ValueError(
            "The channel covariance of the samples is singular (a channel is constant or a "
            f"combination of the others): eigenvalues {eigenvalues.tolist()}"
        )
    matrix = eigenvectors @ np.diag(eigenvalues ** -0.5) @ eigenvectors.T
    return mean.tolist(), matrix.tolist()


def paper_pooled_blocks(input_size: int) -> tuple[bool, ...]:
    """Which of the paper model's 7 blocks end with a pool at cubic size `input_size`.

    Blocks 1-3 always pool; blocks 4-7 pool only while the extent entering the pool is
    above 2 ('same' pooling with stride 2 gives ceil(extent / 2)).

    Example:
    >>> paper_pooled_blocks(128)
    (True, True, True, True, True, False, False)
    """
    extent, pooled = input_size, []
    for block, stride in enumerate(PAPER_CONV_STRIDES):
        extent = -(-extent // stride)
        pool = block < PAPER_ALWAYS_POOLED_BLOCKS or extent > PAPER_FINAL_EXTENT
        if pool:
            extent = -(-extent // 2)
        pooled.append(pool)
    return tuple(pooled)


def _head_input(x, head: str, gathered: bool):
    """The trunk's last volume as the dense head's input vector."""
    if head in ("gap", "gap-bn"):
        layer = keras.layers.GlobalAveragePooling3D if gathered else ks_layers.SpatialGlobalAveragePooling3D
        x = layer(name="global_average")(x)
        if head == "gap-bn":
            # Statistics over the global batch (exact under any layout): each averaged
            # feature is centred and scaled by its spread over samples.
            x = ks_layers.SpatialBatchNormalization(momentum=BATCH_NORM_MOMENTUM, name="head_bn")(x)
        return x
    layer = keras.layers.Flatten if gathered else ks_layers.SpatialFlatten
    return layer(name="flatten")(x)


def _trunk_batch_norm(name: str, renorm: bool):
    """The batch norm between a trunk conv and its activation."""
    if not renorm:
        return ks_layers.SpatialBatchNormalization(momentum=BATCH_NORM_MOMENTUM, name=name)
    return ks_layers.SpatialBatchNormalization(
        momentum=BATCH_NORM_MOMENTUM, renorm=True, renorm_clipping=dict(BATCH_RENORM_CLIPPING),
        renorm_momentum=BATCH_RENORM_MOMENTUM, name=name,
    )


def _paper(x, batch_norm: bool, dropout: float, outputs: int, input_size: int, gather_before_block=None,
           head: str = "flatten", batch_renorm: bool = False):
    conv, pool_layer = ks_layers.SpatialConv3D, ks_layers.SpatialAveragePooling3D
    gathered = False
    for block, (filters, stride, pool) in enumerate(
        zip(PAPER_FILTERS, PAPER_CONV_STRIDES, paper_pooled_blocks(input_size)), start=1
    ):
        if block == gather_before_block:
            # Stop splitting: the rest of the trunk runs, replicated, on the whole volume.
            x = ks_layers.SpatialGather(name="gather")(x)
            conv, pool_layer, gathered = keras.layers.Conv3D, keras.layers.AveragePooling3D, True
        x = conv(
            filters,
            3,
            strides=stride,
            padding="same",
            use_bias=False,
            kernel_initializer="glorot_uniform",
            name=f"block{block}_conv",
        )(x)
        if batch_norm:
            x = _trunk_batch_norm(f"block{block}_bn", batch_renorm)(x)
        x = keras.layers.LeakyReLU(negative_slope=PAPER_NEGATIVE_SLOPE, name=f"block{block}_lrelu")(x)
        if pool:
            x = pool_layer(3, strides=2, padding="same", name=f"block{block}_pool")(x)
    x = _head_input(x, head, gathered)
    x = keras.layers.Dropout(dropout, name="head_dropout1")(x)
    x = keras.layers.Dense(2048, name="head_dense1")(x)
    x = keras.layers.LeakyReLU(negative_slope=PAPER_NEGATIVE_SLOPE, name="head_lrelu1")(x)
    x = keras.layers.Dropout(dropout, name="head_dropout2")(x)
    x = keras.layers.Dense(256, name="head_dense2")(x)
    x = keras.layers.LeakyReLU(negative_slope=PAPER_NEGATIVE_SLOPE, name="head_lrelu2")(x)
    x = keras.layers.Dropout(dropout, name="head_dropout3")(x)
    return keras.layers.Dense(outputs, name="head_output")(x)


def _mlperf(x, batch_norm: bool, dropout: float, outputs: int, head: str = "flatten",
            batch_renorm: bool = False):
    for block in range(1, MLPERF_BLOCKS + 1):
        x = ks_layers.SpatialConv3D(32 * 2 ** (block - 1), MLPERF_KERNEL, padding="same",
                                    name=f"block{block}_conv")(x)
        if batch_norm:
            x = _trunk_batch_norm(f"block{block}_bn", batch_renorm)(x)
        x = keras.layers.LeakyReLU(negative_slope=MLPERF_NEGATIVE_SLOPE, name=f"block{block}_lrelu")(x)
        x = ks_layers.SpatialMaxPooling3D(2, name=f"block{block}_pool")(x)
    x = _head_input(x, head, gathered=False)
    x = keras.layers.Dense(128, name="head_dense1")(x)
    x = keras.layers.LeakyReLU(negative_slope=MLPERF_NEGATIVE_SLOPE, name="head_lrelu1")(x)
    x = keras.layers.Dropout(dropout, name="head_dropout1")(x)
    x = keras.layers.Dense(64, name="head_dense2")(x)
    x = keras.layers.LeakyReLU(negative_slope=MLPERF_NEGATIVE_SLOPE, name="head_lrelu2")(x)
    x = keras.layers.Dropout(dropout, name="head_dropout2")(x)
    x = keras.layers.Dense(outputs, activation="tanh", name="head_output")(x)
    return keras.layers.Rescaling(1.2, name="head_scale")(x)


def build_model(
    input_size: int = 128,
    variant: str = "paper",
    channels: int = 4,
    batch_norm: bool = False,
    dropout: Optional[float] = None,
    outputs: int = 4,
    name: Optional[str] = None,
    gather_before_block: Optional[int] = None,
    input_mean=None,
    input_std=None,
    head: str = "flatten",
    input_whitening=None,
    batch_renorm: bool = False,
) -> keras.Model:
    """The CosmoFlow network for a `input_size`^3 x `channels` volume.

    Build it inside `strategy.scope()` for a spatially split model (global shapes are
    written, each rank holds its shard), or with no spatial strategy for a model that
    is plain Keras in all but class names.

    Args:
        input_size: cubic extent W of one sample, an integer in [32, 512] (a multiple
            of 32 for "mlperf"). Defaults to 128.
        variant: "paper" (LBANN, 9.4 M parameters at every W) or "mlperf" (MLPerf HPC
            reference, 5.6 M parameters at 128^3). Defaults to "paper".
        channels: input channels (redshifts). Defaults to 4.
        batch_norm: put a `SpatialBatchNormalization` between every conv and its
            activation. Defaults to False.
        dropout: dropout rate of the head; None takes the variant's (0.2 "paper",
            0.5 "mlperf"). Defaults to None.
        outputs: number of regressed parameters. Defaults to 4.
        name: model name. Defaults to "cosmoflow_{variant}_{W}".
        gather_before_block: "paper" only: gather the volume (`SpatialGather`) before
            this block (2-7) and run the rest of the trunk with plain Keras layers on the
            replicated whole volume, as LBANN stops its split before the last pools. Needed
            for 4-way depth splits, whose last volumes would otherwise go 4 -> 2 across 4
            shards. Defaults to None (split up to the flatten).
        input_mean: per-channel means (a number or `channels` numbers) subtracted from
            the input by a first `Normalization` layer with fixed statistics; given
            together with `input_std`. Defaults to None (no standardization).
        input_std: per-channel standard deviations (positive) the centred input is
            divided by. Defaults to None.
        head: "flatten" (the variant's own: the last volume flattened into the dense
            head), "gap" (its global average over the sample) or "gap-bn" (that average
            batch-normalized). Defaults to "flatten".
        input_whitening: instead of `input_mean` and `input_std`, a pair (mean, matrix)
            of `channels` means and a `channels` x `channels` matrix W: a first,
            non-trainable `Dense` layer maps the channels c of every voxel to
            (c - mean) @ W (see `whitening_statistics`). Defaults to None.
        batch_renorm: with `batch_norm`, make the trunk's batch norms batch
            renormalizations (Ioffe 2017; Keras's `renorm=True` with
            `BATCH_RENORM_CLIPPING` and `BATCH_RENORM_MOMENTUM`): training normalizes by
            moving statistics corrected within the clipping, not by each batch's own.
            Defaults to False.

    Returns:
        A functional `keras.Model` (uncompiled; the paper trains it with MSE and
        Adam 1e-3).

    Raises:
        ValueError: for an unknown variant or an out-of-range argument; under a spatial
            strategy, also when some layer's extent is smaller than its shards
            (see `keras_spatial.plan.plan_for_mesh` to check a mesh beforehand).

    Example:
    ```python
    model = build_model(128)                      # 9,437,636 parameters
    with strategy.scope():                        # e.g. spatial_shape=(2, 1, 1)
        model = build_model(128, batch_norm=True)
    ```
    """
    _check_arguments(input_size, variant, channels, dropout, outputs)
    if gather_before_block is not None and (
        variant != "paper" or not _is_int(gather_before_block) or not 2 <= gather_before_block <= 7
    ):
        raise ValueError(
            "`gather_before_block` must be a block number from 2 to 7 of the 'paper' variant. "
            f"Received: gather_before_block={gather_before_block!r}, variant={variant!r}"
        )
    if head not in HEADS:
        raise ValueError(f"`head` must be one of {HEADS}. Received: head={head!r}")
    if batch_renorm and not batch_norm:
        raise ValueError("`batch_renorm=True` renormalizes the trunk's batch norms; it needs "
                         "`batch_norm=True`. Received: batch_norm=False")
    if dropout is None:
        dropout = PAPER_DROPOUT if variant == "paper" else MLPERF_DROPOUT
    inputs = ks.Input((input_size,) * 3 + (channels,), name="universe")
    x = inputs
    standardization = _standardization(input_mean, input_std, channels)
    whitening = _whitening(input_whitening, channels)
    if whitening is not None and standardization is not None:
        raise ValueError(
            "`input_whitening` replaces `input_mean` and `input_std`; give one or the other. "
            f"Received: input_mean={input_mean!r}, input_std={input_std!r}"
        )
    if whitening is not None:
        mean, matrix = whitening
        layer = keras.layers.Dense(channels, trainable=False, name="input_whitening")
        x = layer(x)
        layer.set_weights([matrix.astype("float32"), (-mean @ matrix).astype("float32")])
    if standardization is not None:
        mean, std = standardization
        x = keras.layers.Normalization(axis=-1, mean=mean, variance=[v * v for v in std],
                                       name="input_standardization")(x)
    if variant == "paper":
        y = _paper(x, bool(batch_norm), float(dropout), outputs, input_size, gather_before_block, head,
                   bool(batch_renorm))
    else:
        y = _mlperf(x, bool(batch_norm), float(dropout), outputs, head, bool(batch_renorm))
    return keras.Model(inputs, y, name=name or f"cosmoflow_{variant}_{input_size}")
