import pytest

from keras_spatial.mesh import Mesh


def test_rank_layout_is_contiguous_per_spatial_group():
    mesh = Mesh(world_size=8, spatial_shape=(1, 2, 2))
    assert mesh.data_size == 2 and mesh.spatial_size == 4
    assert mesh.spatial_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert mesh.position_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [mesh.coords(r) for r in range(4)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert mesh.data_index(5) == 1 and mesh.spatial_index(5) == 1


def test_coords_round_trip_every_rank():
    mesh = Mesh(world_size=24, spatial_shape=(2, 3, 2))
    for rank in range(24):
        assert mesh.rank_of(mesh.data_index(rank), mesh.coords(rank)) == rank


def test_neighbours():
    mesh = Mesh(world_size=8, spatial_shape=(2, 2, 2))
    assert mesh.neighbour(0, 0, 1) == 4
    assert mesh.neighbour(0, 2, 1) == 1
    assert mesh.neighbour(0, 1, -1) is None
    assert mesh.neighbour(7, 1, -1) == 5


def test_world_not_multiple_of_spatial_size_raises():
    with pytest.raises(ValueError, match="multiple of the spatial size 4.*world_size=6"):
        Mesh(world_size=6, spatial_shape=(2, 2, 1))


@pytest.mark.parametrize("shape", [(2, 1), (0, 1, 1), (2, -1, 1)])
def test_bad_spatial_shape_raises(shape):
    with pytest.raises(ValueError, match="spatial_shape"):
        Mesh(world_size=2, spatial_shape=shape)


def test_local_extents():
    mesh = Mesh(world_size=4, spatial_shape=(2, 1, 2))
    assert mesh.local_extents((16, 12, 10)) == (8, 12, 5)
    with pytest.raises(ValueError, match="width extent 9 cannot be split evenly into 2"):
        mesh.local_extents((16, 12, 9))


def test_rank_out_of_range_raises():
    with pytest.raises(ValueError, match="rank=4"):
        Mesh(world_size=4, spatial_shape=(2, 1, 1)).coords(4)
