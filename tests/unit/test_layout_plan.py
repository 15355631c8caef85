"""keras_spatial.plan: layout plans computed without Horovod, hand-checked on a tiny model.

The tiny model (global 8x4x4x2 input) split (2, 1, 1):
  conv1  kernel 3 'same' stride 1: shard 0 needs depth [-1, 5), owns [0, 4): receives
         0 before (1 plane of zero padding), 1 after; shard 1 needs [3, 9), owns [4, 8):
         receives 1 before, 0 after (1 padding). Unsplit axes: padding 1/1 only.
  pool   window 3 stride 2 'same' on 8 -> 4 (leading padding 0): shard 0 outputs [0, 2)
         need [0, 5): receives 0/1; shard 1 outputs [2, 4) need [4, 9): 0/0, 1 padding.
  conv2  kernel 1 stride 2 'valid' on 4 -> 2: shard 0 output [0, 1) needs [0, 1) of its
         [0, 2): crops 1 after; shard 1 needs [2, 3) of [2, 4): crops 1 after.
"""

import os
import subprocess
import sys

import pytest

keras = pytest.importorskip("keras")

import keras_spatial as ks  # noqa: E402
from keras_spatial.mesh import Mesh  # noqa: E402
from keras_spatial.plan import format_plan, plan_for_mesh, summary  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = os.path.join(REPO_ROOT, "tools", "plan_layout.py")


def tiny_model():
    x = ks.Input((8, 4, 4, 2), name="x")
    y = ks.layers.SpatialConv3D(3, 3, padding="same", name="conv1")(x)
    y = keras.layers.ReLU(name="relu")(y)
    y = ks.layers.SpatialAveragePooling3D(3, strides=2, padding="same", name="pool")(y)
    y = ks.layers.SpatialConv3D(2, 1, strides=2, name="conv2")(y)
    y = ks.layers.SpatialFlatten(name="flatten")(y)
    y = keras.layers.Dense(1, name="dense")(y)
    return keras.Model(x, y)


def offline_strategy(spatial_shape, rank):
    """A SpatialStrategy of any mesh in one process, for symbolic building only (no
    process sets: calling the model would fail, shapes and plans work)."""
    strategy = ks.SpatialStrategy.__new__(ks.SpatialStrategy)
    strategy._rank = rank
    sd, sh, sw = spatial_shape
    strategy.mesh = Mesh(world_size=sd * sh * sw, spatial_shape=spatial_shape)
    return strategy


EXPECTED = {
    0: {
        "x": ((4, 4, 4, 2), None, None),
        "conv1": ((4, 4, 4, 3), ((0, 1), (0, 0), (0, 0)), ((1, 0), (1, 1), (1, 1))),
        "relu": ((4, 4, 4, 3), None, None),
        "pool": ((2, 2, 2, 3), ((0, 1), (0, 0), (0, 0)), ((0, 0), (0, 1), (0, 1))),
        "conv2": ((1, 1, 1, 2), ((0, -1), (0, -1), (0, -1)), ((0, 0), (0, 0), (0, 0))),
        "flatten": ((4,), None, None),
        "dense": ((1,), None, None),
    },
    1: {
        "x": ((4, 4, 4, 2), None, None),
        "conv1": ((4, 4, 4, 3), ((1, 0), (0, 0), (0, 0)), ((0, 1), (1, 1), (1, 1))),
        "relu": ((4, 4, 4, 3), None, None),
        "pool": ((2, 2, 2, 3), ((0, 0), (0, 0), (0, 0)), ((0, 1), (0, 1), (0, 1))),
        "conv2": ((1, 1, 1, 2), ((0, -1), (0, -1), (0, -1)), ((0, 0), (0, 0), (0, 0))),
        "flatten": ((4,), None, None),
        "dense": ((1,), None, None),
    },
}
GLOBAL = {"x": (8, 4, 4, 2), "conv1": (8, 4, 4, 3), "relu": (8, 4, 4, 3), "pool": (4, 2, 2, 3),
          "conv2": (2, 1, 1, 2), "flatten": (4,), "dense": (1,)}


