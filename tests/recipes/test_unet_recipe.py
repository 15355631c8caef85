"""The 3D U-Net recipe: build_model (shapes, parameter counts, errors, save/load), the
global Dice metric, the train entry point's arguments, and one 2-rank run of
`python -m recipes.unet3d.train` whose checkpoint and prediction files are checked in
this process.
"""

import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

keras = pytest.importorskip("keras")

import keras_spatial as ks  # noqa: E402
from keras_spatial.plan import plan_for_mesh  # noqa: E402
from recipes.unet3d import train  # noqa: E402
from recipes.unet3d.model import (  # noqa: E402
    DiceScore,
    build_model,
    check_split,
    confusion_matrix,
    dice_from_confusion,
)
from tests.distributed.launcher import REPO_ROOT, horovod_or_skip, subprocess_env  # noqa: E402

PAPER_PARAMS = 19_076_131  # 19,065,888 kernel weights + 896 + 3 biases + 4 x 2,336 batch norm
PAPER_PARAMS_NO_BN = 19_069_123  # 19,065,888 kernel weights + 3,235 biases


@pytest.fixture(scope="module")
def segmentation_dir(tmp_path_factory):
    """6 samples of 16^3 in 3 files of 2, written by the recipe's writer."""
    out = tmp_path_factory.mktemp("unet") / "seg"
    subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "tools", "write_segmentation.py"), "--out",
         str(out), "--count", "6", "--size", "16", "--per-file", "2", "--seed", "3",
         "--workers", "1", "--quiet"],
        check=True, env=subprocess_env(),
    )
    return out


# build_model -------------------------------------------------------------------------
def test_paper_configuration_has_about_19_million_parameters():
    model = build_model(32)  # depth 3, base filters 32: the paper's network (docs/science.md)
    assert model.count_params() == PAPER_PARAMS
    assert build_model(32, batch_norm=False).count_params() == PAPER_PARAMS_NO_BN
    assert abs(PAPER_PARAMS - 19e6) / 19e6 < 0.01
    assert [model.get_layer(f"up{level}_transpose").filters for level in (2, 1, 0)] == [512, 256, 128]
    assert [model.get_layer(f"down{level}_b_conv").filters for level in range(3)] == [64, 128, 256]
    assert model.get_layer("bottom_b_conv").filters == 512


def test_tiny_parameter_count_item_by_item():
    conv = lambda cin, cout, bias: 27 * cin * cout + (cout if bias else 0)  # noqa: E731
    bn = lambda channels: 4 * channels  # noqa: E731  gamma, beta, moving mean and variance
    # depth 1, F = 2: down (1->2->4), bottom (4->4->8), up: transpose 8->8, concat 8+4,
    # convs 12->4->4, logits 4->3.
    transpose, logits = 8 * 8 * 8 + 8, 4 * 3 + 3
    convs = [(1, 2), (2, 4), (4, 4), (4, 8), (12, 4), (4, 4)]
    with_bn = sum(conv(i, o, False) + bn(o) for i, o in convs) + transpose + logits
    without = sum(conv(i, o, True) for i, o in convs) + transpose + logits
    assert (with_bn, without) == (3933, 3855)
    assert build_model(16, depth=1, base_filters=2).count_params() == with_bn
    assert build_model(16, depth=1, base_filters=2, batch_norm=False).count_params() == without


