"""Synthetic data sets (recipes/) and their command-line writers (tools/).

Statistics, reproducibility, file formats, resume and parallel writing. Small grids
(32^3 to 64^3) keep the whole file at a few seconds.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from recipes.writing import atomic_h5_file, check_seed, progress_bar, run_jobs, sample_rng
from recipes.cosmoflow import universe as uv
from recipes.unet3d import segmentation as seg

REPO = Path(__file__).resolve().parents[2]
FIDUCIAL = dict(omega_m=0.3, sigma_8=0.8, n_s=0.96, h=0.7)


def _load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def universes_cli():
    return _load_tool("write_universes")


@pytest.fixture(scope="module")
def segmentation_cli():
    return _load_tool("write_segmentation")


def _run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, f"tools/{name}.py", *args],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )


def _file_bytes(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


# ---------------------------------------------------------------- cosmology


def test_transfer_function_is_one_on_large_scales_and_decreasing():
    cosmology = uv.Cosmology(**FIDUCIAL)
    k = np.logspace(-4, 1, 200)
    transfer = cosmology.transfer(k)
    assert transfer[0] == pytest.approx(1.0, abs=2e-3)
    assert np.all(np.diff(transfer) < 0)
    assert cosmology.power(0.0) == 0.0


def test_growth_factor_matches_known_limits():
    einstein_de_sitter = uv.Cosmology(omega_m=1.0, sigma_8=0.8, n_s=0.96, h=0.7)
    z = np.array([0.0, 0.5, 1.5, 3.0])
    np.testing.assert_allclose(einstein_de_sitter.growth(z), 1.0 / (1.0 + z), rtol=1e-12)
    lcdm = uv.Cosmology(**FIDUCIAL)
    assert lcdm.growth(0.0) == pytest.approx(1.0)
    # Exact LambdaCDM (Omega_m = 0.3) gives D(1) = 0.608; CPT is good to ~1%.
    assert lcdm.growth(1.0) == pytest.approx(0.608, abs=0.008)
    assert np.all(np.diff(lcdm.growth(z)) < 0)


def test_sigma8_normalization_is_self_consistent():
    low, high = uv.Cosmology(**{**FIDUCIAL, "sigma_8": 0.7}), uv.Cosmology(**FIDUCIAL)
    assert high.sigma_r(8.0) == pytest.approx(0.8, rel=1e-9)
    assert high.amplitude / low.amplitude == pytest.approx((0.8 / 0.7) ** 2)
    assert high.sigma_r(8.0, z=1.0) == pytest.approx(0.8 * high.growth(1.0))


def test_cosmology_rejects_non_physical_values():
    with pytest.raises(ValueError, match=r"Received: omega_m=1.5\."):
        uv.Cosmology(**{**FIDUCIAL, "omega_m": 1.5})
    with pytest.raises(ValueError, match=r"Received: sigma_8=-0.1\."):
        uv.Cosmology(**{**FIDUCIAL, "sigma_8": -0.1})


# ---------------------------------------------------------------- field statistics

# W = 64 and 8 Mpc/h cells: k from the fundamental k_f to half Nyquist (16 k_f).
SIZE, BOX = 64, 512.0
EDGES_IN_KF = np.array([1, 2, 4, 8, 12, 16])


def _binned_power_ratio(field: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per bin: mean over modes of measured |field_k|^2 / target(k), and mode count."""
    measured = np.abs(uv.rfftn3(field)) ** 2 * (BOX / SIZE) ** 3 / SIZE**3
    shell = np.sqrt(uv.mode_numbers_squared(SIZE))
    weights = np.broadcast_to(uv.rfft_mode_weights(SIZE), shell.shape)
    which = np.digitize(shell, EDGES_IN_KF) - 1
    keep = (shell > 0) & (which >= 0) & (which < len(EDGES_IN_KF) - 1)
    ratio = measured[keep] / target[keep]
    bins = len(EDGES_IN_KF) - 1
    modes = np.bincount(which[keep], weights[keep], bins)
    return np.bincount(which[keep], weights[keep] * ratio, bins) / modes, modes


def _power_agrees(ratios: np.ndarray, modes: np.ndarray, inflation: float) -> np.ndarray:
    """Per-bin test that the mean ratio over realizations is 1.

    For a Gaussian field each of the modes/2 independent |field_k|^2 / P is exponential
    (mean 1, variance 1), so the mean over R realizations has standard error
    1 / sqrt(R modes / 2). `inflation` widens it for non-Gaussian fields; the bound is
    4 standard errors.
    """
    error = inflation / np.sqrt(ratios.shape[0] * modes / 2.0)
    return np.abs(ratios.mean(axis=0) - 1.0) <= 4.0 * error