@pytest.mark.parametrize("rank", [0, 1])
def test_tiny_model_plan_by_hand(rank):
    rows = plan_for_mesh(tiny_model, (2, 1, 1), rank=rank)
    assert [row["name"] for row in rows] == list(GLOBAL)
    for row in rows:
        local, halo, padding = EXPECTED[rank][row["name"]]
        assert row["global_shape"] == GLOBAL[row["name"]]
        assert (row["local_shape"], row["halo"], row["padding"]) == (local, halo, padding), row["name"]
        assert row["split"] == ("replicated" if row["name"] in ("flatten", "dense") else "sharded")
    assert rows[0]["bytes"] == 4 * 4 * 4 * 2 * 4
    assert rows[0]["type"] == "SpatialInputLayer" and rows[1]["type"] == "SpatialConv3D"


def test_no_split_and_batch_size():
    rows = plan_for_mesh(tiny_model(), (1, 1, 1), batch_size=3)
    conv1 = rows[1]
    assert conv1["local_shape"] == conv1["global_shape"] == (8, 4, 4, 3)
    assert conv1["halo"] == ((0, 0), (0, 0), (0, 0)) and conv1["padding"] == ((1, 1),) * 3
    assert conv1["bytes"] == 8 * 4 * 4 * 3 * 4 * 3


def test_two_axis_split_rank_coordinates():
    def conv_only():
        x = ks.Input((8, 4, 4, 2))
        return keras.Model(x, ks.layers.SpatialConv3D(3, 3, padding="same", name="conv1")(x))

    rows = plan_for_mesh(conv_only, (2, 2, 1), rank=7, world_size=8)  # data group 1, coords (1, 1, 0)
    assert rows[1]["local_shape"] == (4, 2, 4, 3)
    assert rows[1]["halo"] == ((1, 0), (1, 0), (0, 0))
    with pytest.raises(ValueError, match="Layer 'conv2' cannot split its input or output over its shards along the height axis"):
        plan_for_mesh(tiny_model, (2, 2, 1))  # conv2: height 2 -> 1


@pytest.mark.parametrize("rank", [0, 1])
def test_summary_of_a_model_built_under_the_strategy_matches_plan_for_mesh(rank):
    strategy = offline_strategy((2, 1, 1), rank)
    with strategy.scope():
        local_model = tiny_model()
    assert local_model.input.shape == (None, 4, 4, 4, 2)
    printed = []
    rows = summary(local_model, strategy, print_fn=printed.append)
    assert rows == plan_for_mesh(tiny_model, (2, 1, 1), rank=rank)
    assert "conv1" in printed[0] and "Total activation memory per rank" in printed[0]
    # A globally built model is checked the same way, before anything is computed.
    assert summary(tiny_model(), strategy, print_fn=None) == rows
    # SpatialStrategy.summary is the same function.
    assert strategy.summary(local_model, print_fn=lambda text: None) == rows


def test_incompatible_layout_raises_the_layer_error():
    with pytest.raises(ValueError, match=r"Layer 'conv2' cannot split its input or output over its shards along the depth axis.*Received:"):
        plan_for_mesh(tiny_model, (4, 1, 1))
    with pytest.raises(ValueError, match="Layer 'conv2' cannot split its input or output over its shards"):
        summary(tiny_model(), offline_strategy((4, 1, 1), 0), print_fn=None)
    # 8 planes on 3 shards split 3, 3, 2; conv2's 2 outputs cannot cover 3 shards.
    with pytest.raises(ValueError, match="Input extent 4 and output extent 2 must both be at least the 3 shards"):
        plan_for_mesh(tiny_model, (3, 1, 1))


