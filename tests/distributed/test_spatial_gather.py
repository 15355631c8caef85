"""SpatialGather: a spatial trunk, then plain Keras layers on the gathered volume."""

import numpy as np
import pytest

keras = pytest.importorskip("keras")

import keras_spatial as ks  # noqa: E402
from keras_spatial.plan import plan_for_mesh  # noqa: E402
from tests.distributed.gather_workers import compare_with_twin, gathered_model  # noqa: E402
from tests.distributed.launcher import run_on_ranks  # noqa: E402


def test_without_strategy_it_is_identity_and_round_trips():
    layer = ks.layers.SpatialGather(name="g")
    x = np.random.default_rng(0).standard_normal((1, 4, 4, 4, 2)).astype("float32")
    np.testing.assert_array_equal(layer(x), x)
    assert type(layer).from_config(layer.get_config()).get_config() == layer.get_config()
    plain = ks.to_keras_model(gathered_model((8, 8, 8, 2)))
    assert not any(type(l).__module__.startswith("keras_spatial") for l in plain.layers)


def test_plan_treats_gather_as_replicated_and_refuses_spatial_layers_after_it():
    rows = plan_for_mesh(lambda: gathered_model((8, 8, 8, 2)), (2, 1, 1))
    splits = {row["name"]: row["split"] for row in rows}
    assert list(splits.values()).count("sharded") == 3 and splits[rows[-1]["name"]] == "replicated"

    def spatial_after_gather():
        x = ks.Input((8, 8, 8, 2))
        y = ks.layers.SpatialGather()(ks.layers.SpatialConv3D(2, 3, padding="same")(x))
        return keras.Model(x, ks.layers.SpatialConv3D(2, 3, padding="same", name="late")(y))

    with pytest.raises(ValueError, match="'late'.*follows a gather"):
        plan_for_mesh(spatial_after_gather, (2, 1, 1))


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("np_,meshes", [(2, [(2, 1, 1), (1, 1, 2)]), (4, [(1, 2, 2), (2, 1, 1)])])
def test_gathered_tail_matches_the_plain_model(np_, meshes):
    per_rank = run_on_ranks(compare_with_twin, np_, meshes)
    for results in per_rank:
        for mesh in meshes:
            r = results[mesh]
            assert r["output_shape"] == (None, 3)
            assert r["output"] <= 1e-5, (mesh, r)
            assert r["grads"] <= 0, (mesh, r)  # rtol = atol = 1e-5
            # DistributedOptimizer's averaging with the layers after the gather declared
            # replicated (conv and dense: 2 kernels, 2 biases) gives the same gradients.
            assert r["replicated"] == 4
            assert r["partitioned_grads"] <= 0, (mesh, r)
