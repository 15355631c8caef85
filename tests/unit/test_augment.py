"""Augmentation by the symmetries of the cube: arithmetic, sharded reads, bad settings.

The several-rank checks (each rank's shard of a transformed sample equals its part of the
numpy transform of the whole sample) are in tests/distributed/test_data_pipeline.py.
"""

import itertools

import h5py
import numpy as np
import pytest

import keras_spatial as ks
from keras_spatial import data as ks_data
from keras_spatial.data import augment

SHAPE = (6, 6, 6, 2)


def numpy_transform(x, permutation, flips):
    """The documented meaning of a symmetry, written independently of `apply`."""
    out = np.transpose(x, tuple(permutation) + tuple(range(3, x.ndim)))
    for axis in range(3):
        if flips[axis]:
            out = out[(slice(None),) * axis + (slice(None, None, -1),)]
    return out


def regions(extents):
    """Every box of a 2 x 1 x 2 split and a few odd boxes of `extents`."""
    boxes = [tuple(slice(0, e) for e in extents)]
    boxes += [(slice(c * extents[0] // 2, (c + 1) * extents[0] // 2), slice(0, extents[1]),
               slice(w * extents[2] // 2, (w + 1) * extents[2] // 2))
              for c in range(2) for w in range(2)]
    boxes += [(slice(1, 4), slice(0, 2), slice(5, 6)), (slice(0, 1), slice(2, 6), slice(1, 3))]
    return boxes


def test_symmetries_are_the_48_of_the_cube_and_8_flips():
    cube, flips = augment.symmetries("cube"), augment.symmetries("flips")
    assert len(cube) == 48 and len(flips) == 8
    assert cube[0].is_identity and flips[0].is_identity
    assert set(flips) <= set(cube)
    x = np.random.default_rng(0).random(SHAPE)
    images = {symmetry.apply(x).tobytes() for symmetry in cube}
    assert len(images) == 48  # all different on a random sample


def test_apply_is_the_numpy_transform_and_regions_map_back():
    x = np.random.default_rng(1).random(SHAPE)
    for symmetry in augment.symmetries("cube"):
        whole = symmetry.apply(x)
        np.testing.assert_array_equal(whole, numpy_transform(x, *symmetry))
        for region in regions(SHAPE[:3]):
            source = symmetry.source_region(region, SHAPE[:3])
            np.testing.assert_array_equal(symmetry.apply(x[source]), whole[region])


def test_flips_of_a_non_cubic_box():
    shape = (4, 6, 8, 1)
    x = np.random.default_rng(2).random(shape)
    for symmetry in augment.symmetries("flips"):
        for region in ((slice(0, 2), slice(3, 6), slice(0, 8)), (slice(1, 4), slice(0, 1), slice(2, 7))):
            source = symmetry.source_region(region, shape[:3])
            np.testing.assert_array_equal(symmetry.apply(x[source]), symmetry.apply(x)[region])


def test_draw_depends_only_on_seed_epoch_and_index():
    draws = [augment.draw("cube", seed=3, epoch=e, index=i) for e in range(4) for i in range(50)]
    again = [augment.draw("cube", seed=3, epoch=e, index=i) for e in range(4) for i in range(50)]
    assert draws == again
    assert set(draws) == set(range(48))  # 200 draws reach every symmetry
    assert draws != [augment.draw("cube", seed=4, epoch=e, index=i)
                     for e in range(4) for i in range(50)]
    assert all(0 <= augment.draw("flips", seed=0, epoch=0, index=i) < 8 for i in range(20))


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """Four channels-first samples (one per file) with a vector label, and one file of
    four channels-last samples with a label volume."""
    root = tmp_path_factory.mktemp("augment")
    rng = np.random.default_rng(5)
    samples = rng.integers(0, 1000, (4,) + SHAPE).astype(np.int16)
    paths = []
    for i, sample in enumerate(samples):
        path = str(root / f"univ_{i}.h5")
        with h5py.File(path, "w") as f:
            f["full"] = np.transpose(sample, (3, 0, 1, 2))
            f["unitPar"] = np.full(4, i, np.float32)
        paths.append(path)
    labels = rng.integers(0, 3, (4,) + SHAPE[:3]).astype(np.int8)
    volumes = str(root / "volumes.h5")
    with h5py.File(volumes, "w") as f:
        f["x"], f["y"] = samples, labels
    return {"paths": paths, "samples": samples, "volumes": volumes, "labels": labels}


def test_transformed_read_equals_transform_of_the_whole_sample(stored):
    cosmo = ks_data.HDF5Dataset(stored["paths"], x="full", y="unitPar", channels_first=True,
                                dtype="int16")
    volumes = ks_data.HDF5Dataset(stored["volumes"], x="x", y="y", dtype="int16", y_dtype="int8")
    for symmetry in augment.symmetries("cube")[::5]:
        for region in regions(SHAPE[:3]):
            x, y = cosmo.read(2, region, symmetry)
            np.testing.assert_array_equal(x, numpy_transform(stored["samples"][2], *symmetry)[region])
            assert y.tolist() == [2.0] * 4  # replicated labels are left as they are
            x, y = volumes.read(1, region, symmetry)
            np.testing.assert_array_equal(x, numpy_transform(stored["samples"][1], *symmetry)[region])
            np.testing.assert_array_equal(y, numpy_transform(stored["labels"][1], *symmetry)[region])


def test_transformed_read_of_a_crop(stored):
    crop = (slice(1, 5), slice(2, 6), slice(0, 4))
    dataset = ks_data.HDF5Dataset(stored["paths"], x="full", channels_first=True, dtype="int16",
                                  crop=crop)
    cropped = stored["samples"][3][crop]
    for symmetry in augment.symmetries("cube"):
        region = (slice(0, 2), slice(1, 4), slice(0, 4))
        np.testing.assert_array_equal(dataset.read(3, region, symmetry)[0],
                                      numpy_transform(cropped, *symmetry)[region])


def test_pipeline_applies_the_drawn_symmetry_every_epoch(stored):
    strategy = ks.SpatialStrategy((1, 1, 1))
    dataset = ks_data.HDF5Dataset(stored["volumes"], x="x", y="y", dtype="int16", y_dtype="int8")
    ds = strategy.distribute_dataset(dataset, 2, seed=7, augment="cube")
    table = augment.symmetries("cube")
    used = set()
    for epoch in range(3):
        order = ks_data.data_group_order(4, 2, data_size=1, data_index=0, epoch=epoch, seed=7)
        xs, ys = zip(*[(x.numpy(), y.numpy()) for x, y in ds])
        for sample, x, y in zip(order, np.concatenate(xs), np.concatenate(ys)):
            symmetry = table[augment.draw("cube", seed=7, epoch=epoch, index=int(sample))]
            used.add(symmetry)
            np.testing.assert_array_equal(x, symmetry.apply(stored["samples"][sample]))
            np.testing.assert_array_equal(y, symmetry.apply(stored["labels"][sample]))
    assert len(used) > 3
    plain = strategy.distribute_dataset(dataset, 2, seed=7)
    order = ks_data.data_group_order(4, 2, data_size=1, data_index=0, epoch=0, seed=7)
    np.testing.assert_array_equal(np.concatenate([x.numpy() for x, _ in plain]),
                                  stored["samples"][order])


@pytest.mark.parametrize("bad", ["rotations", True, 48, ""])
def test_unknown_augmentation_is_refused(stored, bad):
    strategy = ks.SpatialStrategy((1, 1, 1))
    dataset = ks_data.HDF5Dataset(stored["volumes"], x="x", y="y")
    with pytest.raises(ValueError, match=r"`augment` must be None, 'flips'.*Received: augment="):
        strategy.distribute_dataset(dataset, 2, augment=bad)
    with pytest.raises(ValueError, match="`augment` must be None"):
        augment.symmetries(bad)


def test_cube_augmentation_of_non_cubic_samples_is_refused(stored):
    strategy = ks.SpatialStrategy((1, 1, 1))
    crop = (slice(0, 6), slice(0, 6), slice(0, 4))
    dataset = ks_data.HDF5Dataset(stored["volumes"], x="x", y="y", crop=crop)
    with pytest.raises(ValueError, match=r"samples must be cubic; use augment='flips'.*\(6, 6, 4\)"):
        strategy.distribute_dataset(dataset, 2, augment="cube")
    strategy.distribute_dataset(dataset, 2, augment="flips")  # flips need no equal extents
    swap = augment.CubeSymmetry((2, 1, 0), (False, False, False))
    with pytest.raises(ValueError, match="permutes axes of unequal extents"):
        dataset.read(0, transform=swap)


def test_every_permutation_and_flip_pattern_is_listed():
    listed = {(s.permutation, s.flips) for s in augment.symmetries("cube")}
    expected = set(itertools.product(itertools.permutations(range(3)),
                                     itertools.product((False, True), repeat=3)))
    assert listed == expected
