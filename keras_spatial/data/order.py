"""Which samples each data group reads, step by step. Pure arithmetic, no I/O.

Every rank computes the order itself from `(seed, epoch)`, so the ranks agree without
communicating: all ranks of a spatial group get the same sequence, and the data groups
get disjoint parts of each global batch. Global step `s` of an epoch takes the samples
`order[s*B:(s+1)*B]` of the epoch's global order (B = global batch size); data group
`g` takes the `g`-th of its `data_size` equal parts. Concatenating the groups' batches
in data-group order therefore gives exactly the batch one process would see with
`data_size=1`, which is what makes hybrid runs comparable to single-process runs.
"""

from __future__ import annotations

import math

import numpy as np


def _check_positive(name: str, value: int) -> int:
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise ValueError(f"`{name}` must be a positive integer. Received: {name}={value!r}.")
    return int(value)


def check_batch_size(batch_size: int, data_size: int) -> int:
    """The per-data-group batch size of a global `batch_size`.

    Raises:
        ValueError: if `batch_size` is not a positive multiple of `data_size`.
    """
    batch_size = _check_positive("batch_size", batch_size)
    data_size = _check_positive("data_size", data_size)
    if batch_size % data_size:
        raise ValueError(
            "`batch_size` is the global batch (samples per step over the whole world) "
            f"and must be divisible by the number of data groups, {data_size}, so that "
            "every data group gets the same number of samples per step. "
            f"Received: batch_size={batch_size}, data_size={data_size}."
        )
    return batch_size // data_size


def steps_per_epoch(num_samples: int, batch_size: int, drop_remainder: bool = True) -> int:
    """Global steps in one epoch: `N // B` when dropping the remainder, else `ceil(N / B)`."""
    num_samples = int(num_samples)
    batch_size = _check_positive("batch_size", batch_size)
    if drop_remainder:
        return num_samples // batch_size
    return math.ceil(num_samples / batch_size)


def epoch_order(num_samples: int, *, epoch: int, seed: int = 0, shuffle: bool = True) -> np.ndarray:
    """The global sample order of one epoch: a permutation of `range(num_samples)`.

    The permutation depends only on `(seed, epoch)` (NumPy's PCG64 seeded with
    `[seed, epoch]`), so it is the same on every rank, on every machine.

    Args:
        num_samples: number of samples in the dataset.
        epoch: epoch number (0, 1, ...).
        seed: non-negative integer. Defaults to 0.
        shuffle: if False, the order is `0, 1, ..., N-1` in every epoch.
            Defaults to True.

    Returns:
        An int64 array of length `num_samples`.
    """
    for name, value in (("seed", seed), ("epoch", epoch)):
        if isinstance(value, bool) or int(value) != value or value < 0:
            raise ValueError(
                f"`{name}` must be a non-negative integer. Received: {name}={value!r}."
            )
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    rng = np.random.default_rng([int(seed), int(epoch)])
    return rng.permutation(num_samples).astype(np.int64)


def data_group_order(
    num_samples: int,
    batch_size: int,
    *,
    data_size: int,
    data_index: int,
    epoch: int,
    seed: int = 0,
    shuffle: bool = True,
    drop_remainder: bool = True,
) -> np.ndarray:
    """The samples data group `data_index` reads in one epoch, in reading order.

    Args:
        num_samples: number of samples in the dataset (N).
        batch_size: GLOBAL batch size B (samples per step over all data groups).
        data_size: number of data groups; must divide `batch_size`.
        data_index: this data group (0 .. data_size-1).
        epoch: epoch number; each epoch has its own permutation.
        seed: non-negative integer seed of the permutations. Defaults to 0.
        shuffle: permute the samples each epoch. Defaults to True.
        drop_remainder: if True, the last `N % B` samples of the epoch's order are
            not read (a new permutation next epoch reads them). If False, the last
            partial global batch is completed with samples taken cyclically from the
            start of the same epoch's order (as `torch`'s `DistributedSampler` pads),
            so every step has B samples: those few samples are read twice in that
            epoch. Defaults to True.

    Returns:
        An int64 array of `steps_per_epoch(N, B, drop_remainder) * B / data_size`
        sample indices; consecutive runs of `B / data_size` form one step's batch.
    """
    per_group = check_batch_size(batch_size, data_size)
    if not 0 <= data_index < data_size:
        raise ValueError(
            f"`data_index` must be in [0, {data_size}). Received: data_index={data_index}."
        )
    order = epoch_order(num_samples, epoch=epoch, seed=seed, shuffle=shuffle)
    steps = steps_per_epoch(num_samples, batch_size, drop_remainder)
    if steps == 0:
        return np.zeros((0,), np.int64)
    order = np.resize(order, steps * batch_size)  # truncates, or repeats cyclically
    return order.reshape(steps, data_size, per_group)[:, data_index, :].reshape(-1)
