"""The spatially sharded HDF5 input pipeline: reader, order, bad input, several ranks."""

import math
import re
import os

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_spatial as ks
from keras_spatial import data as ks_data
from keras_spatial.data import InvalidDataError
from keras_spatial.data import UnreadableFileError
from tests.distributed.data_workers import ByteCounter

NUM_SAMPLES = 8
COSMO_SHAPE = (32, 32, 32, 2)  # (D, H, W, C); stored channels-first as (C, D, H, W)
VOLUME_SHAPE = (32, 32, 32, 1)  # many samples per file, with a label volume (D, H, W)
ODD_SHAPE = (9, 7, 7, 1)  # the same layout, extents that split unevenly (9 over 2: 5 + 4)


def cosmo_sample(index):
    rng = np.random.default_rng(index)
    return rng.integers(0, 30000, COSMO_SHAPE, dtype=np.int16)


def cosmo_label(index):
    return np.array([index, index + 0.5, -index, 1.0], np.float32)


def volume_sample(index, shape=VOLUME_SHAPE):
    rng = np.random.default_rng(100 + index)
    x = rng.integers(-1000, 1000, shape, dtype=np.int16)
    y = rng.integers(0, 3, shape[:3], dtype=np.int8)
    return x, y


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Two data sets of 8 samples: CosmoFlow style (one per file) and [N, ...] files."""
    root = tmp_path_factory.mktemp("hdf5")
    cosmo = []
    for i in range(NUM_SAMPLES):
        path = str(root / f"univ_{i}.h5")
        with h5py.File(path, "w") as f:
            f["full"] = np.transpose(cosmo_sample(i), (3, 0, 1, 2))  # channels first
            f["unitPar"] = cosmo_label(i)
        cosmo.append(path)
    volumes = []
    for part, members in enumerate([range(0, 5), range(5, 8)]):
        path = str(root / f"part_{part}.h5")
        pairs = [volume_sample(i) for i in members]
        with h5py.File(path, "w") as f:
            f["grp/x"] = np.stack([x for x, _ in pairs])
            f["grp/y"] = np.stack([y for _, y in pairs])
        volumes.append(path)
    odd = str(root / "odd.h5")
    with h5py.File(odd, "w") as f:
        pairs = [volume_sample(i, ODD_SHAPE) for i in range(NUM_SAMPLES)]
        f["grp/x"] = np.stack([x for x, _ in pairs])
        f["grp/y"] = np.stack([y for _, y in pairs])
    return {"root": root, "cosmo": cosmo, "volumes": volumes, "odd": [odd]}


def one_rank():
    return ks.SpatialStrategy((1, 1, 1))


def ids_of(ds):
    """The sample ids of every pass element, from the replicated CosmoFlow label."""
    return [int(v) for x, y in ds for v in y.numpy()[:, 0]]


# Reader ---------------------------------------------------------------------------
def test_one_sample_per_file_channels_first(files):
    dataset = ks_data.HDF5Dataset(
        files["cosmo"], x="full", y="unitPar", channels_first=True, preprocess=np.log1p
    )
    assert len(dataset) == NUM_SAMPLES and dataset.one_sample_per_file
    assert dataset.sample_shape == COSMO_SHAPE and dataset.label_shape == (4,)
    assert not dataset.y_sharded and dataset.file_dtype == np.int16
    region = (slice(16, 32), slice(0, 32), slice(8, 24))
    x, y = dataset.read(3, region)
    expected = np.log1p(cosmo_sample(3)[16:32, :, 8:24]).astype(np.float32)
    assert x.dtype == np.float32 and x.flags.c_contiguous
    np.testing.assert_allclose(x, expected, rtol=1e-6)
    np.testing.assert_array_equal(y, cosmo_label(3))
    assert "files=8, samples=8" in repr(dataset)


def test_glob_pattern_sorted(files):
    dataset = ks_data.HDF5Dataset(str(files["root"] / "univ_*.h5"), x="full", y="unitPar")
    assert dataset.paths == tuple(sorted(files["cosmo"]))


def test_many_samples_per_file_with_label_volume(files):
    dataset = ks_data.HDF5Dataset(files["volumes"], x="grp/x", y="grp/y", y_dtype="int32")
    assert len(dataset) == NUM_SAMPLES and not dataset.one_sample_per_file
    assert dataset.y_sharded and dataset.label_shape == VOLUME_SHAPE[:3]
    assert dataset.locate(6) == (files["volumes"][1], 1)
    region = (slice(0, 16), slice(16, 32), slice(0, 32))
    x, y = dataset.read(6, region)
    x_full, y_full = volume_sample(6)
    np.testing.assert_array_equal(x, x_full[0:16, 16:32])
    np.testing.assert_array_equal(y, y_full[0:16, 16:32])
    assert y.dtype == np.int32
    replicated = ks_data.HDF5Dataset(files["volumes"], x="grp/x", y="grp/y", y_sharded=False)
    np.testing.assert_array_equal(replicated.read(6, region)[1], y_full)


def test_crop_reads_a_sub_volume_as_if_stored_alone(files):
    crop = (slice(8, 24), slice(0, 16), slice(16, 32))
    dataset = ks_data.HDF5Dataset(
        files["cosmo"], x="full", y="unitPar", channels_first=True, crop=crop
    )
    assert dataset.sample_shape == (16, 16, 16, 2) and dataset.crop == crop
    assert "crop [8:24, 0:16, 16:32]" in repr(dataset)
    whole = ks_data.HDF5Dataset(files["cosmo"], x="full", y="unitPar", channels_first=True)
    assert dataset.fingerprint() != whole.fingerprint()
    x, y = dataset.read(2)
    np.testing.assert_array_equal(x, cosmo_sample(2)[8:24, 0:16, 16:32].astype(np.float32))
    np.testing.assert_array_equal(y, cosmo_label(2))
    x, _ = dataset.read(2, (slice(8, 16), slice(0, 16), slice(4, 12)))
    np.testing.assert_array_equal(x, cosmo_sample(2)[16:24, 0:16, 20:28].astype(np.float32))
    with pytest.raises(ValueError, match="inside the sample's extents"):
        dataset.read(2, (slice(0, 17), slice(0, 16), slice(0, 16)))
    volumes = ks_data.HDF5Dataset(files["volumes"], x="grp/x", y="grp/y", crop=(slice(0, 8),) * 3)
    assert volumes.label_shape == (8, 8, 8)
    x, y = volumes.read(6)
    x_full, y_full = volume_sample(6)
    np.testing.assert_array_equal(x, x_full[:8, :8, :8])
    np.testing.assert_array_equal(y, y_full[:8, :8, :8])


@pytest.mark.parametrize("crop", [(slice(0, 33),) * 3, (slice(0, 8),) * 2, (slice(4, 4),) * 3])
def test_crop_outside_the_sample_is_refused(files, crop):
    with pytest.raises(ValueError, match="`crop` must be three slices"):
        ks_data.HDF5Dataset(files["cosmo"], x="full", channels_first=True, crop=crop)


def test_files_with_no_samples_are_skipped(tmp_path):
    paths = [str(tmp_path / f"{n}.h5") for n in range(3)]
    for path, count in zip(paths, (2, 0, 3)):
        with h5py.File(path, "w") as f:
            f["x"] = np.arange(count * 8, dtype=np.float32).reshape(count, 2, 2, 2, 1)
    dataset = ks_data.HDF5Dataset(paths, x="x")
    assert len(dataset) == 5 and dataset.locate(2) == (paths[2], 0)
    np.testing.assert_array_equal(dataset.read(4)[0].ravel(), np.arange(16, 24))


def test_label_that_is_neither_vector_nor_volume(files, tmp_path):
    with pytest.raises(InvalidDataError, match="y_sharded=True"):
        ks_data.HDF5Dataset(files["cosmo"], x="full", y="unitPar", channels_first=True,
                            y_sharded=True)
    path = str(tmp_path / "odd_label.h5")
    with h5py.File(path, "w") as f:
        f["x"] = np.zeros((8, 8, 8, 1))
        f["y"] = np.zeros((8, 8, 4))
    with pytest.raises(InvalidDataError, match=r"neither a vector.*y_shape=\(8, 8, 4\)"):
        ks_data.HDF5Dataset(path, x="x", y="y")
    assert ks_data.HDF5Dataset(path, x="x", y="y", y_sharded=False).label_shape == (8, 8, 4)


def test_bytes_read_whole_sample_in_one_process(files):
    counter = ByteCounter()
    dataset = ks_data.HDF5Dataset(files["cosmo"], x="full", y="unitPar",
                                  channels_first=True, open_file=counter.open_file)
    counter.bytes_read = 0
    dataset.read(0)
    sample_bytes = np.prod(COSMO_SHAPE) * 2
    assert sample_bytes <= counter.bytes_read <= 1.05 * sample_bytes


def _kernel_bytes_read():
    with open("/proc/self/io") as stats:
        return next(int(line.split()[1]) for line in stats if line.startswith("rchar:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux /proc")
@pytest.mark.parametrize("region", [(slice(0, 16), slice(0, 32), slice(0, 32)),
                                    (slice(0, 32), slice(16, 32), slice(16, 32))])
def test_default_open_reads_only_the_hyperslab(files, region):
    # Counted by the kernel, with the default opener (HDF5's sec2 driver): without
    # turning off HDF5's 64 KiB sieve buffer, the width split would read the whole file.
    dataset = ks_data.HDF5Dataset(files["cosmo"], x="full", channels_first=True)
    before = _kernel_bytes_read()
    x, _ = dataset.read(5, region)
    read = _kernel_bytes_read() - before
    shard_bytes = x.size * 2  # int16 in the file
    assert shard_bytes <= read <= shard_bytes + 8192, (read, shard_bytes)


# Order ------------------------------------------------------------------------------
def test_data_group_order_disjoint_complete_and_seeded():
    n, batch = 10, 4
    for data_size in (1, 2, 4):
        for epoch in (0, 1):
            parts = [
                ks_data.data_group_order(n, batch, data_size=data_size, data_index=g,
                                         epoch=epoch, seed=7)
                for g in range(data_size)
            ]
            assert all(len(p) == 8 // data_size for p in parts)
            joined = np.concatenate(parts)
            assert len(set(joined.tolist())) == 8  # disjoint
            # Step by step, the groups' parts in group order make the global batch.
            steps = np.stack([p.reshape(2, -1) for p in parts], 1).reshape(-1)
            np.testing.assert_array_equal(
                steps, ks_data.epoch_order(n, epoch=epoch, seed=7)[:8])
    first = ks_data.epoch_order(10, epoch=0, seed=7)
    np.testing.assert_array_equal(first, ks_data.epoch_order(10, epoch=0, seed=7))
    assert not np.array_equal(first, ks_data.epoch_order(10, epoch=1, seed=7))
    assert not np.array_equal(first, ks_data.epoch_order(10, epoch=0, seed=8))
    np.testing.assert_array_equal(ks_data.epoch_order(5, epoch=3, shuffle=False), range(5))


def test_data_group_order_wraps_around_without_drop_remainder():
    order = ks_data.epoch_order(10, epoch=2, seed=1)
    parts = [
        ks_data.data_group_order(10, 4, data_size=2, data_index=g, epoch=2, seed=1,
                                 drop_remainder=False)
        for g in range(2)
    ]
    assert ks_data.steps_per_epoch(10, 4, drop_remainder=False) == 3
    np.testing.assert_array_equal(np.concatenate([parts[0][4:], parts[1][4:]]),
                                  np.concatenate([order[8:], order[:2]]))


def test_batch_size_must_split_over_data_groups():
    with pytest.raises(ValueError, match=r"divisible by the number of data groups, 4.*"
                                         r"Received: batch_size=6, data_size=4\."):
        ks_data.data_group_order(16, 6, data_size=4, data_index=0, epoch=0)
    with pytest.raises(ValueError, match="Received: batch_size=0"):
        ks_data.steps_per_epoch(16, 0)
    with pytest.raises(ValueError, match="Received: seed=-1"):
        ks_data.epoch_order(4, epoch=0, seed=-1)


# Pipeline in one process -----------------------------------------------------------
def test_pipeline_batches_orders_and_epochs(files):
    strategy = one_rank()
    dataset = ks_data.HDF5Dataset(files["cosmo"], x="full", y="unitPar", channels_first=True)
    ds = strategy.distribute_dataset(dataset, 3, seed=5)
    x_spec, y_spec = ds.element_spec
    assert x_spec.shape == (3,) + COSMO_SHAPE and x_spec.dtype == tf.float32
    assert y_spec.shape == (3, 4) and int(ds.cardinality()) == 2
    epochs = [ids_of(ds) for _ in range(3)]
    for epoch, ids in enumerate(epochs):
        assert ids == ks_data.epoch_order(8, epoch=epoch, seed=5)[:6].tolist()
    assert epochs[0] != epochs[1]
    assert ids_of(strategy.distribute_dataset(dataset, 3, seed=5)) == epochs[0]
    assert ids_of(strategy.distribute_dataset(dataset, 3, seed=5, initial_epoch=2)) == epochs[2]
    assert ids_of(strategy.distribute_dataset(dataset, 3, seed=6)) != epochs[0]
    assert ids_of(strategy.distribute_dataset(dataset, 3, shuffle=False)) == list(range(6))
    padded = strategy.distribute_dataset(dataset, 3, seed=5, drop_remainder=False)
    assert int(padded.cardinality()) == 3
    order = ks_data.epoch_order(8, epoch=0, seed=5).tolist()
    assert ids_of(padded) == order + order[:1]
    x, _ = next(iter(ds))  # the fourth pass over `ds`: epoch 3
    first = ks_data.epoch_order(8, epoch=3, seed=5)[0]
    np.testing.assert_array_equal(x[0].numpy(), cosmo_sample(first))


def test_pipeline_without_labels_and_sharded_labels(files):
    strategy = one_rank()
    inputs_only = ks_data.HDF5Dataset(files["volumes"], x="grp/x", dtype="int16")
    ds = strategy.distribute_dataset(inputs_only, 4, shuffle=False)
    assert ds.element_spec.shape == (4,) + VOLUME_SHAPE
    np.testing.assert_array_equal(next(iter(ds))[1].numpy(), volume_sample(1)[0])
    labelled = ks_data.HDF5Dataset(files["volumes"], x="grp/x", y="grp/y", y_dtype="int32")
    ds = strategy.distribute_dataset(labelled, 2, shuffle=False)
    assert ds.element_spec[1].shape == (2,) + VOLUME_SHAPE[:3]
    np.testing.assert_array_equal(next(iter(ds))[1][0].numpy(), volume_sample(0)[1])


class _RecordFirstVoxel(keras.layers.Layer):
    """Identity that records the first voxel of each batch when run eagerly."""

    def __init__(self, seen, **kwargs):
        super().__init__(**kwargs)
        self._record = seen.extend  # a bound method: Keras would copy a list attribute

    def compute_output_shape(self, input_shape):
        return input_shape

    def call(self, x):
        if tf.executing_eagerly():
            self._record(np.asarray(x)[:, 0, 0, 0, 0].tolist())
        return x


def test_model_fit_reshuffles_every_epoch(files):
    strategy = one_rank()
    dataset = ks_data.HDF5Dataset(files["cosmo"], x="full", y="unitPar", channels_first=True)
    ds = strategy.distribute_dataset(dataset, 4, seed=3)
    seen = []
    with strategy.scope():
        inputs = ks.Input(COSMO_SHAPE)
        hidden = _RecordFirstVoxel(seen)(inputs)
        outputs = keras.layers.Dense(4)(keras.layers.GlobalAveragePooling3D()(hidden))
        model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss="mse", run_eagerly=True)
    model.fit(ds, epochs=3, verbose=0, shuffle=False)
    first_voxels = {float(cosmo_sample(i)[0, 0, 0, 0]): i for i in range(8)}
    ids = [first_voxels[v] for v in seen]
    expected = [ks_data.epoch_order(8, epoch=e, seed=3).tolist() for e in range(3)]
    assert ids == sum(expected, [])


# Bad input -------------------------------------------------------------------------
def write(path, **datasets):
    with h5py.File(path, "w") as f:
        for key, value in datasets.items():
            f[key] = value
    return str(path)


def test_missing_file_or_pattern(files, tmp_path):
    missing = str(tmp_path / "nope.h5")
    with pytest.raises(UnreadableFileError, match=f"does not exist. Received: path='{missing}'"):
        ks_data.HDF5Dataset(files["cosmo"][:2] + [missing], x="full")
    with pytest.raises(UnreadableFileError, match="No file matches"):
        ks_data.HDF5Dataset(str(tmp_path / "*.nothing"), x="full")


def test_missing_key_or_group(files):
    with pytest.raises(InvalidDataError, match=r"'fulll' does not exist in file .*univ_0.h5.*"
                                               r"\['full', 'unitPar'\].*Received: x='fulll'"):
        ks_data.HDF5Dataset(files["cosmo"], x="fulll")
    with pytest.raises(InvalidDataError, match="'unitpar' does not exist.*Received: y='unitpar'"):
        ks_data.HDF5Dataset(files["cosmo"], x="full", y="unitpar")
    with pytest.raises(InvalidDataError, match="'grp' is a group, not a dataset"):
        ks_data.HDF5Dataset(files["volumes"], x="grp")


def test_shapes_differ_between_files(files, tmp_path):
    other = write(tmp_path / "small.h5", full=np.zeros((2, 32, 32, 16), np.int16),
                  unitPar=np.zeros(4, np.float32))
    with pytest.raises(InvalidDataError, match=r"'full' is \(2, 32, 32, 16\) int16 in file "
                                               r".*small.h5.*first file.*\(2, 32, 32, 32\)"):
        ks_data.HDF5Dataset(files["cosmo"] + [other], x="full", y="unitPar")
    other = write(tmp_path / "label.h5", full=np.zeros((2, 32, 32, 32), np.int16),
                  unitPar=np.zeros(3, np.float32))
    with pytest.raises(InvalidDataError, match=r"'unitPar' is \(3,\) float32"):
        ks_data.HDF5Dataset(files["cosmo"] + [other], x="full", y="unitPar")
    # A file of many samples among files of one sample each: ranks differ.
    with pytest.raises(InvalidDataError, match="part_0.h5"):
        ks_data.HDF5Dataset([files["cosmo"][0], files["volumes"][0]], x="full")
    counted = write(tmp_path / "count.h5", x=np.zeros((4, 8, 8, 8, 1)), y=np.zeros((3, 2)))
    with pytest.raises(InvalidDataError, match=r"one label per sample.*\(4\).*y_shape=\(3, 2\)"):
        ks_data.HDF5Dataset(counted, x="x", y="y")
    flat = write(tmp_path / "flat.h5", x=np.zeros((8, 8, 8)))
    with pytest.raises(InvalidDataError, match=r"with a channel axis.*shape=\(8, 8, 8\)"):
        ks_data.HDF5Dataset(flat, x="x")


def test_file_changed_after_description_fails_at_read(files, tmp_path):
    first = write(tmp_path / "a.h5", x=np.zeros((8, 8, 8, 1)))
    second = write(tmp_path / "b.h5", x=np.zeros((8, 8, 4, 1)))
    dataset = ks_data.HDF5Dataset([first, second], x="x", check_all_files=False)
    assert len(dataset) == 2
    with pytest.raises(InvalidDataError, match=r"b.h5' has shape \(8, 8, 4, 1\)"):
        dataset.read(1)


def test_dtype_that_cannot_be_cast(tmp_path):
    path = write(tmp_path / "text.h5", x=np.array([["a"] * 4] * 4, dtype="S1").reshape(1, 2, 2, 4),
                 y=np.zeros(2))
    with pytest.raises(InvalidDataError, match=r"'x' in file .*text.h5' has dtype \|S1.*"
                                               r"cannot be cast"):
        ks_data.HDF5Dataset(path, x="x", y="y")
    path = write(tmp_path / "complex.h5", x=np.zeros((2, 2, 2, 1)), y=np.zeros(2, np.complex64))
    with pytest.raises(InvalidDataError, match="complex64"):
        ks_data.HDF5Dataset(path, x="x", y="y")


def test_corrupt_and_truncated_files(files, tmp_path):
    garbage = tmp_path / "garbage.h5"
    garbage.write_bytes(os.urandom(4096))
    with pytest.raises(UnreadableFileError, match="not an HDF5 file.*garbage.h5"):
        ks_data.HDF5Dataset(files["cosmo"][:1] + [str(garbage)], x="full")
    truncated = tmp_path / "truncated.h5"
    truncated.write_bytes(open(files["cosmo"][1], "rb").read()[:50_000])
    with pytest.raises(UnreadableFileError, match="truncated.h5"):
        ks_data.HDF5Dataset([str(truncated)], x="full")


def test_damaged_data_fails_at_first_read_naming_the_file(tmp_path):
    path = str(tmp_path / "damaged.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.random.default_rng(0).random((4, 8, 8, 8, 1)),
                         chunks=(1, 8, 8, 8, 1), compression="gzip")
        offset = f["x"].id.get_chunk_info(2).byte_offset
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\xff" * 64)
    dataset = ks_data.HDF5Dataset(path, x="x")
    dataset.read(1)
    with pytest.raises(UnreadableFileError, match=r"damaged.h5' failed.*sample=2"):
        dataset.read(2)
    ds = one_rank().distribute_dataset(dataset, 4, shuffle=False)
    with pytest.raises(tf.errors.OpError, match="UnreadableFileError.*damaged.h5"):
        list(ds)


def test_preprocess_must_keep_shape(files):
    dataset = ks_data.HDF5Dataset(files["volumes"], x="grp/x", preprocess=lambda x: x[:1])
    with pytest.raises(InvalidDataError, match="keep the shape"):
        dataset.read(0)


def test_pipeline_argument_errors(files):
    strategy = one_rank()
    dataset = ks_data.HDF5Dataset(files["cosmo"], x="full", y="unitPar", channels_first=True)
    with pytest.raises(InvalidDataError, match="fewer than one global batch.*batch_size=16"):
        strategy.distribute_dataset(dataset, 16)
    with pytest.raises(TypeError, match="Received: dataset=list"):
        strategy.distribute_dataset([1, 2], 2)


# Several ranks -----------------------------------------------------------------------
def _case(name, files, spatial_shape, batch_size, **overrides):
    case = dict(name=name, spatial_shape=spatial_shape, paths=files["cosmo"], x="full",
                y="unitPar", channels_first=True, dtype="int16", y_dtype="float32",
                batch_size=batch_size, epochs=2, seed=11)
    case.update(overrides)
    return case


def _volume_case(name, files, spatial_shape, batch_size, odd=False, **overrides):
    return _case(name, files, spatial_shape, batch_size, paths=files["odd" if odd else "volumes"],
                 x="grp/x", y="grp/y", channels_first=False, y_dtype="int8", odd=odd, **overrides)


def _check_case(reports, case):
    """Reassemble every rank's shards and check order, coverage and bytes read."""
    reports = [r[case["name"]] for r in reports]
    mesh = ks.Mesh(world_size=len(reports), spatial_shape=case["spatial_shape"])
    volumes = case["x"] == "grp/x"
    shape = ODD_SHAPE if case.get("odd") else VOLUME_SHAPE
    originals = [volume_sample(i, shape) if volumes else (cosmo_sample(i), cosmo_label(i))
                 for i in range(NUM_SAMPLES)]
    extents = originals[0][0].shape[:3]
    augment = case.get("augment")
    seen = set()
    for epoch in range(case["epochs"]):
        group_ids = []
        for data_index in range(mesh.data_size):
            group = [reports[r] for r in mesh.spatial_group(data_index)]
            x_batches = [np.concatenate(r["passes"][epoch][0]) for r in group]
            y_batches = [np.concatenate(r["passes"][epoch][1]) for r in group]
            ids = ks_data.data_group_order(
                NUM_SAMPLES, case["batch_size"], data_size=mesh.data_size,
                data_index=data_index, epoch=epoch, seed=case["seed"])
            assert len(x_batches[0]) == len(ids)
            for position, sample in enumerate(ids):
                expected = originals[sample]
                if augment:
                    # What each rank of the group read must be its part of the numpy
                    # transform of the whole sample by the symmetry drawn for it.
                    symmetry = ks_data.augment.symmetries(augment)[ks_data.augment.draw(
                        augment, seed=case["seed"], epoch=epoch, index=int(sample))]
                    expected = (symmetry.apply(expected[0]),
                                symmetry.apply(expected[1]) if volumes else expected[1])
                    seen.add(symmetry)
                x_full = np.zeros_like(expected[0])
                y_full = np.zeros_like(expected[1])
                for report, xs, ys in zip(group, x_batches, y_batches):
                    box = tuple(slice(a, b) for a, b in mesh.shard_bounds(extents, report["coords"]))
                    x_full[box] = xs[position]
                    if volumes:
                        y_full[box] = ys[position]
                    else:
                        np.testing.assert_array_equal(ys[position], expected[1])
                        y_full = ys[position]
                np.testing.assert_array_equal(x_full, expected[0])
                np.testing.assert_array_equal(y_full, expected[1])
            group_ids.append(ids)
        joined = np.concatenate(group_ids)
        assert sorted(joined.tolist()) == list(range(NUM_SAMPLES))  # disjoint and complete
    if augment:  # enough draws that the identity alone would be a failure
        assert len(seen) > 3, seen
    # The shards matched these orders above, so the ranks saw a new order in epoch 1.
    assert not np.array_equal(
        ks_data.epoch_order(NUM_SAMPLES, epoch=0, seed=case["seed"]),
        ks_data.epoch_order(NUM_SAMPLES, epoch=1, seed=case["seed"]))
    # Measured bytes per sample read: this rank's 1/S of the sample's bytes, plus
    # at most 8 KiB of HDF5 metadata re-read at each open (superblock, group and object
    # headers; measured 1.5-5 KiB here) and the replicated label.
    sample_bytes = originals[0][0].nbytes + (originals[0][1].nbytes if volumes else 0)
    per_read = [r["bytes_read"] / r["samples_read"] for r in reports]
    share = [b / sample_bytes for b in per_read]
    print(f"{case['name']}: bytes read per sample / sample bytes = {share}")
    voxels = np.prod(extents)
    for r, b in zip(reports, per_read):  # this rank's share of the voxels (uneven shards too)
        mine = np.prod([b1 - b0 for b0, b1 in mesh.shard_bounds(extents, r["coords"])]) / voxels
        assert sample_bytes * mine <= b <= sample_bytes * mine + 8192, (per_read, sample_bytes, mine)
    return share


