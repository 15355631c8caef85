"""Keras's own unit-test parameterizations of its 3D layers, spatially, on 2 and 4 ranks.

The cases are read from the installed Keras's test files (`tests.keras_parameterizations`:
Conv3D, Conv3DTranspose, Max/AveragePooling3D, global pooling, UpSampling3D,
BatchNormalization; channels_last). Each runs as a plain Keras model made spatial by
`keras_spatial.spatialize`, on the smallest odd-based extents each mesh can split
(uneven shards on most split axes): forward, input gradient and world-summed weight
gradients equal plain Keras on the whole volume within rtol = atol = 1e-5 (NaN or inf
never pass). One Horovod launch per world size runs every mesh of that size.
"""

import pytest

from tests.comparison import failures
from tests.distributed.keras_case_workers import run_keras_cases
from tests.distributed.launcher import horovod_or_skip, run_on_ranks
from tests.keras_parameterizations import SOURCES, read_cases, signatures

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

MESHES = {2: [(2, 1, 1), (1, 1, 2)], 4: [(1, 2, 2)]}


def _cases():
    import keras

    return read_cases(signatures(keras))


CASES = _cases()


def test_every_layer_has_cases_from_keras():
    layers = {case.layer for case in CASES}
    assert layers == {layer for layer, _, _ in SOURCES}
    assert len(CASES) >= 20


@pytest.fixture(scope="session")
def keras_case_results():
    horovod_or_skip()
    cache = {}

    def get(np_):
        if np_ not in cache:
            cache[np_] = run_on_ranks(run_keras_cases, np_, [(shape, CASES) for shape in MESHES[np_]])
        return cache[np_]

    return get


def _params():
    for np_, shapes in MESHES.items():
        for shape in shapes:
            for case in CASES:
                yield pytest.param(np_, shape, case, id=f"{np_}r-{'x'.join(map(str, shape))}-{case.name}")


@pytest.mark.parametrize("np_,shape,case", list(_params()))
def test_keras_case_matches_keras(keras_case_results, np_, shape, case):
    per_rank = keras_case_results(np_)
    for rank, results in enumerate(per_rank):
        result = results[(shape, case.name)]
        assert "error" not in result, f"rank {rank}: {result.get('error')} ({case.source})"
        bad = failures({k: v for k, v in result.items() if k != "extents"})
        assert not bad, f"rank {rank}, extents {result['extents']}: {bad} ({case.source})"
