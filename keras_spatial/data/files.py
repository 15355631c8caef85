"""Opening HDF5 files and checking what they hold: helpers of `HDF5Dataset`."""

from __future__ import annotations

import glob
import os
from typing import Sequence, Union

import h5py
import numpy as np

from keras_spatial.data.errors import InvalidDataError
from keras_spatial.data.errors import UnreadableFileError

PathsLike = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]


def open_hdf5(path: str) -> h5py.File:
    """Open `path` read-only with HDF5's data sieve buffer turned off.

    HDF5 reads small contiguous pieces of a contiguous dataset through a 64 KiB sieve
    buffer by default, so a rank reading every other half row of a width-split sample
    would read (and page in) the whole sample. Without the sieve, HDF5 reads exactly
    the selected bytes (one read per contiguous piece), so each rank reads 1/S of a
    sample whichever axes are split. Chunked datasets are unaffected.

    Raises:
        OSError: if the file is missing or cannot be opened as HDF5 (`HDF5Dataset`
            turns this into an `UnreadableFileError` naming the file).
    """
    access = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    access.set_fclose_degree(h5py.h5f.CLOSE_STRONG)
    access.set_sieve_buf_size(0)
    return h5py.File(h5py.h5f.open(os.fsencode(path), h5py.h5f.ACC_RDONLY, fapl=access))


def expand_paths(paths: PathsLike) -> tuple[str, ...]:
    """A sorted glob pattern's matches, or the given path(s) in the given order."""
    if isinstance(paths, (str, os.PathLike)):
        text = os.fspath(paths)
        if glob.has_magic(text):
            matches = sorted(glob.glob(text))
            if not matches:
                raise UnreadableFileError(
                    f"No file matches the pattern. Received: paths='{text}'."
                )
            return tuple(matches)
        return (text,)
    expanded = tuple(os.fspath(p) for p in paths)
    if not expanded:
        raise ValueError(f"`paths` must name at least one file. Received: paths={paths!r}.")
    return expanded


def check_numeric(dtype: np.dtype, what: str) -> None:
    """Raise `InvalidDataError` unless `dtype` is an integer, float or bool dtype."""
    if dtype.kind not in "biuf":
        raise InvalidDataError(
            f"{what} has dtype {dtype}, which cannot be cast to a number (expected an "
            f"integer, float or bool dataset). Received: dtype={dtype}."
        )
