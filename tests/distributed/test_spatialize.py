"""keras_spatial.spatialize: plain Keras models made spatial, with the same weights."""

import numpy as np
import pytest

keras = pytest.importorskip("keras")

import keras_spatial as ks  # noqa: E402
from tests.comparison import excess, failures  # noqa: E402
from tests.distributed.launcher import horovod_or_skip, run_on_ranks  # noqa: E402
from tests.distributed.spatialize_workers import plain_model, run_spatialize_suite  # noqa: E402

TWINS = {
    "InputLayer": "SpatialInputLayer", "Conv3D": "SpatialConv3D", "Conv3DTranspose": "SpatialConv3DTranspose",
    "MaxPooling3D": "SpatialMaxPooling3D", "AveragePooling3D": "SpatialAveragePooling3D",
    "UpSampling3D": "SpatialUpSampling3D", "BatchNormalization": "SpatialBatchNormalization",
    "GlobalMaxPooling3D": "SpatialGlobalMaxPooling3D", "GlobalAveragePooling3D": "SpatialGlobalAveragePooling3D",
    "Flatten": "SpatialFlatten",
}


def _volume(seed=0, extent=8, channels=2):
    return np.random.default_rng(seed).standard_normal((2, extent, extent, extent, channels)).astype("float32")


@pytest.mark.parametrize("head", [False, True])
def test_every_layer_type_converts_with_its_weights(head):
    plain = plain_model(head)
    spatial = ks.spatialize(plain)
    for before, after in zip(plain.layers, spatial.layers):
        assert type(after).__name__ == TWINS.get(type(before).__name__, type(before).__name__)
        assert after.name == before.name
    x = _volume()
    assert excess(spatial.predict(x, verbose=0), plain.predict(x, verbose=0), 0, 0) <= 0
    back = ks.to_keras_model(spatial)
    assert back.get_config() == plain.get_config()
    for a, b in zip(back.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_flatten_and_average_pooling_heads_and_a_sequential_model():
    model = keras.Sequential([
        keras.Input((8, 8, 8, 2)),
        keras.layers.Conv3D(3, 3, strides=2, padding="valid"),
        keras.layers.ReLU(),
        keras.layers.Flatten(),
        keras.layers.Dense(2),
    ])
    spatial = ks.spatialize(model)
    assert [type(layer).__name__ for layer in spatial.layers] == [
        "SpatialInputLayer", "SpatialConv3D", "ReLU", "SpatialFlatten", "Dense"]
    x = _volume(1)
    np.testing.assert_array_equal(spatial.predict(x, verbose=0), model.predict(x, verbose=0))


def test_a_loaded_keras_file_converts(tmp_path):
    plain = plain_model(head=True)
    path = str(tmp_path / "plain.keras")
    plain.save(path)
    spatial = ks.spatialize(keras.models.load_model(path))
    x = _volume(2)
    np.testing.assert_array_equal(spatial.predict(x, verbose=0), plain.predict(x, verbose=0))
    # And the spatial model saves and loads as a spatial model.
    spatial.save(str(tmp_path / "spatial.keras"))
    again = keras.models.load_model(str(tmp_path / "spatial.keras"))
    assert type(again.layers[1]).__name__ == "SpatialConv3D"


def _refusal(layer_fn, match, error=ks.SpatialNotSupportedError):
    x = keras.Input((8, 8, 8, 2))
    y = layer_fn(x)
    with pytest.raises(error, match=match):
        ks.spatialize(keras.Model(x, y))


def test_layers_that_cannot_run_split_are_refused_by_name():
    _refusal(lambda x: keras.layers.Permute((2, 1, 3, 4), name="swap")(x), r"'swap' \(Permute\).*no split version")
    _refusal(lambda x: keras.layers.Cropping3D(1, name="crop")(x), r"'crop' \(Cropping3D\)")
    _refusal(lambda x: keras.layers.Concatenate(axis=1, name="cat")([x, x]), r"'cat'.*axis 1, a spatial axis")
    _refusal(lambda x: keras.layers.PReLU(name="prelu")(x), r"'prelu'.*shared_axes=\[1, 2, 3\]")
    _refusal(lambda x: keras.layers.LayerNormalization(axis=[1, 2, 3], name="ln")(x), r"'ln'.*normalizes over axis")
    _refusal(lambda x: keras.layers.Reshape((512, 2), name="flat")(x), r"'flat'", ValueError)
    # After a gather every layer is fine.
    x = keras.Input((8, 8, 8, 2))
    y = keras.layers.Reshape((2, 4))(keras.layers.Flatten()(keras.layers.Conv3D(1, 2, strides=4)(x)))
    ks.spatialize(keras.Model(x, keras.layers.Permute((2, 1))(y)))
    # Per-channel versions of the checked layers are fine on a split volume.
    y = keras.layers.PReLU(shared_axes=[1, 2, 3])(keras.layers.LayerNormalization()(x))
    ks.spatialize(keras.Model(x, keras.layers.Concatenate(axis=-1)([x, y])))


def test_nested_models_and_subclassed_models_are_refused():
    inner_in = keras.Input((8, 8, 8, 2))
    inner = keras.Model(inner_in, keras.layers.Conv3D(2, 3, padding="same")(inner_in), name="block")
    x = keras.Input((8, 8, 8, 2))
    with pytest.raises(ks.SpatialNotSupportedError, match="nested models.*'block'"):
        ks.spatialize(keras.Model(x, inner(x)))

    class Custom(keras.Model):
        def call(self, inputs):
            return inputs

    with pytest.raises(ValueError, match="functional or Sequential"):
        ks.spatialize(Custom())


def test_unsplittable_layout_is_refused_before_building_for_the_rank():
    """plan_for_mesh's arithmetic applies to the converted model: 12 -> 6 -> 3 planes
    split 4 ways unevenly (2, 1, 0 ...): the second pool leaves fewer planes than shards.
    A 2-way split (6 = 3 + 3, then 3 = 2 + 1) is served."""
    from keras_spatial.spatialize import _check_sharded_layers, _spatial_config

    x = keras.Input((12, 8, 8, 1))
    y = keras.layers.MaxPooling3D(2)(keras.layers.MaxPooling3D(2)(x))
    plain = keras.Model(x, y)
    spatial_global = ks.spatialize(plain)
    assert _spatial_config(plain)["layers"][1]["class_name"] == "SpatialMaxPooling3D"
    _check_sharded_layers(plain, spatial_global, (2, 1, 1))
    with pytest.raises(ValueError, match="cannot split its input or output over its shards"):
        _check_sharded_layers(plain, spatial_global, (4, 1, 1))


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_spatialized_models_match_plain_keras_on_two_ranks():
    horovod_or_skip()
    shapes = [(2, 1, 1), (1, 1, 2)]
    per_rank = run_on_ranks(run_spatialize_suite, 2, shapes)
    for rank, results in enumerate(per_rank):
        for shape in shapes:
            for head in (False, True):
                r = results[(shape, head)]
                assert "SpatialConv3D" in r["types"] and "Concatenate" in r["types"]
                bad = failures({k: v for k, v in r.items() if k != "types"})
                assert not bad, f"rank {rank}, {shape}, head={head}: {bad}"


def test_a_compiled_model_comes_back_compiled_with_a_distributed_optimizer():
    plain = plain_model(head=True)
    plain.compile(keras.optimizers.SGD(0.01, momentum=0.9), "mse", metrics=["mae"])
    spatial = ks.spatialize(plain)
    assert isinstance(spatial.optimizer, ks.DistributedOptimizer)
    assert spatial.optimizer.inner_optimizer.get_config()["momentum"] == 0.9
    x, y = _volume(3), np.zeros((2, 3), "float32")
    np.testing.assert_allclose(spatial.evaluate(x, y, verbose=0), plain.evaluate(x, y, verbose=0), rtol=1e-6)
    assert not ks.spatialize(plain_model(head=True)).compiled
