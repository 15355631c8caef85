"""Symmetries of the cube as data augmentation of sharded samples. Pure arithmetic.

A `CubeSymmetry` maps a sample `x` of shape `(D, H, W, ...)` (channels and any label
axes after the three spatial ones) to

    np.flip(np.transpose(x, permutation + rest), axis=[a for a in 0..2 if flips[a]])

that is: output spatial axis `a` is input axis `permutation[a]`, then the output axes
with `flips[a]` are reversed. The 6 permutations times the 8 flip patterns are the 48
symmetries of the cube (rotations and reflections), exact for statistically isotropic
data such as cosmological boxes.

A rank that holds the output hyperslab `region` of the transformed sample needs the
input hyperslab `source_region(region)` of the stored sample, transformed locally by
`apply`: no rank ever needs another rank's voxels, so augmentation costs no
communication and reads the same bytes as an unaugmented read.

The transform of a sample is drawn from `(seed, epoch, index)` alone (`draw`), so every
rank of a spatial group applies the same one to its own shard of the sample.
"""

from __future__ import annotations

import functools
import itertools
from typing import NamedTuple, Optional, Sequence

import numpy as np

AUGMENTATIONS = ("flips", "cube")
# Fourth entry of the random generator's seed: keeps the augmentation stream apart from
# the sample order's (which is seeded with [seed, epoch]).
_AUGMENT_STREAM = 0x5A4D


class CubeSymmetry(NamedTuple):
    """One symmetry of the cube: an axis permutation, then flips of output axes.

    Attributes:
        permutation: output spatial axis `a` is input axis `permutation[a]`.
        flips: `flips[a]` reverses output axis `a` (after the permutation).
    """

    permutation: tuple[int, int, int] = (0, 1, 2)
    flips: tuple[bool, bool, bool] = (False, False, False)

    @property
    def is_identity(self) -> bool:
        """Whether the symmetry leaves every sample as it is."""
        return self.permutation == (0, 1, 2) and not any(self.flips)

    def source_region(
        self, region: Sequence[slice], extents: Sequence[int]
    ) -> tuple[slice, ...]:
        """The hyperslab of the stored sample that holds output `region`.

        Args:
            region: three slices (depth, height, width) with integer bounds in the
                coordinates of the transformed sample.
            extents: the three spatial extents of the stored sample.

        Returns:
            Three slices in the stored sample's axis order.
        """
        source: list = [None, None, None]
        for axis, (part, flipped) in enumerate(zip(region, self.flips)):
            extent = extents[self.permutation[axis]]
            start, stop = (extent - part.stop, extent - part.start) if flipped else (
                part.start, part.stop)
            source[self.permutation[axis]] = slice(start, stop)
        return tuple(source)

    def apply(self, block: np.ndarray) -> np.ndarray:
        """The transform of `block` (spatial axes first, any axes after them).

        Applied to a whole sample it is the transformed sample; applied to the block
        read from `source_region(region)` it is the output `region` of it.
        """
        if self.is_identity:
            return block
        axes = tuple(self.permutation) + tuple(range(3, block.ndim))
        out = np.transpose(block, axes)
        flipped = tuple(a for a in range(3) if self.flips[a])
        if flipped:
            out = np.flip(out, axis=flipped)
        return np.ascontiguousarray(out)


@functools.lru_cache(maxsize=None)
def symmetries(kind: str) -> tuple[CubeSymmetry, ...]:
    """The symmetries an augmentation draws from, identity first.

    Args:
        kind: "flips" (the 8 reflections along any of the three axes; any extents) or
            "cube" (all 48 symmetries of the cube; cubic samples only).

    Raises:
        ValueError: for another `kind`.
    """
    check_augment(kind)
    flips = tuple(itertools.product((False, True), repeat=3))
    permutations = ((0, 1, 2),) if kind == "flips" else tuple(itertools.permutations(range(3)))
    return tuple(CubeSymmetry(p, f) for p in permutations for f in flips)


def check_augment(augment: Optional[str], extents: Optional[Sequence[int]] = None) -> None:
    """Raise a clear error for an augmentation that cannot apply to samples of `extents`.

    Raises:
        ValueError: `augment` is not None, "flips" or "cube", or it is "cube" and the
            three spatial extents differ (an axis permutation would change the shape).
    """
    if augment is not None and (not isinstance(augment, str) or augment not in AUGMENTATIONS):
        raise ValueError(
            f"`augment` must be None, 'flips' (8 reflections) or 'cube' (the 48 symmetries "
            f"of the cube). Received: augment={augment!r}."
        )
    if augment == "cube" and extents is not None and len(set(int(e) for e in extents)) != 1:
        raise ValueError(
            "augment='cube' permutes the spatial axes, so the samples must be cubic; "
            f"use augment='flips' for samples of extents {tuple(extents)}. "
            f"Received: augment='cube', sample extents={tuple(extents)}."
        )


def draw(kind: str, *, seed: int, epoch: int, index: int) -> int:
    """The position in `symmetries(kind)` of the symmetry applied to sample `index` in
    `epoch`: uniform, from NumPy's PCG64 seeded with `[seed, epoch, index, stream]`, so
    the same on every rank and every machine."""
    count = len(symmetries(kind))
    rng = np.random.default_rng([int(seed), int(epoch), int(index), _AUGMENT_STREAM])
    return int(rng.integers(count))