def _lognormal_ratios(cosmology: uv.Cosmology, target: np.ndarray, realizations: int):
    power = uv.power_on_grid(cosmology, size=SIZE, box_size=BOX)
    ratios = []
    for index in range(realizations):
        noise = uv.white_noise_modes(sample_rng(11, index, 1), SIZE)
        delta = uv.lognormal_density(noise, power, size=SIZE, box_size=BOX)
        ratio, modes = _binned_power_ratio(delta, target)
        ratios.append(ratio)
    return np.array(ratios), modes


def test_power_spectrum_estimator_normalization_on_white_noise():
    noise = np.random.default_rng(0).standard_normal((SIZE,) * 3).astype(np.float32)
    k_f = 2 * np.pi / BOX
    _, power, modes = uv.power_spectrum(noise, box_size=BOX, k_edges=k_f * EDGES_IN_KF)
    cell_volume = (BOX / SIZE) ** 3
    tolerance = float(4 / np.sqrt(modes[1:].min() / 2))
    np.testing.assert_allclose(power[1:] / cell_volume, 1.0, atol=tolerance)
    assert modes[0] == 26  # |n|^2 in {1, 2, 3}: 6 + 12 + 8 modes.


def test_gaussian_field_has_target_power():
    power = uv.power_on_grid(uv.Cosmology(**FIDUCIAL), size=SIZE, box_size=BOX)
    target, _ = uv.lognormal_gaussian_power(power, size=SIZE, box_size=BOX)
    ratios = []
    for index in range(4):
        noise = uv.white_noise_modes(sample_rng(5, index, 1), SIZE)
        field = uv.gaussian_field(noise, target, size=SIZE, box_size=BOX)
        ratio, modes = _binned_power_ratio(field, target)
        ratios.append(ratio)
    assert np.all(_power_agrees(np.array(ratios), modes, inflation=1.0))


# The lognormal delta (sigma_delta^2 ~ 1.6 per 8 Mpc/h cell at z = 0) is non-Gaussian:
# the scatter of its binned power, measured over 64 realizations, is 1.0-1.6 times the
# Gaussian value; `inflation=2` covers that.
LOGNORMAL_INFLATION = 2.0


def test_lognormal_density_has_target_power():
    cosmology = uv.Cosmology(**FIDUCIAL)
    target = uv.power_on_grid(cosmology, size=SIZE, box_size=BOX)
    ratios, modes = _lognormal_ratios(cosmology, target, realizations=16)
    assert np.all(_power_agrees(ratios, modes, LOGNORMAL_INFLATION)), ratios.mean(axis=0)


def test_power_check_rejects_a_field_with_the_wrong_sigma8():
    target = uv.power_on_grid(uv.Cosmology(**FIDUCIAL), size=SIZE, box_size=BOX)
    wrong = uv.Cosmology(**{**FIDUCIAL, "sigma_8": 0.7})  # 23% less power.
    ratios, modes = _lognormal_ratios(wrong, target, realizations=16)
    agrees = _power_agrees(ratios, modes, LOGNORMAL_INFLATION)
    assert np.count_nonzero(~agrees) >= 3, ratios.mean(axis=0)


def test_higher_sigma8_gives_higher_variance_for_the_same_noise():
    noise = uv.white_noise_modes(sample_rng(2, 0, 1), 32)
    variances = []
    for sigma_8 in (0.7, 0.8, 0.9):
        cosmology = uv.Cosmology(**{**FIDUCIAL, "sigma_8": sigma_8})
        power = uv.power_on_grid(cosmology, size=32, box_size=128.0)
        delta = uv.lognormal_density(noise, power, size=32, box_size=128.0)
        assert delta.min() > -1.0
        variances.append(float(delta.var()))
    assert variances[0] < variances[1] < variances[2]


def test_counts_have_the_requested_mean_and_growth_ordering():
    config = uv.UniverseConfig(size=32)
    sample = uv.generate_universe(seed=1, index=0, config=config)
    means = sample.counts.mean(axis=(0, 1, 2))
    np.testing.assert_allclose(means, config.mean_count, rtol=0.1)
    spread = sample.counts.astype(np.float64).std(axis=(0, 1, 2))
    assert np.all(np.diff(spread) < 0)  # Structure grows: z = 0 is the clumpiest.
    assert sample.counts.min() >= 0 and sample.clipped_voxels == 0


