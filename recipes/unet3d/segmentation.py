"""Synthetic 3D segmentation: random ellipsoids of two classes, blurred, in Gaussian noise.

Each sample is a (D, H, W) label volume (0 background, 1 and 2 the foreground classes)
and an image: the class intensities painted into the volume, blurred by a separable
Gaussian (an imaging point-spread function), plus white Gaussian noise::

    image = blur(intensity[labels], blur_sigma) + noise_std * N(0, 1)

Every sample holds 2 to 4 ellipsoids of each class (random centres, semi-axes and
orientations; later ellipsoids occlude earlier ones) and always contains both classes.

File format (`seg_{file_index:04d}.h5`, `per_file` consecutive samples each, the last
file possibly fewer): dataset `images` (N, D, H, W, 1) float32 and dataset `labels`
(N, D, H, W) uint8, both contiguous; file attributes `seed`, `first_index`, `per_file`,
`shape`, `num_classes` and the generator settings. Sample j depends only on (seed, j).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Sequence

import numpy as np

from recipes.writing import atomic_h5_file, check_seed, sample_rng

NUM_CLASSES = 3
CLASS_NAMES = ("background", "class_1", "class_2")
MIN_EXTENT = 8
FORMAT = "keras_spatial.unet3d.seg/1"
_STREAM_GEOMETRY, _STREAM_NOISE = 0, 1
_MAX_ATTEMPTS = 100


def _as_shape(shape: Sequence[int]) -> tuple[int, int, int]:
    values = tuple(shape)
    if len(values) != 3 or any(
        isinstance(v, bool) or int(v) != v or v < MIN_EXTENT for v in values
    ):
        raise ValueError(
            f"`shape` must be three integers (D, H, W), each at least {MIN_EXTENT}. "
            f"Received: shape={tuple(shape)!r}."
        )
    return tuple(int(v) for v in values)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SegmentationConfig:
    """Settings shared by every sample of a segmentation data set.

    Args:
        shape: volume extent (D, H, W), each at least 8. Defaults to (64, 64, 64).
        ellipsoids_per_class: inclusive (min, max) number of ellipsoids of each class.
            Defaults to (2, 4).
        radius_range: (min, max) semi-axis as a fraction of the extent along that axis
            (at least one voxel). Defaults to (0.1, 0.25).
        intensities: mean image intensity of background, class 1 and class 2.
            Defaults to (0.0, 1.0, 2.0).
        noise_std: standard deviation of the additive white noise. Defaults to 0.5.
        blur_sigma: Gaussian blur in voxels (0 for none). Defaults to 1.0.

    Raises:
        ValueError: for out-of-range values.
    """

    shape: tuple[int, int, int] = (64, 64, 64)
    ellipsoids_per_class: tuple[int, int] = (2, 4)
    radius_range: tuple[float, float] = (0.1, 0.25)
    intensities: tuple[float, float, float] = (0.0, 1.0, 2.0)
    noise_std: float = 0.5
    blur_sigma: float = 1.0

    def __post_init__(self):
        object.__setattr__(self, "shape", _as_shape(self.shape))
        low, high = self.ellipsoids_per_class
        if int(low) != low or int(high) != high or not 1 <= low <= high:
            raise ValueError(
                "`ellipsoids_per_class` must be integers 1 <= min <= max. "
                f"Received: ellipsoids_per_class={self.ellipsoids_per_class!r}."
            )
        object.__setattr__(self, "ellipsoids_per_class", (int(low), int(high)))
        low, high = self.radius_range
        if not 0 < low <= high <= 0.5:
            raise ValueError(
                "`radius_range` must satisfy 0 < min <= max <= 0.5. "
                f"Received: radius_range={self.radius_range!r}."
            )
        object.__setattr__(self, "radius_range", (float(low), float(high)))
        if len(self.intensities) != NUM_CLASSES:
            raise ValueError(
                f"`intensities` must hold {NUM_CLASSES} values (background, class 1, "
                f"class 2). Received: intensities={self.intensities!r}."
            )
        object.__setattr__(self, "intensities", tuple(float(v) for v in self.intensities))
        for name in ("noise_std", "blur_sigma"):
            value = getattr(self, name)
            if not np.isfinite(value) or value < 0:
                raise ValueError(f"`{name}` must be >= 0. Received: {name}={value!r}.")
            object.__setattr__(self, name, float(value))


def gaussian_blur(volume: np.ndarray, sigma: float, *, truncate: float = 3.0) -> np.ndarray:
    """Separable Gaussian blur of a 3D volume with symmetric (mirror) boundaries.

    Args:
        volume: array of shape (D, H, W).
        sigma: standard deviation in voxels; 0 returns a float32 copy.
        truncate: kernel half-width in units of sigma. Defaults to 3.

    Returns:
        The blurred volume, float32, same shape.
    """
    blurred = np.array(volume, dtype=np.float32)
    if sigma <= 0:
        return blurred
    radius = max(1, int(math.ceil(truncate * sigma)))
    offsets = np.arange(-radius, radius + 1, dtype=np.float64)
    kernel = np.exp(-0.5 * (offsets / sigma) ** 2)
    kernel = (kernel / kernel.sum()).astype(np.float32)
    for axis in range(blurred.ndim):
        extent = blurred.shape[axis]
        pad = [(0, 0)] * blurred.ndim
        pad[axis] = (radius, radius)
        padded = np.pad(blurred, pad, mode="symmetric")
        result = np.zeros_like(blurred)
        for shift, weight in enumerate(kernel):
            result += weight * np.take(padded, np.arange(shift, shift + extent), axis=axis)
        blurred = result
    return blurred


def random_rotation(rng: np.random.Generator) -> np.ndarray:
    """A uniformly random 3x3 rotation matrix (QR of a Gaussian matrix, det +1)."""
    q, r = np.linalg.qr(rng.standard_normal((3, 3)))
    q *= np.sign(np.diag(r))
    if np.linalg.det(q) < 0:
        q[:, 0] = -q[:, 0]
    return q


def paint_ellipsoid(
    labels: np.ndarray,
    label: int,
    *,
    center: np.ndarray,
    semi_axes: np.ndarray,
    rotation: np.ndarray,
) -> None:
    """Sets `labels` to `label` inside an ellipsoid, in place.

    A voxel x (integer indices) is inside when |diag(1/semi_axes) rotation^T (x - c)| <= 1.
    Only the ellipsoid's bounding box is visited.
    """
    half_extent = np.sqrt(((rotation * semi_axes) ** 2).sum(axis=1))
    low = np.maximum(np.floor(center - half_extent).astype(int), 0)
    high = np.minimum(np.ceil(center + half_extent).astype(int) + 1, labels.shape)
    if np.any(high <= low):
        return
    grids = np.ogrid[low[0] : high[0], low[1] : high[1], low[2] : high[2]]
    offsets = [grid - c for grid, c in zip(grids, center)]
    radius2 = 0.0
    for j in range(3):
        body = sum(offsets[i] * rotation[i, j] for i in range(3))
        radius2 = radius2 + (body / semi_axes[j]) ** 2
    box = labels[low[0] : high[0], low[1] : high[1], low[2] : high[2]]
    box[radius2 <= 1.0] = label


def random_labels(rng: np.random.Generator, config: SegmentationConfig) -> np.ndarray:
    """A (D, H, W) uint8 label volume holding both foreground classes.

    Raises:
        RuntimeError: if 100 draws in a row miss a class (settings far too small).
    """
    extent = np.array(config.shape, dtype=np.float64)
    low, high = config.ellipsoids_per_class
    for _ in range(_MAX_ATTEMPTS):
        labels = np.zeros(config.shape, dtype=np.uint8)
        counts = rng.integers(low, high + 1, size=2)
        order = rng.permutation(np.repeat([1, 2], counts))
        for label in order:
            paint_ellipsoid(
                labels,
                int(label),
                center=rng.uniform(0.0, extent),
                semi_axes=np.maximum(extent * rng.uniform(*config.radius_range, size=3), 1.0),
                rotation=random_rotation(rng),
            )
        if np.all(np.bincount(labels.ravel(), minlength=NUM_CLASSES)[1:] > 0):
            return labels
    raise RuntimeError(
        f"Could not place both classes in {_MAX_ATTEMPTS} draws; use larger radii. "
        f"Received: shape={config.shape}, radius_range={config.radius_range}."
    )


def generate_segmentation_sample(
    seed: int, index: int, config: SegmentationConfig = SegmentationConfig()
) -> tuple[np.ndarray, np.ndarray]:
    """Sample `index` of the data set `seed`; depends only on (seed, index, config).

    Returns:
        (image of shape (D, H, W, 1) float32, labels of shape (D, H, W) uint8).
    """
    labels = random_labels(sample_rng(seed, index, _STREAM_GEOMETRY), config)
    clean = np.asarray(config.intensities, dtype=np.float32)[labels]
    image = gaussian_blur(clean, config.blur_sigma)
    noise = sample_rng(seed, index, _STREAM_NOISE).standard_normal(config.shape, dtype=np.float32)
    image += np.float32(config.noise_std) * noise
    return image[..., None], labels


def segmentation_filename(file_index: int) -> str:
    """File name of file `file_index`: `seg_{file_index:04d}.h5`."""
    return f"seg_{file_index:04d}.h5"


@dataclasses.dataclass(frozen=True)
class SegmentationJob:
    """One file to write: samples [first_index, first_index + count) of data set `seed`."""

    directory: str
    seed: int
    file_index: int
    per_file: int
    total_count: int
    config: SegmentationConfig

    @property
    def first_index(self) -> int:
        """Global index of the file's first sample."""
        return self.file_index * self.per_file

    @property
    def count(self) -> int:
        """Number of samples in this file (the last file may hold fewer)."""
        return min(self.per_file, self.total_count - self.first_index)

    @property
    def path(self) -> str:
        """Final path of the file."""
        return os.path.join(self.directory, segmentation_filename(self.file_index))


