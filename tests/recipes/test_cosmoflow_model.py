"""The CosmoFlow recipe models: architecture, parameter counts, arguments, plain-Keras twin.

Single process, no strategy (or a 1x1x1 one): building is symbolic and cheap; only W=32
runs a forward pass.
"""

import numpy as np
import pytest

keras = pytest.importorskip("keras")

import keras_spatial as ks  # noqa: E402
from keras_spatial.plan import plan_for_mesh  # noqa: E402
from recipes.cosmoflow.model import (  # noqa: E402
    BATCH_RENORM_CLIPPING,
    BATCH_RENORM_MOMENTUM,
    build_model,
    paper_pooled_blocks,
    whitening_statistics,
)

PAPER_PARAMS = 9_437_636  # 4,715,712 conv (no bias) + 4,721,924 dense
# MLPerf HPC's reference (kernel 2 'same'): 1,394,656 conv + a first dense layer of
# (W/32)^3 x 512 inputs; 5,597,604 at 128^3, as its Keras model reports.
MLPERF_PARAMS = {32: 1_468_836, 64: 1_927_588, 128: 5_597_604}
SPATIAL_TYPES = (
    ks.layers.SpatialInputLayer,
    ks.layers.SpatialConv3D,
    ks.layers.SpatialAveragePooling3D,
    ks.layers.SpatialMaxPooling3D,
    ks.layers.SpatialBatchNormalization,
)


def _up_to_flatten(model):
    names = [layer.name for layer in model.layers]
    return model.layers[: names.index("flatten")]


@pytest.mark.parametrize("size", [32, 64, 96, 128, 256, 512])
def test_paper_parameter_count_is_the_same_at_every_size(size):
    model = build_model(size)
    assert model.count_params() == PAPER_PARAMS
    assert abs(model.count_params() - 9.4e6) / 9.4e6 < 0.01  # the paper: "about 9.4 M"
    assert model.get_layer("flatten").output.shape[-1] == 2 * 2 * 2 * 256


def test_paper_with_batch_norm_adds_four_numbers_per_channel():
    model = build_model(64, batch_norm=True)
    assert model.count_params() == PAPER_PARAMS + 4 * (16 + 32 + 64 + 128 + 3 * 256)
    assert sum(isinstance(layer, ks.layers.SpatialBatchNormalization) for layer in model.layers) == 7


@pytest.mark.parametrize("variant", ["paper", "mlperf"])
def test_batch_renorm_renormalizes_every_trunk_batch_norm(variant):
    model = build_model(64, variant, batch_norm=True, batch_renorm=True)
    norms = [layer for layer in model.layers if isinstance(layer, ks.layers.SpatialBatchNormalization)]
    assert norms and all(layer.renorm for layer in norms)
    assert all(layer.renorm_clipping == BATCH_RENORM_CLIPPING for layer in norms)
    assert all(layer.renorm_momentum == BATCH_RENORM_MOMENTUM for layer in norms)
    # Renormalization adds training-only statistics, not parameters.
    plain = build_model(64, variant, batch_norm=True)
    assert model.count_params() > plain.count_params()
    assert sum(map(np.size, model.trainable_weights)) == sum(map(np.size, plain.trainable_weights))


@pytest.mark.parametrize("size", sorted(MLPERF_PARAMS))
def test_mlperf_parameter_count(size):
    model = build_model(size, "mlperf")
    assert model.count_params() == MLPERF_PARAMS[size]
    convs = [layer for layer in model.layers if isinstance(layer, ks.layers.SpatialConv3D)]
    assert [layer.filters for layer in convs] == [32, 64, 128, 256, 512]
    assert all(layer.kernel_size == (2, 2, 2) and layer.padding == "same" for layer in convs)