def test_shapes_and_probabilities_of_a_non_cubic_model():
    model = build_model((16, 32, 8, 2), classes=4, depth=3, base_filters=2)
    assert model.input.shape == (None, 16, 32, 8, 2)
    assert model.output.shape == (None, 16, 32, 8, 4)
    assert model.get_layer("down2_pool").output.shape[1:4] == (2, 4, 1)
    assert isinstance(model.layers[0], ks.layers.SpatialInputLayer)
    kinds = {type(layer) for layer in model.layers}
    assert ks.layers.SpatialConv3DTranspose in kinds and keras.layers.Concatenate in kinds
    assert keras.layers.Conv3D not in kinds  # every convolution is a spatial one
    x = np.random.default_rng(0).standard_normal((2, 16, 32, 8, 2)).astype("float32")
    y = np.asarray(model(x, training=False))
    assert y.shape == (2, 16, 32, 8, 4)
    np.testing.assert_allclose(y.sum(axis=-1), 1.0, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"input_shape": 20, "depth": 3}, r"divisible by 2\*\*depth = 8.*Received: input_shape=\(20, 20, 20, 1\), depth=3$"),
        ({"input_shape": (16, 16, 12, 1), "depth": 3}, r"Received: input_shape=\(16, 16, 12, 1\), depth=3$"),
        ({"input_shape": (16, 16, 16)}, r"four positive integers.*Received: input_shape=\(16, 16, 16\)$"),
        ({"input_shape": 0}, r"Received: input_shape=0$"),
        ({"input_shape": 16.0}, r"Received: input_shape=16.0$"),
        ({"input_shape": True}, r"Received: input_shape=True$"),
        ({"classes": 1}, r"Received: classes=1$"),
        ({"depth": 0}, r"Received: depth=0$"),
        ({"depth": 2.0}, r"Received: depth=2.0$"),
        ({"base_filters": 0}, r"Received: base_filters=0$"),
        ({"batch_norm_momentum": 1.0}, r"Received: batch_norm_momentum=1.0$"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, message):
    kwargs = {"input_shape": 16, "depth": 2, "base_filters": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        build_model(**kwargs)


def test_spatial_split_needs_a_plane_per_shard_at_the_bottom():
    check_split(16, 3, (2, 1, 1))  # 16 -> 2 at the bottom, 1 voxel per shard
    plan_for_mesh(lambda: build_model(16, depth=3, base_filters=2), (2, 1, 1))
    # 40 -> 20 -> 10 -> 5: odd at the bottom, split 3 + 2 (uneven shards)
    check_split(40, 3, (2, 1, 1))
    rows = plan_for_mesh(lambda: build_model(40, depth=3, base_filters=2), (2, 1, 1), rank=1)
    rows = {r["name"]: r for r in rows}
    assert rows["down2_pool"]["local_shape"][0] == 2 and rows["down2_pool"]["halo"][0] == (-1, 0)
    # rank 1's 5 up-sampled planes [5, 10) of 10 come from inputs [2, 5): one from rank 0
    assert rows["up2_transpose"]["local_shape"][0] == 5 and rows["up2_transpose"]["halo"][0] == (1, 0)
    with pytest.raises(ValueError, match=r"extent 16 to 1 at its bottom, fewer planes than its 2 "
                                         r"shards\. Use depth <= 3"):
        check_split(16, 4, (2, 1, 1))
    with pytest.raises(ValueError, match=r"height extent 32 to 4.*than its 8 shards"):
        check_split((16, 32, 16, 1), 3, (1, 8, 1))
    # Without the recipe's check, the layers refuse the layout at build time too.
    with pytest.raises(ValueError, match="'down3_pool' cannot split its input or output over its shards along the depth"):
        plan_for_mesh(lambda: build_model(16, depth=4, base_filters=2), (2, 1, 1))


def test_save_and_load_give_the_same_predictions(tmp_path):
    keras.utils.set_random_seed(1)
    model = build_model((16, 16, 8, 1), depth=2, base_filters=2)
    path = str(tmp_path / "unet.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    x = np.random.default_rng(1).standard_normal((1, 16, 16, 8, 1)).astype("float32")
    np.testing.assert_array_equal(np.asarray(model(x)), np.asarray(loaded(x)))
    plain = ks.to_keras_model(model)
    np.testing.assert_allclose(np.asarray(plain(x)), np.asarray(model(x)), atol=1e-6)


# Dice --------------------------------------------------------------------------------
def test_dice_metric_matches_numpy_and_is_invariant_to_averaging_its_state():
    rng = np.random.default_rng(2)
    batches = [(rng.integers(0, 3, (2, 4, 4, 4)), rng.random((2, 4, 4, 4, 3)).astype("float32"))
               for _ in range(3)]
    total = sum(confusion_matrix(y, p.argmax(-1), 3) for y, p in batches)
    expected = dice_from_confusion(total)
    metrics = [DiceScore(3)] + [DiceScore(3, class_id=c) for c in range(3)]
    for y, p in batches:
        for metric in metrics:
            metric.update_state(y[..., None] if metric.class_id == 1 else y, p)
    assert float(metrics[0].result()) == pytest.approx(expected[1:].mean(), abs=1e-12)
    for c in range(3):
        assert float(metrics[c + 1].result()) == pytest.approx(expected[c], abs=1e-12)
    # MetricAverage replaces the state by (world totals) / (world size): same ratios.
    metrics[0].confusion.assign(np.asarray(metrics[0].confusion) / 2.0)
    assert float(metrics[0].result()) == pytest.approx(expected[1:].mean(), abs=1e-12)
    config = metrics[2].get_config()
    assert DiceScore.from_config(config).get_config() == config
    assert (metrics[0].name, metrics[2].name) == ("dice", "dice_1")
    metrics[0].reset_state()
    assert float(metrics[0].result()) == 1.0  # nothing seen: every class absent on both sides


def test_dice_from_confusion_by_hand():
    # truth [0, 0, 1, 1, 2], prediction [0, 1, 1, 1, 0]
    confusion = confusion_matrix([0, 0, 1, 1, 2], [0, 1, 1, 1, 0], 3)
    np.testing.assert_allclose(dice_from_confusion(confusion), [2 / 4, 4 / 5, 0.0])
    with pytest.raises(ValueError, match="Received: class_id=3"):
        DiceScore(3, class_id=3)


# Entry point arguments ------------------------------------------------------------------
def _main(capsys, *argv):
    try:
        status = train.main(list(argv))
    except SystemExit as exit_:  # argparse errors
        status = exit_.code
    return status, capsys.readouterr().err


def test_entry_point_refuses_bad_arguments(tmp_path, capsys, segmentation_dir):
    empty = tmp_path / "empty"
    empty.mkdir()
    base = ["--batch-size", "2", "--epochs", "1", "--out", str(tmp_path / "out")]
    status, err = _main(capsys, "--data", str(empty), *base)
    assert status == 2 and "no files seg_*.h5" in err, err
    status, err = _main(capsys, "--data", str(empty), "--spatial", "2,1", *base)
    assert status == 2 and "three positive integers" in err, err
    status, err = _main(capsys, "--data", str(empty), "--batch-size", "0", "--epochs", "1")
    assert status == 2 and "--batch-size '0'" in err, err
    status, err = _main(capsys, "--data", str(empty), *base, "--validation-fraction", "1")
    assert status == 2 and "--validation-fraction '1'" in err, err

    one_file = tmp_path / "one"
    one_file.mkdir()
    os.symlink(segmentation_dir / "seg_0000.h5", one_file / "seg_0000.h5")
    status, err = _main(capsys, "--data", str(one_file), *base)
    assert status == 2 and "cannot be split into training and validation" in err, err

    # One process is one rank: a 2-way split cannot be served.
    status, err = _main(capsys, "--data", str(segmentation_dir), "--spatial", "2,1,1", *base)
    assert status == 2 and "--spatial 2,1,1" in err, err
    status, err = _main(capsys, "--data", str(segmentation_dir), *base, "--depth", "5")
    assert status == 2 and "divisible by 2**depth = 32" in err, err
    status, err = _main(capsys, "--data", str(segmentation_dir), "--batch-size", "8", "--epochs", "1")
    assert status == 2 and "fewer than one global batch" in err, err


def test_file_split_and_prediction_names():
    paths = [f"d/seg_{i:04d}.h5" for i in range(4)]
    assert train.split_files(reversed(paths), 0.25) == (paths[:3], paths[3:])
    assert train.split_files(paths, 0.5) == (paths[:2], paths[2:])
    assert train.prediction_filename("d/seg_0012.h5") == "pred_0012.h5"


# Two ranks -----------------------------------------------------------------------------
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_train_on_two_ranks_then_check_predictions_in_one_process(tmp_path, segmentation_dir):
    horovod_or_skip()
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    if not os.path.exists(horovodrun):
        pytest.skip("horovodrun not next to the test interpreter")
    out = tmp_path / "run"
    result = subprocess.run(
        [horovodrun, "--gloo", "-np", "2", "-H", "localhost:2", sys.executable, "-m",
         "recipes.unet3d.train", "--data", str(segmentation_dir), "--spatial", "2,1,1",
         "--batch-size", "2", "--epochs", "1", "--depth", "1", "--base-filters", "4",
         "--out", str(out)],
        cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "final validation Dice" in result.stdout and "all-background" in result.stdout
    for name in ("model.keras", "history.json", "loss.png"):
        assert (out / name).is_file(), name
    record = json.loads((out / "history.json").read_text())
    assert record["config"]["validation_files"] == ["seg_0002.h5"]
    assert record["summary"]["validation_exact"]
    history = record["history"]
    assert len(history["val_loss"]) == 1
    for key in ("dice", "val_dice", "val_dice_0", "val_dice_1", "val_dice_2"):
        assert all(0.0 <= value <= 1.0 for value in history[key]), key

    source, predicted_path = segmentation_dir / "seg_0002.h5", out / "predictions" / "pred_0002.h5"
    with h5py.File(source, "r") as f:
        images, truth = f["images"][...], f["labels"][...]
    with h5py.File(predicted_path, "r") as f:
        labels, probabilities = f["labels"][...], f["probabilities"][...]
    assert labels.shape == truth.shape and labels.dtype == np.uint8
    assert probabilities.shape == truth.shape + (3,)
    np.testing.assert_array_equal(labels, probabilities.argmax(axis=-1))

    # The checkpoint is a whole-volume model in this process (no Horovod).
    model = keras.saving.load_model(str(out / "model.keras"))
    assert model.input_shape == (None, 16, 16, 16, 1)
    mine = np.asarray(model.predict(images[:1], verbose=0))[0]
    np.testing.assert_allclose(mine, probabilities[0], atol=1e-5)
    top2 = np.sort(mine, axis=-1)[..., -2:]
    differs = mine.argmax(axis=-1) != labels[0]
    assert np.all(top2[..., 1][differs] - top2[..., 0][differs] < 1e-5)

    # The logged global Dice is the Dice of the written predictions.
    dice = dice_from_confusion(confusion_matrix(truth, labels, 3))
    assert history["val_dice"][-1] == pytest.approx(dice[1:].mean(), abs=1e-4)
    for c in range(3):
        assert history[f"val_dice_{c}"][-1] == pytest.approx(dice[c], abs=1e-4)
    assert record["summary"]["baseline_dice"]["all_background"] == 0.0