@pytest.mark.distributed
def test_two_ranks_depth_split(files):
    from tests.distributed.data_workers import read_shards
    from tests.distributed.launcher import run_on_ranks

    split = _case("split", files, (2, 1, 1), 2)
    disagree = _case("disagree", files, (2, 1, 1), 2, rank_seed=True)
    # Flips and permutations of depth, the split axis, and of axes across it; sharded labels.
    augmented = [_case("cube_depth", files, (2, 1, 1), 2, augment="cube", epochs=3),
                 _case("cube_width", files, (1, 1, 2), 2, augment="cube", epochs=3),
                 _volume_case("volumes_cube_depth", files, (2, 1, 1), 2, augment="cube"),
                 _volume_case("volumes_flips_width", files, (1, 1, 2), 2, augment="flips"),
                 # uneven shards (9 = 5 + 4 in depth, 7 = 4 + 3 in width), flipped and permuted
                 _volume_case("odd_depth", files, (2, 1, 1), 2, odd=True, augment="flips"),
                 _volume_case("odd_width", files, (1, 1, 2), 2, odd=True)]
    fit = _case("fit", files, (2, 1, 1), 2, dtype="float32")
    reports = run_on_ranks(read_shards, 2, [split, disagree] + augmented, fit)
    _check_case(reports, split)
    for case in augmented:
        _check_case(reports, case)
    for report in reports:
        assert report["disagree"]["error"].startswith("ValueError: All ranks must call")
        assert "Ranks [1] differ from rank 0" in report["disagree"]["error"]
        assert report["fit"]["input_shape"] == (None, 16, 32, 32, 2)
        assert report["fit"]["element_shape"] == (2, 16, 32, 32, 2)
        assert all(math.isfinite(v) for v in report["fit"]["loss"])