@pytest.mark.parametrize("variant,features", [("paper", 256), ("mlperf", 512)])
def test_global_average_head(variant, features):
    keras.utils.set_random_seed(0)
    model = build_model(64, variant, head="gap", dropout=0.0)
    assert model.get_layer("global_average").output.shape[-1] == features
    assert "flatten" not in [layer.name for layer in model.layers]
    x = np.random.default_rng(1).standard_normal((2, 64, 64, 64, 4)).astype("float32")
    plain = ks.to_keras_model(model)
    np.testing.assert_allclose(plain(x), model(x), rtol=1e-5, atol=1e-6)
    gathered = build_model(64, "paper", head="gap", gather_before_block=5)
    assert isinstance(gathered.get_layer("global_average"), keras.layers.GlobalAveragePooling3D)


@pytest.mark.parametrize(
    "size,pooled",
    [
        (128, (True,) * 5 + (False, False)),  # the table: blocks 6 and 7 conv only
        (256, (True,) * 6 + (False,)),
        (512, (True,) * 7),
        (64, (True,) * 4 + (False,) * 3),  # generalisation: stop pooling at extent 2
        (32, (True,) * 3 + (False,) * 4),
    ],
)
def test_paper_pools_follow_the_table(size, pooled):
    assert paper_pooled_blocks(size) == pooled
    model = build_model(size)
    names = {layer.name for layer in model.layers}
    assert tuple(f"block{b}_pool" in names for b in range(1, 8)) == pooled
    extents = {128: [64, 32, 16, 4, 2, 2, 2], 256: [128, 64, 32, 8, 4, 2, 2], 512: [256, 128, 64, 16, 8, 4, 2]}
    if size in extents:  # the table's per-block output extents
        for block, extent in enumerate(extents[size], start=1):
            last = f"block{block}_pool" if pooled[block - 1] else f"block{block}_lrelu"
            assert model.get_layer(last).output.shape[1:4] == (extent,) * 3


@pytest.mark.parametrize("variant", ["paper", "mlperf"])
@pytest.mark.parametrize("size", [32, 64])
def test_layers_are_spatial_up_to_the_head(variant, size):
    model = build_model(size, variant, batch_norm=True)
    assert isinstance(model.layers[0], ks.layers.SpatialInputLayer)
    assert model.input.shape == (None, size, size, size, 4)  # no strategy: global shapes
    for layer in _up_to_flatten(model):
        assert isinstance(layer, SPATIAL_TYPES + (keras.layers.LeakyReLU,)), layer.name
    assert isinstance(model.get_layer("flatten"), ks.layers.SpatialFlatten)
    slope = 0.01 if variant == "paper" else 0.3
    for layer in model.layers:
        if isinstance(layer, keras.layers.LeakyReLU):
            assert layer.negative_slope == pytest.approx(slope)
        if isinstance(layer, ks.layers.SpatialConv3D):
            kernel = 3 if variant == "paper" else 2
            assert layer.kernel_size == (kernel,) * 3 and layer.padding == "same"
            assert layer.use_bias == (variant == "mlperf")
            assert isinstance(layer.kernel_initializer, keras.initializers.GlorotUniform)
        if variant == "paper" and isinstance(layer, ks.layers.SpatialAveragePooling3D):
            assert (layer.pool_size, layer.strides, layer.padding) == ((3, 3, 3), (2, 2, 2), "same")
        if variant == "mlperf" and isinstance(layer, ks.layers.SpatialMaxPooling3D):
            assert (layer.pool_size, layer.strides, layer.padding) == ((2, 2, 2), (2, 2, 2), "valid")
    has_average = any(isinstance(layer, ks.layers.SpatialAveragePooling3D) for layer in model.layers)
    assert has_average == (variant == "paper")


def test_paper_head():
    model = build_model(32)
    head = [layer for layer in model.layers if layer.name.startswith("head_")]
    assert [type(layer).__name__ for layer in head] == [
        "Dropout", "Dense", "LeakyReLU", "Dropout", "Dense", "LeakyReLU", "Dropout", "Dense"]
    assert [layer.units for layer in head if isinstance(layer, keras.layers.Dense)] == [2048, 256, 4]
    assert all(layer.rate == 0.2 for layer in head if isinstance(layer, keras.layers.Dropout))
    assert model.get_layer("block4_conv").strides == (2, 2, 2)