def test_uneven_split_plans_each_rank_its_own_shard():
    def odd_model():
        x = ks.Input((7, 5, 4, 2), name="x")
        y = ks.layers.SpatialConv3D(3, 3, padding="same", name="conv")(x)
        y = ks.layers.SpatialMaxPooling3D(2, name="pool")(y)  # 7 -> 3, 5 -> 2
        return keras.Model(x, ks.layers.SpatialFlatten(name="flatten")(y))

    first = plan_for_mesh(odd_model, (2, 2, 1), rank=0)
    last = plan_for_mesh(odd_model, (2, 2, 1), rank=3)
    assert [r["local_shape"] for r in first[:3]] == [(4, 3, 4, 2), (4, 3, 4, 3), (2, 1, 2, 3)]
    assert [r["local_shape"] for r in last[:3]] == [(3, 2, 4, 2), (3, 2, 4, 3), (1, 1, 2, 3)]
    assert first[1]["halo"] == ((0, 1), (0, 1), (0, 0))
    assert last[1]["halo"] == ((1, 0), (1, 0), (0, 0))
    # pool: rank 0 outputs [0, 2) reads inputs [0, 4), its own; rank 3 outputs [2, 3)
    # reads [4, 6) but holds [4, 7): it crops one plane; along height it holds [3, 5)
    # and its output 1 reads [2, 4): one plane received, one cropped.
    assert first[2]["halo"] == ((0, 0), (0, -1), (0, 0)) and last[2]["halo"] == ((0, -1), (1, -1), (0, 0))
    assert first[3]["global_shape"] == (3 * 2 * 2 * 3,)


def test_refusals():
    with pytest.raises(ValueError, match="Received: rank=2"):
        plan_for_mesh(tiny_model, (2, 1, 1), rank=2)
    with offline_strategy((2, 1, 1), 0).scope():
        local_model = tiny_model()
    with pytest.raises(ValueError, match="built with no spatial strategy"):
        plan_for_mesh(local_model, (2, 1, 1))
    with pytest.raises(ValueError, match="built under another strategy"):
        summary(local_model, offline_strategy((2, 2, 1), 0), print_fn=None)

    x = ks.Input((8, 4, 4, 2))
    plain = keras.Model(x, keras.layers.Conv3D(2, 3, padding="same", name="plain_conv")(x))
    with pytest.raises(ValueError, match="plain keras.layers.Conv3D on a spatially sharded volume"):
        plan_for_mesh(plain, (2, 1, 1))


def test_format_plan_columns():
    rows = plan_for_mesh(tiny_model, (2, 1, 1), rank=1)
    text = format_plan(rows, Mesh(2, (2, 1, 1)), rank=1)
    conv1 = next(line for line in text.splitlines() if line.startswith("conv1"))
    assert conv1.split()[:8] == ["conv1", "SpatialConv3D", "sharded", "8x4x4x3", "4x4x4x3", "1/0", "0/0", "0/0"]
    relu = next(line for line in text.splitlines() if line.startswith("relu"))
    assert relu.split()[5:8] == ["-", "-", "-"]


def test_cli_prints_the_plan_and_refuses_an_incompatible_layout(capsys):
    sys.path.insert(0, os.path.dirname(CLI))
    try:
        import plan_layout
    finally:
        sys.path.pop(0)
    assert plan_layout.main(["--model", "cosmoflow", "--size", "32", "--spatial", "2,1,1", "--rank", "1"]) == 0
    out = capsys.readouterr().out
    assert "rank=1, coords=(1, 0, 0)" in out and "block1_conv" in out and "16x32x32x16" in out

    result = subprocess.run(
        [sys.executable, CLI, "--model", "cosmoflow", "--size", "96", "--spatial", "4,1,1"],
        capture_output=True, text=True, cwd="/", timeout=120,
    )
    assert result.returncode == 1
    assert "Layer 'block4_pool' cannot split its input or output over its shards along the depth axis" in result.stderr
    assert "Received:" in result.stderr and result.stdout == ""
