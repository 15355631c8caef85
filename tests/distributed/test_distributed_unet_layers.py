"""U-Net layers and models on 2 and 4 ranks against plain Keras on the whole volume.

One Horovod launch per world size runs every check of that size; the tests below read
the numbers each rank returned. A value <= 0 means |spatial - keras| <= 1e-5 +
1e-5 |keras| everywhere.
"""

import pytest

from keras_spatial.conversion import keras_parent
from tests.comparison import failures
from tests.distributed.launcher import horovod_or_skip, run_on_ranks
from tests.distributed.unet_workers import EAGER_CASES, GLOBAL_EXTENTS, LAYER_CASES, run_suite

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

CASES = {case.name: case for case in LAYER_CASES}
ALL = list(CASES)
DATA_PARALLEL = ["transpose-k2s2-same-relu-nobias", "transpose-k3s1-same", "upsample-213"]
# (spatial_shape, graph-mode layer cases, eager-mode layer cases, model checks) per world
# size; (2, 1, 1) on 4 ranks is 2 data groups x 2 spatial ranks.
MESHES = {
    2: [
        ((2, 1, 1), ALL, EAGER_CASES, {"skip", "loss", "branches", "eager_branches"}),
        ((1, 1, 2), ALL, [], {"skip", "branches"}),
    ],
    4: [
        ((2, 2, 1), ALL, [], {"skip", "loss", "branches"}),
        ((2, 1, 1), DATA_PARALLEL, [], {"loss", "branches"}),
    ],
}


@pytest.fixture(scope="session")
def unet_suites():
    horovod_or_skip()
    cache = {}

    def get(np_):
        if np_ not in cache:
            cache[np_] = run_on_ranks(run_suite, np_, MESHES[np_])
        return cache[np_]

    return get


def _params(kind):
    for np_, meshes in MESHES.items():
        for shape, names, eager_names, checks in meshes:
            mesh_id = f"{np_}r-{'x'.join(map(str, shape))}"
            if kind == "layer":
                for name in names:
                    yield pytest.param(np_, shape, name, True, id=f"{mesh_id}-{name}")
                for name in eager_names:
                    yield pytest.param(np_, shape, name, False, id=f"{mesh_id}-eager-{name}")
            elif kind in checks:
                yield pytest.param(np_, shape, id=mesh_id)


def _assert_within_tolerance(per_rank, key):
    for rank, result in enumerate(per_rank):
        r = result[key]
        numbers = {
            k: v for k, v in r.items() if k in ("output", "input_grad", "loss") or k.startswith("grad_")
        }
        assert "input_grad" in numbers
        assert sum(k.startswith("grad_") for k in numbers) == r["weights_compared"]
        bad = failures(numbers)
        assert not bad, f"rank {rank}: {bad}"


@pytest.mark.parametrize("np_,shape,name,graph", list(_params("layer")))
def test_layer_matches_keras(unet_suites, np_, shape, name, graph):
    """Output shard, input-gradient shard and world-summed weight gradients of each
    SpatialConv3DTranspose / SpatialUpSampling3D configuration equal Keras's."""
    per_rank = unet_suites(np_)
    _assert_within_tolerance(per_rank, (shape, name, graph))
    case = CASES[name]
    parent = keras_parent(case.layer_class)(**case.options)
    global_output = parent.compute_output_shape((1, *GLOBAL_EXTENTS, case.channels))[1:4]
    expected = tuple(e // n for e, n in zip(global_output, shape))
    assert per_rank[0][(shape, name, graph)]["local_output_shape"][1:4] == expected


@pytest.mark.parametrize("np_,shape", list(_params("skip")))
def test_skip_connection_with_keras_concatenate(unet_suites, np_, shape):
    """keras.layers.Concatenate of aligned shards (transposed conv 2/2, up-sampling and
    the pre-pool conv output), then a stride-1 transposed conv and a conv: forward and
    gradients equal the plain Keras twin (`to_keras_model`) on the whole volume."""
    _assert_within_tolerance(unet_suites(np_), (shape, "skip", True))


@pytest.mark.parametrize("np_,shape", list(_params("loss")))
def test_per_voxel_loss_gradients_average_to_the_global_mean_loss_gradient(unet_suites, np_, shape):
    """SparseCategoricalCrossentropy on a sharded softmax output, mean over each rank's
    own voxels (the Keras default reduction).

    Why AVERAGING the ranks' weight gradients is right: every rank holds the same number
    n of voxels (equal shards of equal batches), so the global mean over all N = n * size
    voxels is (1/N) sum_r (n * mean_r) = (1/size) sum_r mean_r, the mean of the per-rank
    means; its gradient is therefore the mean of the per-rank gradients (what Horovod's
    DistributedOptimizer computes). Summing instead would scale it by the world size.
    Each rank's local loss also depends on its neighbours' inputs through the halos; the
    halo exchange's backward pass carries those terms, so the average is exact. Checked:
    averaged loss, averaged weight gradients and the input gradient shard against the
    plain Keras twin's global mean loss on the whole volume and global batch.
    """
    per_rank = unet_suites(np_)
    _assert_within_tolerance(per_rank, (shape, "loss", True))
    assert per_rank[0][(shape, "loss", True)]["loss_value"] > 0.5  # a real loss, not ~0


@pytest.mark.parametrize("np_,shape", list(_params("branches")))
def test_parallel_exchanging_branches_in_a_tf_function(unet_suites, np_, shape):
    """Three branches whose halo exchanges do not depend on each other (conv -> average
    pool, conv -> max pool, conv -> max pool), added: forward and gradients equal the
    plain Keras twin. Automatic differentiation reaches the branches' gradient exchanges
    in an order that depends on each rank's shard; in a graph they are paired by the
    forward op's name, and are never merged by graph optimization (on a 2x1x1 mesh the
    last rank gets equal, empty gradients back from two branches)."""
    _assert_within_tolerance(unet_suites(np_), (shape, "branches", True))


def test_parallel_exchanging_branches_run_eagerly_raise(unet_suites):
    """Run eagerly on 2x1x1, the two ranks differentiate the branches' exchanges in
    different orders: the step raises SpatialNotSupportedError on every rank (naming
    the cure, a tf.function) instead of returning wrong weight gradients."""
    for rank, result in enumerate(unet_suites(2)):
        message = result[((2, 1, 1), "branches", False)].get("error", "")
        assert "reached the gradients of different collectives" in message, f"rank {rank}: {result}"
        assert "tf.function" in message