def test_mlperf_head_is_tanh_times_1_2():
    model = build_model(32, "mlperf")
    output, scale = model.layers[-2], model.layers[-1]
    assert output.activation is keras.activations.tanh and output.units == 4
    assert isinstance(scale, keras.layers.Rescaling) and scale.scale == pytest.approx(1.2)
    assert all(layer.rate == 0.5 for layer in model.layers if isinstance(layer, keras.layers.Dropout))


@pytest.mark.parametrize("variant", ["paper", "mlperf"])
def test_to_keras_model_is_the_same_model(variant):
    keras.utils.set_random_seed(0)
    model = build_model(32, variant, batch_norm=True)
    plain = ks.to_keras_model(model)
    assert plain.count_params() == model.count_params()
    assert not any(type(layer).__module__.startswith("keras_spatial") for layer in plain.layers)
    x = np.random.default_rng(0).standard_normal((1, 32, 32, 32, 4)).astype("float32")
    np.testing.assert_allclose(plain(x, training=False), model(x, training=False), rtol=1e-5, atol=1e-6)
    if variant == "mlperf":
        assert np.all(np.abs(plain(x, training=False)) <= 1.2)


def test_paper_model_forward_activation_memory_at_128_is_about_0_38_gib():
    """The layout plan counts about 0.38 GiB of forward layer outputs for one 128^3 x 4
    sample of the paper's network in float32 (docs/science.md, "Memory")."""
    rows = plan_for_mesh(lambda: build_model(128), (1, 1, 1))
    assert sum(row["bytes"] for row in rows) / 2**30 == pytest.approx(0.38, abs=0.005)


