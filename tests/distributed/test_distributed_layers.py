"""Spatial layers on 2, 4 and 8 ranks against plain Keras on the whole volume.

One Horovod launch per world size runs every mesh of that size one after another (so
creating several strategies in one process is exercised too); the tests below read the
numbers each rank returned. A value <= 0 means |spatial - keras| <= 1e-5 + 1e-5 |keras|
everywhere (outputs, input gradients, world-summed weight gradients).
"""

import os

import numpy as np
import pytest

from tests.comparison import failures
from tests.distributed.launcher import horovod_or_skip, run_on_ranks
from tests.distributed.layer_cases import conv_grid, pool_grid, prime_cases, random_cases
from tests.distributed.layer_workers import run_suite

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

GRID = conv_grid() + pool_grid()
EAGER = [c for c in GRID if c.name in ("conv-k3-s1-d1-same", "conv-k2-s2-d1-valid", "max-p3-s2-same", "avg-p3-s1-same")]
MESHES = {
    2: [(2, 1, 1), (1, 2, 1), (1, 1, 2)],
    4: [(4, 1, 1), (2, 2, 1), (1, 2, 2), (2, 1, 1)],  # the last: 2 data groups x 2 spatial
    8: [(2, 2, 2)],
}
SMOKE_8 = [c for c in GRID if c.name in ("conv-k3-s1-d1-same", "conv-k4-s2-d1-valid", "max-p2-s2-same", "avg-p3-s2-same")]


def cases_for(np_, shape):
    if np_ == 8:
        return SMOKE_8
    if np_ == 4 and shape == (2, 1, 1):
        # 2 data groups of the 2-way depth split that 2 ranks test with the whole grid:
        # a quarter of the grid checks that the data groups keep their samples apart.
        return GRID[::4] + random_cases(seed=211, count=2)
    cases = GRID + random_cases(seed=100 * shape[0] + 10 * shape[1] + shape[2], count=6)
    if shape in ((1, 2, 1), (2, 2, 1), (1, 2, 2)):
        cases += prime_cases()  # uneven on every split axis
    return cases


@pytest.fixture(scope="session")
def suites(tmp_path_factory):
    horovod_or_skip()
    cache = {}

    def get(np_):
        if np_ not in cache:
            save_dir = str(tmp_path_factory.mktemp(f"saved{np_}"))
            meshes = [(shape, cases_for(np_, shape), True) for shape in MESHES[np_]]
            meshes.append((MESHES[np_][0], EAGER, False))
            bad = (3, 1, 1) if np_ == 4 else None
            cache[np_] = (run_on_ranks(run_suite, np_, meshes, save_dir=save_dir, bad_spatial_shape=bad), save_dir)
        return cache[np_]

    return get


def _params():
    for np_, shapes in MESHES.items():
        for shape in shapes:
            for case in cases_for(np_, shape):
                yield pytest.param(np_, shape, case, True, id=f"{np_}r-{'x'.join(map(str, shape))}-{case.name}")
        for case in EAGER:
            yield pytest.param(np_, shapes[0], case, False, id=f"{np_}r-{'x'.join(map(str, shapes[0]))}-eager-{case.name}")


@pytest.mark.parametrize("np_,shape,case,graph", list(_params()))
def test_layer_matches_keras(suites, np_, shape, case, graph):
    per_rank, _ = suites(np_)
    results = [r[(shape, case.name, graph)] for r in per_rank]
    if "raises" in results[0]:
        # An unservable layout (e.g. even kernel, stride 1, 'valid' on a split axis):
        # every rank must refuse it at build time with the clear error.
        for r in results:
            assert r["raises"] is not None, "layer accepted a layout it cannot serve"
            assert "cannot split its input or output over its shards" in r["raises"]
            assert f"spatial_shape={shape}" in r["raises"]
        return
    for rank, r in enumerate(results):
        bad = failures({k: v for k, v in r.items() if k not in ("extents", "max_abs_output")})
        assert not bad, f"rank {rank}, extents {r['extents']}: {bad}"


@pytest.mark.parametrize("np_", [2, 4, 8])
def test_mesh_coordinates(suites, np_):
    per_rank, _ = suites(np_)
    for shape in MESHES[np_]:
        from keras_spatial.mesh import Mesh

        mesh = Mesh(np_, shape)
        for rank, r in enumerate(per_rank):
            info = r[("mesh", shape)]
            assert info == {"rank": rank, "coords": mesh.coords(rank), "data_index": mesh.data_index(rank)}


@pytest.mark.parametrize("np_", [2, 4, 8])
def test_horovod_threads_run_only_on_idle_cores(suites, np_):
    # keras_spatial.comm puts the threads hvd.init starts (its background thread and Gloo's)
    # into SCHED_IDLE, and no other thread: TensorFlow's and the main thread keep theirs.
    per_rank, _ = suites(np_)
    for rank, r in enumerate(per_rank):
        classes = r["thread_classes"]
        assert classes["idle"] >= 2, f"rank {rank}: {classes}"
        assert classes["main"] == "other", f"rank {rank}: {classes}"
        assert classes["tensorflow_threads"] >= 1 and not classes["tensorflow_idle"], f"rank {rank}: {classes}"


@pytest.mark.parametrize("np_", [2, 4, 8])
@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="thread binding is Linux's")
def test_ranks_on_one_machine_are_bound_to_their_share_of_its_cpus(suites, np_):
    # Every rank inherits this process's CPU set from horovodrun (no binding of its own),
    # so keras_spatial.comm binds local rank r, with all its threads, to its block of it.
    from keras_spatial.comm.runtime import bind_policy, local_cpu_share

    if bind_policy() == "none":
        pytest.skip("KERAS_SPATIAL_BIND=none in this environment")
    per_rank, _ = suites(np_)
    allowed = os.sched_getaffinity(0)
    for rank, r in enumerate(per_rank):
        assert r["affinities"] == [sorted(local_cpu_share(allowed, rank, np_))], f"rank {rank}"


def test_world_not_divisible_by_spatial_size_raises(suites):
    per_rank, _ = suites(4)
    for r in per_rank:
        assert r["bad_mesh"] is not None
        assert "multiple of the spatial size 3" in r["bad_mesh"] and "world_size=4" in r["bad_mesh"]


@pytest.mark.parametrize("np_", [2, 4])
def test_saved_spatial_model_loads_in_one_process_as_whole_volume_model(suites, np_):
    import keras

    import keras_spatial  # noqa: F401  (registers the layers)

    per_rank, save_dir = suites(np_)
    for shape in MESHES[np_]:
        prefix = os.path.join(save_dir, f"stack_{'x'.join(map(str, shape))}")
        model = keras.saving.load_model(f"{prefix}.keras")
        data = np.load(f"{prefix}.npz")
        assert model.input_shape == (None, 16, 16, 16, 2)
        predicted = model.predict(data["x"], verbose=0)
        np.testing.assert_allclose(predicted, data["y"], rtol=1e-5, atol=1e-5)
        assert per_rank[0][("stack", shape)]["global_output_shape"] == predicted.shape
