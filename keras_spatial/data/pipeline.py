"""`distribute_dataset`: a tf.data pipeline of this rank's shards of HDF5 samples."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import numpy as np
import tensorflow as tf

from keras_spatial import comm
from keras_spatial.data import augment as augmentation
from keras_spatial.data import order
from keras_spatial.data.errors import InvalidDataError
from keras_spatial.data.hdf5 import HDF5Dataset

if TYPE_CHECKING:
    from keras_spatial.strategy import SpatialStrategy


class _EpochCounter:
    """Generator function for `tf.data.Dataset.from_generator`: one epoch per call.

    tf.data calls it each time an iterator of the dataset starts producing elements
    (an iterator that is created but never read does not count), so every pass over
    the dataset - one per `model.fit` epoch - gets the next epoch's order.
    """

    def __init__(self, initial_epoch: int, augment: Optional[str], **order_kwargs):
        self._next_epoch = int(initial_epoch)
        self._augment = augment
        self._order_kwargs = order_kwargs
        self._lock = threading.Lock()

    def __call__(self) -> Iterator[tuple[np.int64, np.int64]]:
        """(sample index, position of its symmetry in `augment.symmetries`; 0 = as stored)."""
        with self._lock:
            epoch = self._next_epoch
            self._next_epoch += 1
        seed = self._order_kwargs["seed"]
        for index in order.data_group_order(epoch=epoch, **self._order_kwargs):
            symmetry = 0 if self._augment is None else augmentation.draw(
                self._augment, seed=seed, epoch=epoch, index=int(index))
            yield np.int64(index), np.int64(symmetry)


def _local_region(strategy: "SpatialStrategy", dataset: HDF5Dataset) -> tuple[slice, ...]:
    """This rank's hyperslab (depth, height, width) of every sample."""
    try:
        strategy.local_shape((None,) + tuple(dataset.sample_shape))  # validates
    except ValueError as error:
        raise InvalidDataError(
            f"The samples of dataset '{dataset.x_key}' (e.g. in '{dataset.paths[0]}') "
            f"cannot be split over the mesh: {error}"
        ) from error
    bounds = strategy.mesh.shard_bounds(tuple(dataset.sample_shape)[:3], strategy.coords)
    return tuple(slice(start, stop) for start, stop in bounds)


def _check_ranks_agree(settings: tuple) -> None:
    """Raise on every rank if the ranks were given different data or settings.

    All ranks take part in one allgather and compare the same list, so they all
    raise (or all pass) together; none is left waiting in a later collective.
    """

    every_rank = comm.allgather_object(settings, name="keras_spatial.data.agree")
    differing = [rank for rank, other in enumerate(every_rank) if other != every_rank[0]]
    if differing:
        raise ValueError(
            "All ranks must call `distribute_dataset` with the same files and settings "
            "(the sample order is computed on each rank from them). Ranks "
            f"{differing} differ from rank 0. Received: rank 0 {every_rank[0]}, "
            f"rank {differing[0]} {every_rank[differing[0]]}."
        )


