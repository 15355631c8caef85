"""`HDF5Dataset`: a lazy description of 3D samples stored in HDF5 files."""

from __future__ import annotations

import hashlib
import os
from typing import Callable, NamedTuple, Optional, Sequence

import h5py
import numpy as np

from keras_spatial.data.augment import CubeSymmetry
from keras_spatial.data.errors import InvalidDataError
from keras_spatial.data.errors import UnreadableFileError
from keras_spatial.data.files import PathsLike
from keras_spatial.data.files import check_numeric
from keras_spatial.data.files import expand_paths
from keras_spatial.data.files import open_hdf5

Region = Sequence[slice]


class _FileContent(NamedTuple):
    """What one file holds: sample count and per-sample stored shapes and dtypes."""

    num_samples: int
    x_shape: tuple
    x_dtype: np.dtype
    y_shape: Optional[tuple]
    y_dtype: Optional[np.dtype]


def _check_region(
    region: Optional[Region], extents: Sequence[int], name: str = "region"
) -> tuple[slice, ...]:
    if region is None:
        return tuple(slice(0, e) for e in extents)
    region = tuple(region)
    valid = len(region) == 3 and all(
        isinstance(s, slice)
        and s.step in (None, 1)
        and isinstance(s.start, (int, np.integer))
        and isinstance(s.stop, (int, np.integer))
        and 0 <= s.start < s.stop <= e
        for s, e in zip(region, extents)
    )
    if not valid:
        raise ValueError(
            f"`{name}` must be three slices with integer bounds, (depth, height, width), "
            f"inside the sample's extents {tuple(extents)}. Received: {name}={region}."
        )
    return region


def _format_region(region: Sequence[slice]) -> str:
    return "[" + ", ".join(f"{s.start}:{s.stop}" for s in region) + "]"