def segmentation_jobs(
    directory: str, *, seed: int, count: int, per_file: int, config: SegmentationConfig
) -> list[SegmentationJob]:
    """The ceil(count / per_file) files of a data set of `count` samples."""
    files = -(-count // per_file)
    return [SegmentationJob(directory, seed, k, per_file, count, config) for k in range(files)]


def _expected_attributes(job: SegmentationJob) -> dict:
    config = job.config
    return {
        "seed": np.int64(job.seed),
        "first_index": np.int64(job.first_index),
        "per_file": np.int64(job.per_file),
        "shape": np.asarray(config.shape, dtype=np.int64),
        "num_classes": np.int64(NUM_CLASSES),
        "ellipsoids_per_class": np.asarray(config.ellipsoids_per_class, dtype=np.int64),
        "radius_range": np.asarray(config.radius_range, dtype=np.float64),
        "intensities": np.asarray(config.intensities, dtype=np.float64),
        "noise_std": np.float64(config.noise_std),
        "blur_sigma": np.float64(config.blur_sigma),
        "format": FORMAT,
    }


def write_segmentation(job: SegmentationJob) -> str:
    """Generates and writes one file atomically, one sample in memory at a time.

    Returns:
        The path written.
    """
    check_seed(job.seed)
    depth, height, width = job.config.shape
    with atomic_h5_file(job.path) as h5:
        images = h5.create_dataset("images", (job.count, depth, height, width, 1), np.float32)
        labels = h5.create_dataset("labels", (job.count, depth, height, width), np.uint8)
        for position in range(job.count):
            image, label = generate_segmentation_sample(
                job.seed, job.first_index + position, job.config
            )
            images[position] = image
            labels[position] = label
        for name, value in _expected_attributes(job).items():
            h5.attrs[name] = value
        h5.attrs["class_names"] = np.array(CLASS_NAMES, dtype="S")
    return job.path


def segmentation_file_status(job: SegmentationJob) -> tuple[str, str]:
    """Whether `job.path` already holds exactly the file `job` would write.

    Reads only metadata.

    Returns:
        (status, reason) with status one of "missing", "complete", "incomplete"
        (unreadable, or the same data set cut to another total count: rewrite it) and
        "mismatch" (a file of another data set: do not overwrite silently).
    """
    import h5py

    if not os.path.exists(job.path):
        return "missing", ""
    try:
        with h5py.File(job.path, "r") as h5:
            for name, expected in _expected_attributes(job).items():
                found = h5.attrs.get(name)
                same = found is not None and (
                    found == expected if isinstance(expected, str)
                    else np.array_equal(np.asarray(found), expected)
                )
                if not same:
                    found = None if found is None else np.asarray(found).tolist()
                    expected = np.asarray(expected).tolist()
                    return "mismatch", f"attribute {name}={found}, expected {expected}"
            images, labels = h5["images"], h5["labels"]
            expected_shape = (job.count,) + job.config.shape
            if (
                images.shape != expected_shape + (1,) or images.dtype != np.float32
                or labels.shape != expected_shape or labels.dtype != np.uint8
            ):
                return "incomplete", f"holds {labels.shape[0]} samples, expected {job.count}"
    except (OSError, KeyError) as error:
        return "incomplete", f"unreadable ({error})"
    return "complete", ""
