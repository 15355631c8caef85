"""model.fit on 2 and 4 ranks ends where one process training on the global batches ends.

One Horovod launch per world size runs every scenario; tests read what ranks returned.
"""

import os

import numpy as np
import pytest

from tests.distributed.launcher import horovod_or_skip, run_on_ranks
from tests.distributed.training_workers import run_training_suite

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

SUITES = {
    2: [
        ((2, 1, 1), ["fit-voxel-adam", "fit-voxel-sgd-schedule", "fit-cosmoflow-adam", "fit-unet-adam",
                     "fit-cosmoflow-adam-buckets", "fit-cosmoflow-adam-sharded", "fit-unet-sgd-schedule-sharded",
                     "fit-mlperf-sgd-schedule", "fit-cosmoflow-adam-odd", "fit-unet-adam-odd",
                     "checkpoint", "early-stopping", "dropout-head"]),
        ((1, 1, 2), ["fit-voxel-adamw", "fit-mlperf-sgd-schedule"]),
    ],
    4: [
        ((2, 1, 1), ["fit-cosmoflow-adam", "fit-unet-adam", "fit-cosmoflow-fused-adam-sharded",
                     "early-stopping", "dropout-head"]),  # 2 data groups x 2
        ((1, 2, 2), ["fit-cosmoflow-fused-adam", "fit-unet-sgd-schedule", "fit-mlperf-sgd-schedule",
                     "fit-unet-adam-buckets", "fit-unet-adam-buckets-sharded", "fit-cosmoflow-adam-sharded",
                     "fit-cosmoflow-adam-odd", "fit-unet-sgd-schedule-odd", "checkpoint"]),
    ],
}


@pytest.fixture(scope="session")
def training(tmp_path_factory):
    horovod_or_skip()
    cache = {}

    def get(np_):
        if np_ not in cache:
            directory = str(tmp_path_factory.mktemp(f"training{np_}"))
            cache[np_] = (run_on_ranks(run_training_suite, np_, SUITES[np_], directory=directory), directory)
        return cache[np_]

    return get


FIT_CASES = [
    pytest.param(np_, shape, run, id=f"{np_}r-{'x'.join(map(str, shape))}-{run}")
    for np_, suites in SUITES.items() for shape, runs in suites for run in runs if run.startswith("fit-")
]


@pytest.mark.parametrize("np_,shape,run", FIT_CASES)
def test_training_matches_one_process(training, np_, shape, run):
    per_rank, _ = training(np_)
    results = [r[(shape, run)] for r in per_rank]
    rank0 = results[0]
    assert rank0["moved"] > 1e-3, "training did not change the weights"
    assert rank0["weight_excess"] <= 0, "weights differ from the serial run beyond rtol=atol=1e-4"
    # The dense head's kernels and biases (after SpatialFlatten) are averaged over data
    # groups only; the rest over the world.
    # The "mlperf" head has three dense layers.
    expected_replicated = 4 if "cosmoflow" in run else 6 if "mlperf" in run else 0
    for r in results:
        assert r["replicated"] == expected_replicated
        assert r["bucket_bytes"] == (4096 if "-buckets" in run else None)
        assert r["shard_update"] == run.endswith("-sharded")
        if r["shard_update"]:  # each rank of the spatial group owns a real share
            assert 0 < r["owned"] < r["variables"]
        assert r["spread"] == 0.0, "weights differ between ranks"
        # Reported loss, metrics, validation and evaluate are global, on every rank.
        for key, value in rank0["serial_logs"].items():
            assert r["logs"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
        for key, value in rank0["serial_evaluate"].items():
            assert r["evaluate"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("np_,shape", [(2, (2, 1, 1)), (4, (1, 2, 2))])
def test_resume_from_checkpoint_continues_the_run(training, np_, shape):
    per_rank, _ = training(np_)
    for r in per_rank:
        result = r[(shape, "checkpoint")]
        assert result["resume_difference"] <= 1e-6
        assert result["optimizer"] == "DistributedOptimizer"
        assert result["iterations"] == 2 * 3
        assert {"epoch1.keras", "epoch2.keras"} <= set(result["files"])


@pytest.mark.parametrize("np_,shape", [(2, (2, 1, 1)), (4, (1, 2, 2))])
def test_checkpoint_loads_in_one_process_as_whole_volume_model(training, np_, shape):
    import keras

    import keras_spatial  # noqa: F401  (registers the classes)

    _, directory = training(np_)
    path = os.path.join(directory, "x".join(map(str, shape)))
    model = keras.saving.load_model(os.path.join(path, "epoch2.keras"))
    data = np.load(os.path.join(path, "final.npz"))
    assert model.input_shape == (None, 8, 8, 8, 2)
    np.testing.assert_allclose(model.predict(data["x"], verbose=0), data["y"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("np_,shape", [(2, (2, 1, 1)), (4, (2, 1, 1))])
def test_dropout_in_the_replicated_head_keeps_ranks_identical(training, np_, shape):
    per_rank, _ = training(np_)
    for r in per_rank:
        result = r[(shape, "dropout-head")]
        assert result["replicated"] == 4  # two Dense layers: kernel and bias each
        assert result["spread"] == 0.0, "head weights drifted apart across ranks"


@pytest.mark.parametrize("np_,shape", [(2, (2, 1, 1)), (4, (2, 1, 1))])
def test_early_stopping_stops_all_ranks_together(training, np_, shape):
    per_rank, _ = training(np_)
    results = [r[(shape, "early-stopping")] for r in per_rank]
    assert results[0]["epochs"] == 2  # patience 1 with an unreachable min_delta
    for r in results:
        assert r == results[0]
