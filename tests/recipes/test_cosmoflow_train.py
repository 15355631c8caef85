"""recipes.cosmoflow.train: universes written by the CLI -> 2-rank spatial training ->
a saved model that loads and predicts in one process; and clear bad-argument errors."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.distributed.launcher import REPO_ROOT, horovod_or_skip, subprocess_env

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


def _write_universes(out, count, size):
    subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "tools", "write_universes.py"), "--out", str(out),
         "--count", str(count), "--size", str(size), "--seed", "3", "--workers", "1", "--quiet"],
        check=True, env=subprocess_env(),
    )


def test_train_on_two_ranks_then_load_in_one_process(tmp_path):
    horovod_or_skip()
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    if not os.path.exists(horovodrun):
        pytest.skip("horovodrun not next to the test interpreter")
    data, out = tmp_path / "universes", tmp_path / "run"
    _write_universes(data, 6, 32)
    result = subprocess.run(
        [horovodrun, "--gloo", "-np", "2", "-H", "localhost:2", sys.executable, "-m",
         "recipes.cosmoflow.train", "--data", str(data), "--spatial", "2,1,1", "--batch-size", "2",
         "--epochs", "1", "--size", "32", "--variant", "paper", "--out", str(out),
         "--validation-fraction", "0.34", "--batch-norm", "--recompute-bn-statistics"],
        cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "final validation MSE" in result.stdout
    assert "RecomputeBatchNormStatistics: epoch 1, moving statistics from 2 batches" in result.stdout
    for name in ("model.keras", "history.json", "loss.png"):
        assert (out / name).is_file(), name
    record = json.loads((out / "history.json").read_text())
    assert record["config"]["train_files"] == [f"univ_{i:06d}.h5" for i in range(4)]
    assert record["config"]["validation_files"] == ["univ_000004.h5", "univ_000005.h5"]
    s = record["summary"]
    for key in ("final_val_mse", "final_val_mae", "baseline_val_mse"):
        assert np.isfinite(s[key]), key
    assert len(record["history"]["val_loss"]) == 1

    # The checkpoint is a whole-volume model in ONE process (no Horovod).
    check = (
        "import sys, h5py, numpy as np\n"
        "import keras_spatial\n"
        "import keras\n"
        "model = keras.saving.load_model(sys.argv[1])\n"
        "with h5py.File(sys.argv[2]) as f:\n"
        "    x = np.log1p(f['full'][...].astype('float32'))[None]\n"
        "y = np.asarray(model.predict(x, verbose=0))\n"
        "assert y.shape == (1, 4), y.shape\n"
        "assert np.all(np.isfinite(y)), y\n"
        "print('OK', model.input_shape)\n"
    )
    env = {k: v for k, v in subprocess_env().items() if not k.startswith("HOROVOD_")}
    loaded = subprocess.run(
        [sys.executable, "-c", check, str(out / "model.keras"), str(data / "univ_000005.h5")],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert loaded.returncode == 0, loaded.stdout[-2000:] + loaded.stderr[-3000:]
    assert "OK (None, 32, 32, 32, 4)" in loaded.stdout


def test_bad_arguments_fail_clearly(tmp_path):
    def train(*argv):
        return subprocess.run(
            [sys.executable, "-m", "recipes.cosmoflow.train", *argv],
            cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120,
        )

    empty = tmp_path / "empty"
    empty.mkdir()
    result = train("--data", str(empty), "--batch-size", "2", "--epochs", "1")
    assert result.returncode != 0 and "no files univ_*.h5" in result.stderr, result.stderr

    result = train("--data", str(empty), "--spatial", "2,1", "--batch-size", "2", "--epochs", "1")
    assert result.returncode != 0 and "three positive integers" in result.stderr, result.stderr

    result = train("--data", str(empty), "--batch-size", "0", "--epochs", "1")
    assert result.returncode != 0 and "--batch-size" in result.stderr, result.stderr

    # One process is one rank: a 2-way split cannot be served.
    data = tmp_path / "universes"
    _write_universes(data, 4, 32)
    result = train("--data", str(data), "--spatial", "2,1,1", "--batch-size", "1", "--epochs", "1")
    assert result.returncode != 0 and "--spatial 2,1,1" in result.stderr, result.stderr
    result = train("--data", str(data), "--crop", "48", "--batch-size", "1", "--epochs", "1")
    assert result.returncode != 0 and "--crop 48 is larger than the universes" in result.stderr, result.stderr
    result = train("--data", str(data), "--whiten", "--no-standardize", "--batch-size", "1", "--epochs", "1")
    assert result.returncode != 0 and "--whiten replaces the standardization" in result.stderr, result.stderr
    result = train("--data", str(data), "--recompute-bn-statistics", "--batch-size", "1", "--epochs", "1")
    assert result.returncode != 0 and "needs batch normalization" in result.stderr, result.stderr


def test_input_statistics_are_per_channel_moments(tmp_path):
    import keras_spatial as ks
    from recipes.cosmoflow.train import input_statistics

    data = tmp_path / "universes"
    _write_universes(data, 3, 32)
    paths = sorted(str(p) for p in data.glob("univ_*.h5"))
    crop = (slice(0, 16),) * 3
    dataset = ks.data.HDF5Dataset(paths, x="full", y="unitPar", preprocess=np.log1p, crop=crop)
    mean, std = input_statistics(dataset, count=2)
    import h5py

    x = []
    for path in paths[:2]:
        with h5py.File(path) as f:
            x.append(np.log1p(f["full"][:16, :16, :16].astype(np.float64)))
    x = np.stack(x).reshape(-1, 4)
    np.testing.assert_allclose(mean, x.mean(axis=0), rtol=1e-6)
    np.testing.assert_allclose(std, x.std(axis=0), rtol=1e-5)