@pytest.mark.parametrize(
    "variant,size,spatial_shape,valid",
    [
        ("paper", 32, (2, 1, 1), True),
        ("paper", 64, (2, 1, 1), True),
        ("paper", 128, (2, 1, 1), True),
        ("paper", 32, (4, 1, 1), False),  # block4_conv: 4 -> 2
        ("paper", 64, (4, 1, 1), False),  # block4_pool: 4 -> 2
        ("paper", 128, (4, 1, 1), False),  # block5_pool: 4 -> 2 (the last volume is 2^3)
        ("mlperf", 32, (2, 1, 1), False),  # block5_pool: 2 -> 1
        ("mlperf", 64, (2, 1, 1), True),
        ("mlperf", 64, (4, 1, 1), False),
        ("mlperf", 128, (4, 1, 1), True),
    ],
)
def test_which_depth_splits_stay_aligned(variant, size, spatial_shape, valid):
    def builder():
        return build_model(size, variant)

    if valid:
        plan_for_mesh(builder, spatial_shape)
    else:
        with pytest.raises(ValueError, match="cannot split its input or output over its shards along the depth axis"):
            plan_for_mesh(builder, spatial_shape)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"variant": "lbann"}, r"Received: variant='lbann'$"),
        ({"input_size": 16}, r"Received: input_size=16$"),
        ({"input_size": 1024}, r"Received: input_size=1024$"),
        ({"input_size": 64.0}, r"Received: input_size=64.0$"),
        ({"input_size": True}, r"Received: input_size=True$"),
        ({"input_size": 48, "variant": "mlperf"}, r"multiple of 32.*Received: input_size=48, variant='mlperf'$"),
        ({"channels": 0}, r"Received: channels=0$"),
        ({"dropout": 1.0}, r"Received: dropout=1.0$"),
        ({"dropout": "0.2"}, r"Received: dropout='0.2'$"),
        ({"outputs": 0}, r"Received: outputs=0$"),
        ({"head": "max"}, r"`head` must be one of .*Received: head='max'$"),
        ({"batch_renorm": True}, r"needs `batch_norm=True`. Received: batch_norm=False$"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_model(**kwargs)


def test_gathering_before_block_four_makes_a_four_way_depth_split_valid():
    with pytest.raises(ValueError, match="cannot split its input or output over its shards"):
        plan_for_mesh(lambda: build_model(64), (4, 1, 1))
    rows = plan_for_mesh(lambda: build_model(64, gather_before_block=4), (4, 1, 1))
    assert {r["name"]: r["split"] for r in rows}["block3_pool"] == "sharded"
    assert {r["name"]: r["split"] for r in rows}["block4_conv"] == "replicated"
    assert build_model(64, gather_before_block=4).count_params() == build_model(64).count_params()
    with pytest.raises(ValueError, match="gather_before_block"):
        build_model(64, gather_before_block=1)


def test_input_standardization_is_a_fixed_first_layer():
    model = build_model(32, input_mean=[1.0, 2.0, 3.0, 4.0], input_std=2.0)
    layer = model.get_layer("input_standardization")
    assert model.count_params() == 9_437_636  # the statistics are constants, not weights
    assert len(model.trainable_weights) == len(build_model(32).trainable_weights)
    x = np.full((1, 4, 4, 4, 4), 5.0, np.float32)
    np.testing.assert_allclose(layer(x).numpy()[0, 0, 0, 0], [2.0, 1.5, 1.0, 0.5], rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"input_mean": 1.0}, "go together"),
        ({"input_mean": [1.0, 2.0], "input_std": 1.0}, "one finite number or 4"),
        ({"input_mean": 0.0, "input_std": [1.0, 1.0, 0.0, 1.0]}, "must be positive"),
        ({"input_mean": float("nan"), "input_std": 1.0}, "one finite number"),
    ],
)
def test_bad_standardization(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_model(32, **kwargs)


def test_whitening_statistics_give_unit_covariance_and_stay_symmetric():
    rng = np.random.default_rng(0)
    mixing = np.array([[1.0, 0.9, 0.8, 0.7], [0.0, 0.3, 0.1, 0.2], [0.0, 0.0, 0.2, 0.1], [0.0, 0.0, 0.0, 0.1]])
    samples = [rng.standard_normal((8, 8, 8, 4)) @ mixing + [4.0, 3.0, 2.0, 1.0] for _ in range(3)]
    mean, matrix = whitening_statistics(samples)
    voxels = np.concatenate([s.reshape(-1, 4) for s in samples])
    np.testing.assert_allclose(mean, voxels.mean(axis=0), rtol=1e-12)
    white = (voxels - mean) @ np.array(matrix)
    np.testing.assert_allclose(np.cov(white.T, bias=True), np.eye(4), atol=1e-10)
    np.testing.assert_allclose(matrix, np.transpose(matrix), atol=1e-12)  # ZCA: W = W^T


def test_whitening_statistics_refuse_singular_or_empty_input():
    x = np.random.default_rng(1).standard_normal((100, 3))
    with pytest.raises(ValueError, match="singular"):
        whitening_statistics([np.concatenate([x, x[:, :1]], axis=1)])
    with pytest.raises(ValueError, match="at least one voxel"):
        whitening_statistics([])


def test_input_whitening_is_a_fixed_first_layer():
    mean = [1.0, 2.0, 3.0, 4.0]
    matrix = np.arange(16, dtype=np.float64).reshape(4, 4) / 10
    model = build_model(32, input_whitening=(mean, matrix))
    layer = model.get_layer("input_whitening")
    assert not layer.trainable
    assert len(model.trainable_weights) == len(build_model(32).trainable_weights)
    x = np.random.default_rng(2).uniform(0, 5, (1, 2, 2, 2, 4)).astype(np.float32)
    np.testing.assert_allclose(layer(x).numpy(), (x - mean) @ matrix, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"input_whitening": ([0.0] * 4, np.eye(3))}, "a pair \\(mean, matrix\\) of 4 finite means"),
        ({"input_whitening": ([0.0] * 4,)}, "a pair"),
        ({"input_whitening": ([float("inf")] * 4, np.eye(4))}, "finite"),
        ({"input_whitening": ([0.0] * 4, np.eye(4)), "input_mean": 0.0, "input_std": 1.0}, "one or the other"),
    ],
)
def test_bad_whitening(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_model(32, **kwargs)
