"""The process mesh: world = data groups x spatial ranks. Pure arithmetic, no Horovod.

Ranks of one spatial group are contiguous::

    rank = data_index * S + spatial_index
    spatial_index = (i_d * sh + i_h) * sw + i_w

so halo traffic stays inside a node when ranks are placed node by node.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from keras_spatial.halo import split_bounds

SPATIAL_AXES = ("depth", "height", "width")


def _as_spatial_shape(spatial_shape: Sequence[int]) -> tuple[int, int, int]:
    shape = tuple(int(s) for s in spatial_shape)
    if len(shape) != 3 or any(s < 1 for s in shape):
        raise ValueError(
            "`spatial_shape` must be three positive integers (depth, height, "
            f"width splits). Received: spatial_shape={tuple(spatial_shape)}"
        )
    return shape


@dataclasses.dataclass(frozen=True)
class Mesh:
    """A world of `world_size` ranks arranged as data groups x a 3D spatial grid.

    Args:
        world_size: number of ranks in the job.
        spatial_shape: how many shards each sample is split into along
            (depth, height, width).

    Raises:
        ValueError: if `world_size` is not a multiple of the spatial size.

    Example:
    >>> mesh = Mesh(world_size=4, spatial_shape=(2, 1, 1))
    >>> mesh.data_size, mesh.coords(3)
    (2, (1, 0, 0))
    """

    world_size: int
    spatial_shape: tuple[int, int, int]

    def __post_init__(self):
        object.__setattr__(self, "spatial_shape", _as_spatial_shape(self.spatial_shape))
        if int(self.world_size) < 1:
            raise ValueError(
                f"`world_size` must be at least 1. Received: world_size={self.world_size}"
            )
        object.__setattr__(self, "world_size", int(self.world_size))
        if self.world_size % self.spatial_size:
            raise ValueError(
                "The world size must be a multiple of the spatial size "
                f"{self.spatial_size} (= {'x'.join(map(str, self.spatial_shape))}), "
                "so that the ranks form whole data groups. Received: "
                f"world_size={self.world_size}, spatial_shape={self.spatial_shape}"
            )

    @property
    def spatial_size(self) -> int:
        """Number of ranks sharing one sample (S = sd * sh * sw)."""
        sd, sh, sw = self.spatial_shape
        return sd * sh * sw

    @property
    def data_size(self) -> int:
        """Number of data-parallel groups (world_size / S)."""
        return self.world_size // self.spatial_size

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(
                f"Rank out of range for a world of {self.world_size}. Received: rank={rank}"
            )

    def data_index(self, rank: int) -> int:
        """The data group of `rank`."""
        self._check_rank(rank)
        return rank // self.spatial_size

    def spatial_index(self, rank: int) -> int:
        """The position of `rank` inside its spatial group (0 .. S-1)."""
        self._check_rank(rank)
        return rank % self.spatial_size

    def coords(self, rank: int) -> tuple[int, int, int]:
        """The (i_d, i_h, i_w) shard coordinates of `rank`."""
        return self.coords_of_spatial_index(self.spatial_index(rank))

    def coords_of_spatial_index(self, spatial_index: int) -> tuple[int, int, int]:
        """The (i_d, i_h, i_w) coordinates of a position inside a spatial group."""
        _, sh, sw = self.spatial_shape
        return (spatial_index // (sh * sw), (spatial_index // sw) % sh, spatial_index % sw)

    def spatial_index_of(self, coords: Sequence[int]) -> int:
        """Inverse of `coords_of_spatial_index`."""
        i_d, i_h, i_w = coords
        _, sh, sw = self.spatial_shape
        return (i_d * sh + i_h) * sw + i_w

    def rank_of(self, data_index: int, coords: Sequence[int]) -> int:
        """The rank at `coords` in data group `data_index`."""
        return data_index * self.spatial_size + self.spatial_index_of(coords)

    def spatial_group(self, data_index: int) -> list[int]:
        """Ranks that share the samples of data group `data_index`, in spatial order."""
        start = data_index * self.spatial_size
        return list(range(start, start + self.spatial_size))

    def spatial_groups(self) -> list[list[int]]:
        """All spatial groups (one per data group)."""
        return [self.spatial_group(d) for d in range(self.data_size)]

    def position_group(self, spatial_index: int) -> list[int]:
        """Ranks holding the same spatial position in every data group."""
        return [d * self.spatial_size + spatial_index for d in range(self.data_size)]

    def position_groups(self) -> list[list[int]]:
        """All position groups (one per spatial position)."""
        return [self.position_group(i) for i in range(self.spatial_size)]

    def neighbour(self, rank: int, axis: int, offset: int) -> Optional[int]:
        """The rank `offset` shards away along spatial `axis` (0, 1, 2), or None."""
        coords = list(self.coords(rank))
        coords[axis] += offset
        if not 0 <= coords[axis] < self.spatial_shape[axis]:
            return None
        return self.rank_of(self.data_index(rank), coords)

    def local_extents(self, global_extents: Sequence[int],
                      coords: Optional[Sequence[int]] = None) -> tuple[int, int, int]:
        """Extents of the shard at `coords` of a (D, H, W) volume split over the grid
        (`keras_spatial.halo.split_bounds`: where an extent does not divide by its shards,
        the first shards hold one plane more).

        Args:
            global_extents: the whole volume's (D, H, W).
            coords: the shard's grid coordinates. Without them, every extent must divide
                by its shards (all shards have the same extents).

        Raises:
            ValueError: if an extent is unknown or smaller than its number of shards, or,
                without `coords`, does not divide by it.
        """
        return tuple(stop - start for start, stop in self.shard_bounds(global_extents, coords))

    def splits_evenly(self, global_extents: Sequence[int]) -> bool:
        """Whether every extent of the (D, H, W) volume divides by its shards (all shards
        then have the same extents)."""
        return all(extent % shards == 0 for extent, shards in zip(global_extents, self.spatial_shape))

    def shard_bounds(self, global_extents: Sequence[int],
                     coords: Optional[Sequence[int]] = None) -> tuple[tuple[int, int], ...]:
        """The global intervals [start, stop) along D, H and W of the shard at `coords`
        (see `local_extents`; without `coords`, the first shard's, extents dividing)."""
        bounds = []
        for axis, (extent, shards) in enumerate(zip(global_extents, self.spatial_shape)):
            if extent is None:
                raise ValueError(
                    f"The {SPATIAL_AXES[axis]} extent must be known to split a volume. "
                    f"Received: global_extents={tuple(global_extents)}"
                )
            if coords is None and extent % shards:
                raise ValueError(
                    f"The {SPATIAL_AXES[axis]} extent {extent} cannot be split evenly into "
                    f"{shards} shards. Received: global_extents={tuple(global_extents)}, "
                    f"spatial_shape={self.spatial_shape}"
                )
            if extent < shards:
                raise ValueError(
                    f"The {SPATIAL_AXES[axis]} extent {extent} is smaller than its {shards} "
                    f"shards: every shard must hold at least one plane. Received: "
                    f"global_extents={tuple(global_extents)}, spatial_shape={self.spatial_shape}"
                )
            bounds.append(split_bounds(int(extent), shards)[0 if coords is None else coords[axis]])
        return tuple(bounds)
