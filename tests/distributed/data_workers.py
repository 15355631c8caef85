"""Worker functions of the data pipeline tests, run on several Horovod ranks.

Workers only read and report; tests/distributed/test_data_pipeline.py compares the reports of all
ranks in the pytest process, so a failing check never leaves a rank waiting.
"""

from __future__ import annotations

import io
import threading
from typing import Any, Optional

import h5py
import numpy as np


class ByteCounter:
    """Counts the bytes HDF5 reads through files opened by `open_file` (all threads)."""

    def __init__(self):
        self.bytes_read = 0
        self._lock = threading.Lock()

    def add(self, count: int) -> None:
        with self._lock:
            self.bytes_read += count

    def open_file(self, path: str) -> h5py.File:
        """`HDF5Dataset(open_file=...)`: an h5py file over a byte-counting file object."""
        return h5py.File(_CountingFile(path, self), "r")


class _CountingFile(io.RawIOBase):
    """A read-only file object that reports every byte read to a `ByteCounter`."""

    def __init__(self, path: str, counter: ByteCounter):
        super().__init__()
        self._file = open(path, "rb", buffering=0)
        self._counter = counter

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._file.seek(offset, whence)

    def tell(self) -> int:
        return self._file.tell()

    def readinto(self, buffer) -> int:
        count = self._file.readinto(buffer)
        self._counter.add(count or 0)
        return count

    def close(self) -> None:
        self._file.close()
        super().close()


def _epochs(ds, epochs: int) -> list:
    """[(x batches, y batches)] for each pass over `ds`, as NumPy arrays."""
    passes = []
    for _ in range(epochs):
        xs, ys = [], []
        for x, y in ds:
            xs.append(x.numpy())
            ys.append(y.numpy())
        passes.append((xs, ys))
    return passes


def read_shards(cases: list[dict], fit_case: Optional[dict] = None) -> dict[str, Any]:
    """Run every case of `cases` on this rank and report what it read.

    Each case is a dict with `name`, `spatial_shape`, `paths`, `x`, `y`,
    `channels_first`, `dtype`, `y_dtype`, `batch_size`, `epochs`, `seed` and optionally
    `rank_seed` (seed + rank, to provoke a disagreement) and `augment`. The error of
    `distribute_dataset`, if any, is reported instead of the batches. Cases run one
    after another, each on a new `SpatialStrategy` (Horovod process sets are dynamic).
    """
    from tests.distributed.launcher import worker_setup

    worker_setup()
    import keras_spatial as ks
    from keras_spatial import data as ks_data

    report: dict[str, Any] = {}
    for case in cases:
        strategy = ks.SpatialStrategy(case["spatial_shape"])
        counter = ByteCounter()
        dataset = ks_data.HDF5Dataset(
            case["paths"], x=case["x"], y=case["y"], channels_first=case["channels_first"],
            dtype=case["dtype"], y_dtype=case["y_dtype"], open_file=counter.open_file,
        )
        seed = case["seed"] + strategy.rank if case.get("rank_seed") else case["seed"]
        try:
            ds = strategy.distribute_dataset(dataset, case["batch_size"], seed=seed,
                                             augment=case.get("augment"))
        except (ValueError, OSError) as error:
            report[case["name"]] = {"error": f"{type(error).__name__}: {error}"}
            continue
        counter.bytes_read = 0  # count the reads of samples only, not the description
        passes = _epochs(ds, case["epochs"])
        report[case["name"]] = {
            "rank": strategy.rank,
            "coords": strategy.coords,
            "data_index": strategy.data_index,
            "data_size": strategy.data_size,
            "passes": passes,
            "bytes_read": counter.bytes_read,
            "samples_read": case["epochs"] * sum(len(x) for x in passes[0][0]),
        }
    if fit_case is not None:
        report["fit"] = _fit(fit_case)
    return report


def _fit(case: dict) -> dict[str, Any]:
    """`model.fit(ds, epochs=2)` of a tiny SpatialConv3D model on this rank's shards."""
    import keras

    import keras_spatial as ks
    from keras_spatial import data as ks_data

    strategy = ks.SpatialStrategy(case["spatial_shape"])
    dataset = ks_data.HDF5Dataset(
        case["paths"], x=case["x"], y=case["y"], channels_first=case["channels_first"],
        preprocess=np.log1p,
    )
    ds = strategy.distribute_dataset(dataset, case["batch_size"], seed=case["seed"])
    keras.utils.set_random_seed(0)
    with strategy.scope():
        inputs = ks.Input(dataset.sample_shape)
        hidden = ks.layers.SpatialConv3D(2, 3, padding="same")(inputs)
        outputs = keras.layers.Dense(dataset.label_shape[-1])(
            keras.layers.GlobalAveragePooling3D()(hidden)
        )
        model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(1e-4), loss="mse")
    history = model.fit(ds, epochs=2, verbose=0, shuffle=False)
    return {
        "input_shape": tuple(model.input.shape),
        "element_shape": tuple(ds.element_spec[0].shape),
        "loss": [float(v) for v in history.history["loss"]],
    }


def fit_with_damaged_file(path: str) -> str:
    """`model.fit` on a file whose data only one rank's shard finds damaged.

    Rank 1 fails at the first read of the damaged chunk while rank 0 waits in a halo
    exchange; the job must end (Horovod shuts down, the launcher stops the rest)
    instead of leaving rank 0 waiting.
    """
    from tests.distributed.launcher import worker_setup

    worker_setup()
    import keras

    import keras_spatial as ks
    from keras_spatial import data as ks_data

    strategy = ks.SpatialStrategy((2, 1, 1))
    dataset = ks_data.HDF5Dataset(path, x="x", y="y")
    ds = strategy.distribute_dataset(dataset, 1, shuffle=False)
    with strategy.scope():
        inputs = ks.Input(dataset.sample_shape)
        hidden = ks.layers.SpatialConv3D(2, 3, padding="same")(inputs)
        outputs = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling3D()(hidden))
        model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(ds, epochs=1, verbose=0)
    return "finished"