# ---------------------------------------------------------------- labels, seeds


def test_labels_are_scaled_to_the_unit_interval():
    ranges = np.array(uv.PARAMETER_RANGES)
    np.testing.assert_allclose(uv.scale_parameters(ranges[:, 0]), -1.0)
    np.testing.assert_allclose(uv.scale_parameters(ranges[:, 1]), 1.0)
    for index in range(20):
        sample = uv.sample_parameters(sample_rng(3, index, 0))
        unit = uv.scale_parameters(sample)
        assert np.all(np.abs(unit) <= 1.0)
        np.testing.assert_allclose(uv.unscale_parameters(unit), sample)


def test_universes_are_reproducible_from_seed_and_index():
    config = uv.UniverseConfig(size=16)
    first = uv.generate_universe(3, 5, config)
    again = uv.generate_universe(3, 5, config)
    assert first.counts.tobytes() == again.counts.tobytes()
    assert first.params.tobytes() == again.params.tobytes()
    for other in (uv.generate_universe(3, 6, config), uv.generate_universe(4, 5, config)):
        assert not np.array_equal(other.counts, first.counts)
        assert not np.array_equal(other.params, first.params)
    np.testing.assert_allclose(first.unit_params, uv.scale_parameters(first.params), atol=1e-7)


def test_seed_and_config_validation():
    with pytest.raises(ValueError, match=r"Received: seed=-1\."):
        check_seed(-1)
    with pytest.raises(ValueError, match=r"Received: size=4\."):
        uv.UniverseConfig(size=4)
    assert uv.UniverseConfig(size=64).box_size == 256.0
    assert uv.UniverseConfig(size=128).shape == (128, 128, 128, 4)


# ---------------------------------------------------------------- universe files


def test_universe_file_format(tmp_path):
    config = uv.UniverseConfig(size=16)
    path = uv.write_universe(uv.UniverseJob(str(tmp_path), 9, 7, config))
    assert os.path.basename(path) == "univ_000007.h5"
    assert sorted(os.listdir(tmp_path)) == ["univ_000007.h5"]  # No temporary left.
    with h5py.File(path, "r") as h5:
        assert h5["full"].shape == (16, 16, 16, 4) and h5["full"].dtype == np.int16
        assert h5["unitPar"].shape == (4,) and h5["unitPar"].dtype == np.float32
        attrs = h5.attrs
        assert attrs["seed"] == 9 and attrs["index"] == 7 and attrs["box_size"] == 64.0
        assert attrs["params"].dtype == np.float64 and attrs["params"].shape == (4,)
        np.testing.assert_array_equal(attrs["redshifts"], [0.0, 0.5, 1.5, 3.0])
        expected = uv.generate_universe(9, 7, config)
        np.testing.assert_array_equal(h5["full"][...], expected.counts)
        np.testing.assert_array_equal(h5["unitPar"][...], expected.unit_params)
    status = dict(seed=9, index=7, config=config)
    assert uv.universe_file_status(path, **status) == ("complete", "")
    assert uv.universe_file_status(path, **{**status, "seed": 8})[0] == "mismatch"
    Path(path).write_bytes(b"not hdf5")
    assert uv.universe_file_status(path, **status)[0] == "incomplete"


def test_atomic_write_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "univ_000000.h5"
    with pytest.raises(RuntimeError):
        with atomic_h5_file(str(target)) as h5:
            h5.create_dataset("full", data=np.zeros(3))
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


def test_write_universes_in_parallel_matches_one_writer(tmp_path, universes_cli):
    common = ["--count", "4", "--size", "16", "--seed", "5"]
    serial, parallel, sharded = tmp_path / "serial", tmp_path / "parallel", tmp_path / "sharded"
    assert universes_cli.main(["--out", str(serial), "--workers", "1", "--quiet", *common]) == 0
    result = _run_script("write_universes", "--out", str(parallel), "--workers", "2", *common)
    assert result.returncode == 0, result.stderr
    assert "universes: 100%" in result.stderr and "4/4" in result.stderr
    for shard in ("0", "1"):  # As two horovodrun ranks would.
        argv = ["--out", str(sharded), "--shard-index", shard, "--num-shards", "2", "--quiet"]
        assert universes_cli.main(argv + common) == 0
    expected = _file_bytes(serial)
    assert sorted(expected) == [f"univ_{i:06d}.h5" for i in range(4)]
    assert _file_bytes(parallel) == expected and _file_bytes(sharded) == expected