class HDF5Dataset:
    """A description of 3D samples stored in HDF5 files, read lazily shard by shard.

    Two layouts are recognized from the rank of the `x` dataset of the first file:

    - many samples per file: `x` is `[N, D, H, W, C]` (`[N, C, D, H, W]` with
      `channels_first=True`), and `y` (if given) has the same leading `N`;
    - one sample per file (CosmoFlow style): `x` is `[D, H, W, C]` (`[C, D, H, W]`
      with `channels_first=True`, e.g. CosmoFlow's `full`), and `y` holds that
      sample's label (e.g. `unitPar` of shape `[4]`).

    `x` must have a channel axis. Labels are either replicated (every rank of a
    spatial group gets the whole label, e.g. a parameter vector) or sharded like the
    input (a label volume `[D, H, W]` or `[D, H, W, C]` per sample, of which each rank
    gets its sub-volume). By default a per-sample label of rank <= 2 is replicated and
    one whose spatial extents equal those of `x` is sharded.

    Construction opens every file once to read shapes and dtypes (no sample data) and
    checks that all files agree. The checks depend only on the files, so every rank
    that describes the same files raises the same error at the same point, before any
    collective starts. Sample data is read later, by `read` (one file opened per read),
    usually from the tf.data pipeline of `keras_spatial.data.distribute_dataset`.

    Args:
        paths: one path, a glob pattern (its matches are sorted), or a sequence of
            paths (kept in the given order). Sample indices run over the files in
            this order.
        x: name of the input dataset in every file (may be a path like "grp/x").
        y: name of the label dataset, or None for inputs only. Defaults to None.
        channels_first: the files store channels before the spatial axes
            (`[C, D, H, W]` per sample); shards are transposed to channels-last after
            reading. Also applies to 4D label volumes. Defaults to False.
        y_sharded: True to shard labels like the input, False to replicate them,
            None to decide from the label shape as described above. Defaults to None.
        preprocess: function applied to each shard of `x` after reading (and after
            the transpose), e.g. `np.log1p`. It sees one rank's shard, not the whole
            sample, so it must act voxel by voxel, and must keep the shape. It is
            called from several tf.data threads at once. Defaults to None.
        dtype: dtype of the delivered `x` shards (cast after `preprocess`).
            Defaults to "float32".
        y_dtype: dtype of the delivered labels, e.g. "int32" for class volumes.
            Defaults to "float32".
        check_all_files: if False and the files hold one sample each, only the first
            file is opened at construction (useful with very many files on a
            parallel file system); the others are checked when read. Files holding
            many samples are always opened to count their samples. Defaults to True.
        crop: three slices `(depth, height, width)` with integer bounds: use only this
            sub-volume of every sample, as if the files held it alone (e.g. 64^3 crops
            of 128^3 universes: `(slice(0, 64),) * 3`). `sample_shape`, shards and
            sharded labels are then those of the crop; only the crop's bytes are read.
            Defaults to None (whole samples).
        open_file: function `path -> h5py.File` used for every open, called from
            tf.data threads. Use it to pass h5py options (a driver, chunk cache size,
            `locking=False`) or to count bytes. Defaults to `open_hdf5`, which opens
            read-only with HDF5's data sieve buffer off, so that only the selected
            bytes are read.

    Raises:
        UnreadableFileError: a file is missing, not HDF5, truncated or corrupt, or a
            glob pattern matches nothing.
        InvalidDataError: a key is missing, the files disagree on shapes, a dtype is
            not numeric, or a label fits neither as replicated nor as sharded.

    Example:
    ```python
    dataset = keras_spatial.data.HDF5Dataset(
        "cosmoUniverse/*.hdf5", x="full", y="unitPar",
        channels_first=True, preprocess=np.log1p)
    len(dataset), dataset.sample_shape    # (N, (128, 128, 128, 4))
    x_shard, y = dataset.read(0, region=(slice(0, 64), slice(0, 128), slice(0, 128)))
    ```
    """

    def __init__(
        self,
        paths: PathsLike,
        *,
        x: str,
        y: Optional[str] = None,
        channels_first: bool = False,
        y_sharded: Optional[bool] = None,
        preprocess: Optional[Callable[[np.ndarray], np.ndarray]] = None,
        dtype: str = "float32",
        y_dtype: str = "float32",
        check_all_files: bool = True,
        crop: Optional[Region] = None,
        open_file: Optional[Callable[[str], h5py.File]] = None,
    ):
        self._paths = expand_paths(paths)
        self._x_key = str(x)
        self._y_key = None if y is None else str(y)
        self._channels_first = bool(channels_first)
        self._preprocess = preprocess
        self._dtype = np.dtype(dtype)
        self._y_dtype = np.dtype(y_dtype)
        check_numeric(self._dtype, "The output `dtype`")
        check_numeric(self._y_dtype, "The output `y_dtype`")
        self._open_file = open_file or open_hdf5

        first = self._inspect(self._paths[0], first=None)
        if len(first.x_shape) != 4:
            layout = "[C, D, H, W]" if self._channels_first else "[D, H, W, C]"
            raise InvalidDataError(
                f"Dataset '{self._x_key}' in file '{self._paths[0]}' must hold one sample "
                f"{layout} or many samples [N] + {layout} (with a channel axis). "
                f"Received: shape={first.x_shape}, channels_first={self._channels_first}."
            )
        self._one_sample_per_file = first.num_samples is None
        if self._one_sample_per_file:
            counts = [1] * len(self._paths)
            if check_all_files:
                for path in self._paths[1:]:
                    self._inspect(path, first=first)
        else:
            counts = [first.num_samples] + [
                self._inspect(path, first=first).num_samples for path in self._paths[1:]
            ]
        self._content = first
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

        stored = first.x_shape
        self._sample_shape = (stored[1], stored[2], stored[3], stored[0]) if (
            self._channels_first
        ) else stored
        self._y_sharded, self._y_shape = self._label_layout(first, y_sharded)
        self._crop = None
        if crop is not None:
            self._crop = _check_region(crop, self._sample_shape[:3], "crop")
            extents = tuple(s.stop - s.start for s in self._crop)
            self._sample_shape = extents + (self._sample_shape[3],)
            if self._y_sharded:
                self._y_shape = extents + tuple(self._y_shape[3:])

    # Description ------------------------------------------------------------------
    @property
    def paths(self) -> tuple[str, ...]:
        """The files, in sample order."""
        return self._paths

    @property
    def x_key(self) -> str:
        """Name of the input dataset."""
        return self._x_key

    @property
    def y_key(self) -> Optional[str]:
        """Name of the label dataset (None without labels)."""
        return self._y_key

    @property
    def sample_shape(self) -> tuple[int, int, int, int]:
        """GLOBAL channels-last shape `(D, H, W, C)` of one input sample."""
        return self._sample_shape

    @property
    def crop(self) -> Optional[tuple[slice, ...]]:
        """The sub-volume of every stored sample that is used (None: all of it)."""
        return self._crop

    @property
    def label_shape(self) -> Optional[tuple]:
        """Shape of one sample's label as delivered (GLOBAL for sharded labels)."""
        return self._y_shape

    @property
    def y_sharded(self) -> bool:
        """Whether labels are volumes split like the input (else replicated)."""
        return self._y_sharded

    @property
    def dtype(self) -> np.dtype:
        """dtype of the delivered input shards."""
        return self._dtype

    @property
    def y_dtype(self) -> np.dtype:
        """dtype of the delivered labels."""
        return self._y_dtype

    @property
    def file_dtype(self) -> np.dtype:
        """dtype of the input as stored in the first file."""
        return self._content.x_dtype

    @property
    def one_sample_per_file(self) -> bool:
        """Whether each file holds one sample (else `[N, ...]` datasets)."""
        return self._one_sample_per_file

    def __len__(self) -> int:
        return int(self._starts[-1])

    def fingerprint(self) -> str:
        """A short string identifying files, keys, shapes and dtypes of this description.

        Ranks describing the same data get the same string (used to check that all
        ranks agree before a pipeline starts).
        """
        text = repr(
            (self._paths, self._x_key, self._y_key, self._channels_first, len(self),
             self._sample_shape, self._y_shape, self._y_sharded, str(self._dtype),
             str(self._y_dtype), _format_region(self._crop) if self._crop else None)
        )
        return hashlib.sha1(text.encode()).hexdigest()[:16]

    def __repr__(self) -> str:
        labels = "y=None" if self._y_key is None else (
            f"y='{self._y_key}' {self._y_shape} "
            f"{'sharded' if self._y_sharded else 'replicated'}"
        )
        return (
            f"HDF5Dataset(files={len(self._paths)}, samples={len(self)}, "
            f"x='{self._x_key}' {self._sample_shape} {self.file_dtype}->{self._dtype}"
            f"{' channels_first' if self._channels_first else ''}"
            f"{' crop ' + _format_region(self._crop) if self._crop else ''}, {labels})"
        )

    # Files ------------------------------------------------------------------------
    def _open(self, path: str) -> h5py.File:
        try:
            return self._open_file(path)
        except OSError as error:
            if not os.path.exists(path):
                raise UnreadableFileError(
                    f"The HDF5 file does not exist. Received: path='{path}'."
                ) from error
            raise UnreadableFileError(
                "The file could not be opened as HDF5: it is not an HDF5 file, or it "
                f"is truncated or corrupt ({error}). Received: path='{path}'."
            ) from error

    @staticmethod
    def _dataset(file: h5py.File, key: str, path: str, argument: str) -> h5py.Dataset:
        try:
            node = file.get(key)
        except (OSError, KeyError, RuntimeError) as error:
            raise UnreadableFileError(
                f"Reading the object '{key}' of file '{path}' failed; the file is "
                f"corrupt ({error}). Received: {argument}='{key}'."
            ) from error
        if not isinstance(node, h5py.Dataset):
            names: list[str] = []
            file.visititems(
                lambda name, obj: names.append(name)
                if isinstance(obj, h5py.Dataset) and len(names) < 20
                else None
            )
            found = "is a group, not a dataset" if node is not None else "does not exist"
            raise InvalidDataError(
                f"The dataset '{key}' {found} in file '{path}' (its datasets: {names}). "
                f"Received: {argument}='{key}'."
            )
        return node

    def _inspect(self, path: str, first: Optional[_FileContent]) -> _FileContent:
        """Shapes and dtypes of one file, checked against the first file's."""
        with self._open(path) as file:
            x = self._dataset(file, self._x_key, path, "x")
            check_numeric(x.dtype, f"Dataset '{self._x_key}' in file '{path}'")
            x_shape = tuple(int(n) for n in x.shape)
            many = first.num_samples is not None if first else len(x_shape) == 5
            num_samples = x_shape[0] if many and x_shape else None
            content = _FileContent(
                num_samples, x_shape[1:] if many else x_shape, x.dtype, None, None
            )
            if first is not None and (len(x_shape) != (5 if many else 4) or (
                content.x_shape, content.x_dtype) != (first.x_shape, first.x_dtype)
            ):
                self._raise_disagreement(path, self._x_key, x_shape, x.dtype, first.x_shape,
                                         first.x_dtype)
            if self._y_key is not None:
                y = self._dataset(file, self._y_key, path, "y")
                check_numeric(y.dtype, f"Dataset '{self._y_key}' in file '{path}'")
                y_shape = tuple(int(n) for n in y.shape)
                if many and (not y_shape or y_shape[0] != num_samples):
                    raise InvalidDataError(
                        f"Dataset '{self._y_key}' in file '{path}' must have one label "
                        f"per sample of '{self._x_key}' ({num_samples}) along its first "
                        f"axis. Received: y_shape={y_shape}, x_shape={x_shape}."
                    )
                content = content._replace(
                    y_shape=y_shape[1:] if many else y_shape, y_dtype=y.dtype
                )
                if first is not None and (content.y_shape, content.y_dtype) != (
                    first.y_shape, first.y_dtype
                ):
                    self._raise_disagreement(path, self._y_key, y_shape, y.dtype,
                                             first.y_shape, first.y_dtype)
        if min(content.x_shape, default=0) < 1:
            raise InvalidDataError(
                f"Dataset '{self._x_key}' in file '{path}' has an empty axis. "
                f"Received: shape={x_shape}."
            )
        return content

    def _raise_disagreement(
        self,
        path: str,
        key: str,
        shape: tuple,
        dtype: np.dtype,
        first_shape: tuple,
        first_dtype: np.dtype,
    ) -> None:
        raise InvalidDataError(
            f"All files must hold samples of one shape and dtype, but dataset '{key}' "
            f"is {shape} {dtype} in file '{path}', while the first file "
            f"'{self._paths[0]}' holds samples of {first_shape} {first_dtype}. "
            f"Received: path='{path}', shape={shape}, dtype={dtype}."
        )

    def _label_layout(self, first: _FileContent, y_sharded: Optional[bool]):
        """(sharded?, delivered per-sample label shape) from the stored label shape."""
        if self._y_key is None:
            return False, None
        stored = first.y_shape
        if self._channels_first and len(stored) == 4:
            as_volume = (stored[1], stored[2], stored[3], stored[0])
        else:
            as_volume = stored
        is_volume = len(as_volume) in (3, 4) and as_volume[:3] == self._sample_shape[:3]
        if y_sharded is None:
            if is_volume:
                return True, as_volume
            if len(stored) <= 2:
                return False, stored
        elif y_sharded and is_volume:
            return True, as_volume
        elif not y_sharded:
            return False, stored
        raise InvalidDataError(
            f"The label '{self._y_key}' of per-sample shape {stored} in file "
            f"'{self._paths[0]}' is neither a vector (rank <= 2, replicated) nor a volume "
            f"[D, H, W] or [D, H, W, C] with the input's extents {self._sample_shape[:3]} "
            "(sharded). Pass y_sharded=False to replicate it as it is. "
            f"Received: y_shape={stored}, y_sharded={y_sharded}."
        )

    # Reading ----------------------------------------------------------------------
    def locate(self, index: int) -> tuple[str, Optional[int]]:
        """The file holding sample `index`, and its index in that file (None if alone)."""
        if not 0 <= index < len(self):
            raise IndexError(
                f"Sample index out of range for {len(self)} samples. Received: index={index}."
            )
        file_index = int(np.searchsorted(self._starts, index, side="right")) - 1
        local = int(index - self._starts[file_index])
        return self._paths[file_index], None if self._one_sample_per_file else local

    def read(
        self,
        index: int,
        region: Optional[Region] = None,
        transform: Optional[CubeSymmetry] = None,
    ) -> tuple[np.ndarray, Optional[np.ndarray]]:
        """Read sample `index`, only the hyperslab `region` of it, from its file.

        Only the selected bytes are read from the file (h5py hyperslab selection);
        channels-first data is transposed after reading.

        Args:
            index: sample index, 0 .. len-1.
            region: three slices `(depth, height, width)` in GLOBAL voxel coordinates
                of the sample (of the crop, when the dataset has one; of the
                transformed sample, with `transform`), or None for the whole sample.
                Defaults to None.
            transform: a `keras_spatial.data.augment.CubeSymmetry` applied to the
                sample (and to a sharded label volume) before `region` is taken: the
                result is `region` of `transform.apply(whole sample)`, read from the
                matching hyperslab of the file. An axis permutation needs equal
                extents on the permuted axes. Defaults to None (as stored).

        Returns:
            `(x, y)`: the input shard `(d, h, w, C)` (preprocessed, of `dtype`), and
            the label (the region of a sharded label volume, the whole label when
            replicated), of `y_dtype`, or None without labels.

        Raises:
            UnreadableFileError: the file is missing, or damaged where it is read.
            InvalidDataError: the file no longer matches the description.
        """
        index = int(index)
        region = _check_region(region, self._sample_shape[:3])
        if transform is not None:
            extents = self._sample_shape[:3]
            if any(extents[p] != extents[a] for a, p in enumerate(transform.permutation)):
                raise ValueError(
                    f"The transform permutes axes of unequal extents {tuple(extents)}: the "
                    f"transformed sample would change shape. Received: transform={transform}."
                )
            region = transform.source_region(region, extents)
        if self._crop is not None:
            region = tuple(
                slice(c.start + r.start, c.start + r.stop) for c, r in zip(self._crop, region)
            )
        path, local = self.locate(index)
        with self._open(path) as file:
            x = self._read_volume(file, path, self._x_key, "x", local, region, True)
            y = None
            if self._y_key is not None:
                y = self._read_volume(
                    file, path, self._y_key, "y", local, region, self._y_sharded
                )
        if self._preprocess is not None:
            processed = np.asarray(self._preprocess(x))
            if processed.shape != x.shape:
                raise InvalidDataError(
                    "`preprocess` must act voxel by voxel and keep the shape of the "
                    f"shard. Received: preprocess={self._preprocess!r}, "
                    f"input shape={x.shape}, output shape={processed.shape}."
                )
            x = processed
        if transform is not None:
            x = transform.apply(x)
            if y is not None and self._y_sharded:
                y = transform.apply(y)
        x = np.ascontiguousarray(x, dtype=self._dtype)
        if y is not None:
            y = np.ascontiguousarray(y, dtype=self._y_dtype)
        return x, y

    def _read_volume(
        self,
        file: h5py.File,
        path: str,
        key: str,
        argument: str,
        local: Optional[int],
        region: tuple[slice, ...],
        sharded: bool,
    ) -> np.ndarray:
        dataset = self._dataset(file, key, path, argument)
        per_sample = self._content.x_shape if argument == "x" else self._content.y_shape
        actual = tuple(dataset.shape) if local is None else tuple(dataset.shape[1:])
        if actual != per_sample or (local is not None and local >= dataset.shape[0]):
            raise InvalidDataError(
                f"Dataset '{key}' in file '{path}' has shape {tuple(dataset.shape)}, but "
                f"the dataset was described with per-sample shape {per_sample} (the file "
                f"changed, or was not checked at construction). Received: "
                f"{argument}='{key}', shape={tuple(dataset.shape)}."
            )
        # Channels-first volumes store the channel axis before depth/height/width.
        transpose = sharded and self._channels_first and len(per_sample) == 4
        if not sharded:
            selection: tuple = ()
        elif transpose:
            selection = (slice(None),) + region
        else:
            selection = region
        if local is not None:
            selection = (local,) + selection
        try:
            values = dataset[selection] if selection else dataset[()]
        except (OSError, RuntimeError, ValueError) as error:
            raise UnreadableFileError(
                f"Reading dataset '{key}' of file '{path}' failed; the file is corrupt or "
                f"truncated ({error}). Received: {argument}='{key}', sample={local}, "
                f"region={_format_region(region)}."
            ) from error
        values = np.asarray(values)
        if transpose:
            # A contiguous copy in the stored dtype first: `preprocess` on a transposed
            # view would run at half the speed and need another copy afterwards.
            values = np.ascontiguousarray(np.transpose(values, (1, 2, 3, 0)))
        return values