@pytest.mark.distributed
def test_four_ranks_spatial_and_hybrid(files, tmp_path):
    from tests.distributed.data_workers import read_shards
    from tests.distributed.launcher import run_on_ranks

    thin = write(tmp_path / "thin.h5", x=np.zeros((4, 1, 8, 8, 1), np.int16), y=np.zeros((4, 2)))
    cases = [
        _case("height_width", files, (1, 2, 2), 2),
        _case("hybrid", files, (2, 1, 1), 4),
        _volume_case("volumes_hybrid", files, (2, 1, 1), 4),
        _volume_case("volumes_spatial", files, (1, 2, 2), 2),
        _case("cube_hybrid", files, (2, 1, 1), 4, augment="cube", epochs=3),
        _case("cube_height_width", files, (1, 2, 2), 2, augment="cube", epochs=3),
        _volume_case("volumes_cube_hybrid", files, (2, 1, 1), 4, augment="cube"),
        _volume_case("volumes_cube_spatial", files, (1, 2, 2), 2, augment="cube"),
        _volume_case("odd_spatial", files, (1, 2, 2), 2, odd=True, augment="flips"),
        _case("thin", files, (2, 1, 1), 2, paths=[thin], x="x", y="y", channels_first=False),
    ]
    reports = run_on_ranks(read_shards, 4, cases)
    for case in cases[:-1]:
        _check_case(reports, case)
    for report in reports:
        assert "The depth extent 1 is smaller than its 2 shards" in report["thin"]["error"]
        assert "thin.h5" in report["thin"]["error"]
        assert report["thin"]["error"].startswith("InvalidDataError")


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_damaged_file_on_one_rank_ends_the_job(tmp_path, capfd):
    from tests.distributed.data_workers import fit_with_damaged_file
    from tests.distributed.launcher import run_on_ranks

    path = str(tmp_path / "damaged.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.random.default_rng(0).random((4, 8, 8, 8, 1)),
                         chunks=(1, 4, 8, 8, 1), compression="gzip")
        f["y"] = np.zeros((4, 2))
        offset = f["x"].id.get_chunk_info(5).byte_offset  # sample 2, depth 4:8 (rank 1)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\xff" * 64)
    with pytest.raises(RuntimeError, match="non-zero status"):
        run_on_ranks(fit_with_damaged_file, 2, path)
    assert re.search(r"\[1\].*UnreadableFileError: Reading dataset 'x' of file '.*damaged.h5' "
                     r"failed.*sample=2, region=\[4:8, 0:8, 0:8\]", capfd.readouterr().err)
