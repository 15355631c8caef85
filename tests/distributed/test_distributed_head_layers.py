"""Flatten, global pooling and batch normalization on 2 and 4 ranks against plain Keras.

One Horovod launch per world size runs every check (see tests/distributed/head_workers.py
for which loss and which gradient sum or average each check compares). A value <= 0
means |spatial - keras| <= 1e-5 + 1e-5 |keras| everywhere.
"""

import pytest

from tests.comparison import failures
from tests.distributed.head_workers import BN_CASES, REPLICATED_CASES, run_head_suite
from tests.distributed.launcher import horovod_or_skip, run_on_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

EXTRA_CASES = ("bn-renorm", "bn-replicated-spatial-stats", "bn-masked-spatial-stats")  # on the 2-data-group mesh only
ALL_CASES = tuple(REPLICATED_CASES) + tuple(c for c in BN_CASES if c not in EXTRA_CASES)
# (spatial_shape, cases) per world size. (1, 1, 1) on 2 ranks: pure data parallelism,
# where only batch normalization communicates. The last 4-rank mesh has 2 data groups of
# 2 spatial ranks. The end-to-end model runs on the last mesh of each launch.
MESHES = {
    2: [((1, 1, 1), ("bn", "bn-spatial-stats")), ((2, 1, 1), ALL_CASES), ((1, 2, 1), ALL_CASES)],
    4: [((1, 2, 2), ALL_CASES), ((2, 1, 1), ALL_CASES + EXTRA_CASES)],
}
EAGER_MESH = {2: (2, 1, 1), 4: None}  # eager mode checked on 2 ranks only, for time


@pytest.fixture(scope="session")
def head_suites():
    horovod_or_skip()
    cache = {}

    def get(np_):
        if np_ not in cache:
            cache[np_] = run_on_ranks(
                run_head_suite, np_, MESHES[np_], eager_mesh=EAGER_MESH[np_], end_to_end=True
            )
        return cache[np_]

    return get


def _params(kind):
    for np_, meshes in MESHES.items():
        for shape, cases in meshes:
            for case in (c for c in cases if c in kind):
                modes = (True, False) if shape == EAGER_MESH[np_] else (True,)
                for graph in modes:
                    mode = "graph" if graph else "eager"
                    yield pytest.param(np_, shape, case, graph, id=f"{np_}r-{'x'.join(map(str, shape))}-{case}-{mode}")


def _failures(result):
    return failures(result)


@pytest.mark.parametrize("np_,shape,case,graph", list(_params(REPLICATED_CASES)))
def test_replicated_head_layer_matches_keras(head_suites, np_, shape, case, graph):
    for rank, r in enumerate(head_suites(np_)):
        r = r[(shape, case, graph)]
        assert r["symbolic_shape"], f"rank {rank}: the model's output shape is not the global one"
        assert not _failures(r), f"rank {rank}: {_failures(r)}"


@pytest.mark.parametrize("np_,shape,case,graph", list(_params(BN_CASES)))
def test_batch_normalization_matches_keras(head_suites, np_, shape, case, graph):
    per_rank = [r[(shape, case, graph)] for r in head_suites(np_)]
    for rank, r in enumerate(per_rank):
        assert not _failures(r), f"rank {rank}: {_failures(r)}"
        assert r["train_moving_changed"] and not r["infer_moving_changed"]
    for mode in ("train", "infer"):
        # Moving statistics are bitwise identical on every rank of the world.
        values = [r[f"{mode}_moving_values"] for r in per_rank]
        assert all(v == values[0] for v in values), f"{mode}: {values}"


@pytest.mark.parametrize("np_", [2, 4])
def test_end_to_end_head_gradients_match_the_serial_model(head_suites, np_):
    for rank, r in enumerate(head_suites(np_)):
        e2e = r["end_to_end"]
        assert e2e["twin_modules"] == ["keras"]
        assert len([k for k in e2e if k.startswith("grad_")]) == 5  # conv kernel, bn, dense
        assert len([k for k in e2e if k.startswith("state_")]) == 2
        assert not _failures(e2e), f"rank {rank}: {_failures(e2e)}"


@pytest.mark.parametrize("np_", [2, 4])
def test_recomputed_batch_norm_statistics_match_the_serial_model(head_suites, np_):
    per_rank = [r["recompute"] for r in head_suites(np_)]
    for rank, r in enumerate(per_rank):
        assert r["batches"] == [2, 2]
        assert r["momenta"] == [0.9, 0.8], "the layers' momentum must be restored"
        assert len([k for k in r if k.startswith("state_")]) == 4  # 2 x (mean, variance)
        assert not _failures(r), f"rank {rank}: {_failures(r)}"
    values = [r["moving_values"] for r in per_rank]
    assert all(v == values[0] for v in values), "moving statistics differ between ranks"