def test_horovod_rank_writes_its_own_indices(tmp_path, universes_cli, monkeypatch):
    monkeypatch.setenv("HOROVOD_RANK", "1")
    monkeypatch.setenv("HOROVOD_SIZE", "3")
    argv = ["--out", str(tmp_path), "--count", "7", "--size", "8", "--quiet"]
    assert universes_cli.main(argv) == 0
    assert sorted(os.listdir(tmp_path)) == ["univ_000001.h5", "univ_000004.h5"]


def test_write_universes_resumes_and_protects_other_data_sets(tmp_path, universes_cli, capsys):
    argv = ["--out", str(tmp_path), "--count", "3", "--size", "8", "--seed", "1", "--workers", "1"]
    assert universes_cli.main(argv) == 0
    before = _file_bytes(tmp_path)
    stamps = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    (tmp_path / "univ_000001.h5").write_bytes(b"truncated")  # A damaged file.
    (tmp_path / ".univ_000002.h5.123-abc.tmp").write_bytes(b"left by a crash")
    capsys.readouterr()
    assert universes_cli.main(argv) == 0
    assert "1 to write, 2 complete skipped" in capsys.readouterr().err
    assert _file_bytes(tmp_path) == before  # Repaired; stale temporary removed.
    assert (tmp_path / "univ_000000.h5").stat().st_mtime_ns == stamps["univ_000000.h5"]
    other_seed = argv[:-4] + ["--seed", "2", "--workers", "1"]
    assert universes_cli.main(other_seed) == 1
    assert "belong to another data set" in capsys.readouterr().err
    assert _file_bytes(tmp_path) == before
    assert universes_cli.main(other_seed + ["--overwrite"]) == 0
    assert _file_bytes(tmp_path) != before


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--count", "2", "--size", "4"], "Received: --size '4'"),
        (["--count", "0"], "Received: --count '0'"),
        (["--count", "2", "--seed", "-3"], "Received: --seed '-3'"),
        (["--count", "2", "--workers", "0"], "Received: --workers '0'"),
        (["--count", "2", "--box-size", "0"], "Received: box_size=0.0."),
        (["--count", "2", "--shard-index", "2", "--num-shards", "2"], "Received: shard_index=2"),
    ],
)
def test_write_universes_argument_errors(tmp_path, universes_cli, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        universes_cli.main(["--out", str(tmp_path / "out"), *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


def test_output_path_errors(tmp_path, universes_cli, segmentation_cli, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    for cli in (universes_cli, segmentation_cli):
        with pytest.raises(SystemExit):
            cli.main(["--out", str(blocker), "--count", "1", "--size", "8"])
        assert f"is not a directory. Received: out='{blocker}'." in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write to read-only directories")
def test_unwritable_output_directory(tmp_path, universes_cli, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(SystemExit):
        universes_cli.main(["--out", str(locked), "--count", "1", "--size", "8"])
    assert "not writable" in capsys.readouterr().err


# ---------------------------------------------------------------- segmentation


def test_gaussian_blur_conserves_mass_and_constants():
    impulse = np.zeros((9, 11, 13), np.float32)
    impulse[4, 5, 6] = 1.0
    blurred = seg.gaussian_blur(impulse, 1.0)
    assert blurred.sum() == pytest.approx(1.0, abs=1e-5)
    assert blurred[4, 5, 5] == pytest.approx(blurred[4, 5, 7]) == pytest.approx(blurred[3, 5, 6])
    np.testing.assert_allclose(seg.gaussian_blur(np.full((8, 8, 8), 2.0), 1.5), 2.0, rtol=1e-6)
    np.testing.assert_array_equal(seg.gaussian_blur(impulse, 0.0), impulse)


def test_segmentation_samples_hold_both_classes_aligned_with_the_image():
    config = seg.SegmentationConfig(shape=(24, 32, 40))
    for index in range(4):
        image, labels = seg.generate_segmentation_sample(3, index, config)
        assert image.shape == (24, 32, 40, 1) and image.dtype == np.float32
        assert labels.shape == (24, 32, 40) and labels.dtype == np.uint8
        assert set(np.unique(labels)) == {0, 1, 2}
        means = [float(image[..., 0][labels == c].mean()) for c in range(3)]
        # Intensities (0, 1, 2), blurred at the edges: the means stay well apart.
        assert means[0] < 0.3 < means[1] - 0.3 and means[1] < means[2] - 0.4, means


def test_segmentation_samples_are_reproducible():
    config = seg.SegmentationConfig(shape=(16, 16, 16))
    image, labels = seg.generate_segmentation_sample(1, 2, config)
    image_again, labels_again = seg.generate_segmentation_sample(1, 2, config)
    assert image.tobytes() == image_again.tobytes() and labels.tobytes() == labels_again.tobytes()
    other_image, _ = seg.generate_segmentation_sample(1, 3, config)
    assert not np.array_equal(image, other_image)


def test_write_segmentation_files_and_parallel_writer(tmp_path, segmentation_cli):
    common = ["--count", "5", "--size", "8,12,16", "--per-file", "2", "--seed", "4"]
    serial, parallel = tmp_path / "serial", tmp_path / "parallel"
    assert segmentation_cli.main(["--out", str(serial), "--workers", "1", "--quiet", *common]) == 0
    files = sorted(os.listdir(serial))
    assert files == ["seg_0000.h5", "seg_0001.h5", "seg_0002.h5"]
    config = seg.SegmentationConfig(shape=(8, 12, 16))
    with h5py.File(serial / "seg_0002.h5", "r") as h5:
        assert h5["images"].shape == (1, 8, 12, 16, 1) and h5["images"].dtype == np.float32
        assert h5["labels"].shape == (1, 8, 12, 16) and h5["labels"].dtype == np.uint8
        assert h5.attrs["first_index"] == 4 and h5.attrs["seed"] == 4
        image, labels = seg.generate_segmentation_sample(4, 4, config)
        np.testing.assert_array_equal(h5["images"][0], image)
        np.testing.assert_array_equal(h5["labels"][0], labels)
    result = _run_script("write_segmentation", "--out", str(parallel), "--workers", "2", *common)
    assert result.returncode == 0, result.stderr
    assert _file_bytes(parallel) == _file_bytes(serial)


def test_write_segmentation_resumes_when_the_count_grows(tmp_path, segmentation_cli, capsys):
    argv = ["--out", str(tmp_path), "--size", "8", "--per-file", "2", "--workers", "1"]
    assert segmentation_cli.main(argv + ["--count", "3"]) == 0
    capsys.readouterr()
    assert segmentation_cli.main(argv + ["--count", "4"]) == 0
    assert "1 files to write, 1 complete skipped" in capsys.readouterr().err
    with h5py.File(tmp_path / "seg_0001.h5", "r") as h5:
        assert h5["labels"].shape[0] == 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--count", "2", "--size", "64,64"], "Received: --size '64,64'"),
        (["--count", "2", "--size", "4,64,64"], "Received: --size '4,64,64'"),
        (["--count", "2", "--per-file", "0"], "Received: --per-file '0'"),
        (["--count", "-1"], "Received: --count '-1'"),
        (["--count", "2", "--noise-std", "-1"], "Received: noise_std=-1.0."),
    ],
)
def test_write_segmentation_argument_errors(tmp_path, segmentation_cli, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        segmentation_cli.main(["--out", str(tmp_path / "out"), *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------- shared machinery


def test_sample_rng_depends_only_on_seed_index_and_stream():
    draw = lambda *key: sample_rng(*key).integers(0, 2**62, size=4).tolist()  # noqa: E731
    assert draw(1, 2, 0) == draw(1, 2, 0)
    assert len({tuple(draw(*key)) for key in [(1, 2, 0), (1, 3, 0), (2, 2, 0), (1, 2, 1)]}) == 4


def test_progress_bar_counts_the_finished_jobs():
    import io

    stream = io.StringIO()
    results = run_jobs(abs, [-1, -2, -3, -4], workers=1, progress=progress_bar(4, "files", stream=stream))
    assert results == [1, 2, 3, 4]
    final = stream.getvalue().replace("\r", "\n").strip().splitlines()[-1]
    assert final.startswith("files: 100%") and "4/4" in final, final
    quiet = io.StringIO()
    run_jobs(abs, [-1, -2], progress=progress_bar(2, "files", enabled=False, stream=quiet))
    assert quiet.getvalue() == ""