def distribute_dataset(
    strategy: "SpatialStrategy",
    dataset: HDF5Dataset,
    batch_size: int,
    *,
    shuffle: bool = True,
    seed: int = 0,
    drop_remainder: bool = True,
    initial_epoch: int = 0,
    num_parallel_reads: int = tf.data.AUTOTUNE,
    prefetch: int = 2,
    augment: Optional[str] = None,
) -> tf.data.Dataset:
    """A `tf.data.Dataset` of this rank's `(x_local, y)` batches, for `model.fit`.

    Each step, the world takes one GLOBAL batch of `batch_size` samples; every data
    group gets `batch_size / data_size` of them, and every rank of a group reads only
    its own hyperslab (`strategy.coords` x local extents) of each of those samples, so
    a rank reads about 1/S of each sample's bytes. All ranks of a spatial group get the
    same samples in the same order; the data groups' parts are disjoint and together
    make the global batch (data group g holds its g-th part).

    The order is a permutation computed on every rank from `(seed, epoch)` (see
    `keras_spatial.data.order`), without communication. The epoch counter advances
    each time iteration over the returned dataset starts, so `model.fit(ds, epochs=E)`
    reshuffles every epoch and `.repeat()` works too. All ranks must iterate the
    dataset the same number of times (as they do under `model.fit`).

    Reads run in tf.data's background threads (`num_parallel_reads` samples at a
    time, then `prefetch` batches ahead), so that I/O overlaps the training step.
    h5py serializes HDF5 calls inside one process, so the threads mostly overlap
    reading with compute and preprocessing rather than with each other.

    Element shapes are static: `x` is `(batch_size / data_size, d, h, w, C)` with the
    LOCAL extents, as `keras_spatial.Input` expects; replicated labels are
    `(batch_size / data_size,) + label_shape`; sharded labels are local volumes.
    Without labels (`y=None` in the dataset), elements are `x` only.

    For validation data, pass `shuffle=False`; with `drop_remainder=False` every
    sample is seen, and the few samples that complete the last batch are seen twice.

    Args:
        strategy: the `SpatialStrategy` of this run.
        dataset: a `keras_spatial.data.HDF5Dataset`.
        batch_size: GLOBAL batch size (samples per step over the whole world, as with
            Keras distribution strategies); must be divisible by `strategy.data_size`.
        shuffle: permute the samples, differently each epoch. Defaults to True.
        seed: non-negative integer seed of the permutations; must be the same on all
            ranks (checked). Defaults to 0.
        drop_remainder: if True, an epoch has `N // batch_size` steps and the last
            `N % batch_size` samples of its order are skipped (the next epoch's
            permutation reaches them). If False, it has `ceil(N / batch_size)` steps
            and the last global batch is completed with samples from the start of the
            same epoch's order (read twice in that epoch), so all batches are full and
            every rank takes the same number of steps. Defaults to True.
        initial_epoch: epoch number of the first pass, e.g. `initial_epoch` of
            `model.fit` when resuming, to continue the same sequence of orders.
            Defaults to 0.
        num_parallel_reads: samples read concurrently. Defaults to
            `tf.data.AUTOTUNE`.
        prefetch: batches prepared ahead of the training step. Defaults to 2.
        augment: None, "flips" or "cube": transform every sample by a symmetry drawn
            uniformly, per sample and epoch, from the 8 reflections ("flips") or the
            48 symmetries of the cube ("cube": rotations and reflections; cubic
            samples only), applied to the input and to sharded label volumes
            (replicated labels are unchanged: use it only where the labels are
            invariant, or transform with the volume). The symmetry is a function of
            `(seed, epoch, sample index)` (`keras_spatial.data.augment.draw`), so all
            ranks of a spatial group transform a sample alike; each rank reads the
            hyperslab of the stored sample that its shard of the transformed sample
            comes from, so augmentation adds no communication and no bytes read.
            Defaults to None (samples as stored).

    Returns:
        A finite `tf.data.Dataset` of `steps_per_epoch` batches per pass.

    Raises:
        TypeError: if `dataset` is not an `HDF5Dataset`.
        ValueError: if `batch_size` is not a multiple of the number of data groups,
            `augment` is unknown or "cube" for non-cubic samples, or ranks were given
            different files or settings (raised on all ranks).
        InvalidDataError: if the mesh cannot split the samples' extents, or the
            dataset holds fewer samples than one global batch with
            `drop_remainder=True`.

    Example:
    ```python
    strategy = keras_spatial.SpatialStrategy((2, 1, 1))
    files = keras_spatial.data.HDF5Dataset("train/*.h5", x="full", y="unitPar",
                                           channels_first=True, preprocess=np.log1p)
    ds = strategy.distribute_dataset(files, batch_size=8, seed=1)
    model.fit(ds, epochs=10)
    ```
    """
    if not isinstance(dataset, HDF5Dataset):
        raise TypeError(
            "`dataset` must be a keras_spatial.data.HDF5Dataset. "
            f"Received: dataset={type(dataset).__name__}."
        )
    per_group = order.check_batch_size(batch_size, strategy.data_size)
    augmentation.check_augment(augment, dataset.sample_shape[:3])
    order.epoch_order(0, epoch=initial_epoch, seed=seed)  # validates seed and epoch
    region = _local_region(strategy, dataset)
    steps = order.steps_per_epoch(len(dataset), batch_size, drop_remainder)
    if steps == 0:
        raise InvalidDataError(
            f"The dataset has {len(dataset)} samples, fewer than one global batch, so an "
            "epoch would have no step. Use a smaller batch or drop_remainder=False. "
            f"Received: batch_size={batch_size}, num_samples={len(dataset)}."
        )
    if strategy.size > 1:
        _check_ranks_agree(
            (dataset.fingerprint(), int(batch_size), bool(shuffle), int(seed),
             bool(drop_remainder), int(initial_epoch), augment),
        )

    counter = _EpochCounter(
        initial_epoch,
        augment,
        num_samples=len(dataset),
        batch_size=batch_size,
        data_size=strategy.data_size,
        data_index=strategy.data_index,
        seed=seed,
        shuffle=shuffle,
        drop_remainder=drop_remainder,
    )
    indices = tf.data.Dataset.from_generator(
        counter, output_signature=(tf.TensorSpec((), tf.int64), tf.TensorSpec((), tf.int64))
    )
    samples = indices.map(
        _reader(dataset, region, augment), num_parallel_calls=num_parallel_reads,
        deterministic=True,
    )
    batches = samples.batch(per_group, drop_remainder=True)
    batches = batches.apply(tf.data.experimental.assert_cardinality(steps))
    options = tf.data.Options()
    options.deterministic = True
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return batches.with_options(options).prefetch(prefetch)


def _reader(dataset: HDF5Dataset, region: tuple[slice, ...], augment: Optional[str]) -> Callable:
    """The tf.data map function reading one sample's shard (and label), transformed by
    the symmetry the order generator drew for it."""
    x_shape = tuple(s.stop - s.start for s in region) + (dataset.sample_shape[3],)
    x_dtype = tf.as_dtype(dataset.dtype)
    table = augmentation.symmetries(augment) if augment is not None else (None,)

    def read(index: np.int64, symmetry: np.int64):
        return dataset.read(int(index), region, table[int(symmetry)])

    if dataset.y_key is None:

        def read_x(index: np.int64, symmetry: np.int64) -> np.ndarray:
            return read(index, symmetry)[0]

        def read_input(index: tf.Tensor, symmetry: tf.Tensor) -> tf.Tensor:
            x = tf.numpy_function(read_x, [index, symmetry], x_dtype, name="read_hdf5_shard")
            return tf.ensure_shape(x, x_shape)

        return read_input

    y_shape = dataset.label_shape
    if dataset.y_sharded:
        y_shape = x_shape[:3] + tuple(y_shape[3:])
    y_dtype = tf.as_dtype(dataset.y_dtype)

    def read_sample(index: tf.Tensor, symmetry: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        x, y = tf.numpy_function(
            read, [index, symmetry], (x_dtype, y_dtype), name="read_hdf5_shard"
        )
        return tf.ensure_shape(x, x_shape), tf.ensure_shape(y, y_shape)

    return read_sample
