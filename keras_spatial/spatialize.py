"""`spatialize`: a plain Keras 3D model, as the spatial model of the same layers and weights.

Each Keras layer that mixes voxels becomes its keras_spatial twin, which takes exactly the
same config (`SPATIAL_TWINS`); a 5D `InputLayer` becomes `keras_spatial.Input` of the same
global shape. Layers that act on each voxel alone (activations, Dense on the channels,
merges of volumes, dropout, per-channel normalization: `VOXELWISE_LAYERS`) are kept as
they are on sharded volumes, and any layer is kept after a gather (`Flatten`, global
pooling), where every rank holds the whole tensor. Anything else on a sharded volume is
refused, naming the layer and why, before anything is computed.
"""

from __future__ import annotations

import copy
from typing import Optional

import keras

from keras_spatial.context import get_strategy, no_strategy
from keras_spatial.errors import SpatialNotSupportedError
from keras_spatial.layers.convolutional import SpatialConv3D
from keras_spatial.layers.convolutional_transpose import SpatialConv3DTranspose
from keras_spatial.layers.core import SpatialInputLayer
from keras_spatial.layers.global_pooling import SpatialGlobalAveragePooling3D, SpatialGlobalMaxPooling3D
from keras_spatial.layers.normalization import SpatialBatchNormalization
from keras_spatial.layers.pooling import SpatialAveragePooling3D, SpatialMaxPooling3D
from keras_spatial.layers.reshaping import SpatialFlatten
from keras_spatial.layers.upsampling import SpatialUpSampling3D
from keras_spatial.optimizer import DistributedOptimizer
from keras_spatial.plan import plan_for_mesh

# Keras layer class -> the keras_spatial layer that computes it on a split volume.
SPATIAL_TWINS = {
    keras.layers.Conv3D: SpatialConv3D,
    keras.layers.Conv3DTranspose: SpatialConv3DTranspose,
    keras.layers.MaxPooling3D: SpatialMaxPooling3D,
    keras.layers.AveragePooling3D: SpatialAveragePooling3D,
    keras.layers.UpSampling3D: SpatialUpSampling3D,
    keras.layers.GlobalAveragePooling3D: SpatialGlobalAveragePooling3D,
    keras.layers.GlobalMaxPooling3D: SpatialGlobalMaxPooling3D,
    keras.layers.Flatten: SpatialFlatten,
    keras.layers.BatchNormalization: SpatialBatchNormalization,
}

# Keras layers whose output at a voxel depends on the inputs at that voxel only (given the
# checks of `_voxelwise_problem`): a shard's output is the shard of the whole one's.
VOXELWISE_LAYERS = (
    keras.layers.Activation,
    keras.layers.ReLU,
    keras.layers.LeakyReLU,
    keras.layers.ELU,
    keras.layers.PReLU,
    keras.layers.Softmax,
    keras.layers.Dense,
    keras.layers.EinsumDense,
    keras.layers.Add,
    keras.layers.Subtract,
    keras.layers.Multiply,
    keras.layers.Average,
    keras.layers.Maximum,
    keras.layers.Minimum,
    keras.layers.Concatenate,
    keras.layers.Dropout,
    keras.layers.SpatialDropout3D,
    keras.layers.GaussianNoise,
    keras.layers.GaussianDropout,
    keras.layers.Identity,
    keras.layers.Rescaling,
    keras.layers.Normalization,
    keras.layers.LayerNormalization,
)

_CHANNEL_AXES = (-1, 4)


def _voxelwise_problem(layer) -> Optional[str]:
    """Why `layer`, a VOXELWISE_LAYERS instance, would not act voxel by voxel, or None."""
    if isinstance(layer, (keras.layers.Concatenate, keras.layers.Softmax)):
        if layer.axis not in _CHANNEL_AXES:
            return f"it works along axis {layer.axis}, a spatial axis; only the channel axis (-1) is local"
    if isinstance(layer, (keras.layers.Normalization, keras.layers.LayerNormalization)):
        axes = layer.axis if isinstance(layer.axis, (list, tuple)) else (layer.axis,)
        if any(axis not in _CHANNEL_AXES for axis in axes):
            return f"it normalizes over axis {layer.axis}; only the channel axis (-1) is local"
    if isinstance(layer, keras.layers.PReLU):
        shared = set(layer.shared_axes or ())
        if not {1, 2, 3} <= shared:
            return ("its slopes are per voxel; give it shared_axes=[1, 2, 3] (one slope per "
                    "channel) to split it")
    if isinstance(layer, keras.layers.EinsumDense):
        equation = layer.equation.replace(" ", "")
        inputs, output = equation.split("->")
        first = inputs.split(",")[0]
        if not (first.startswith("...") and output.startswith("...")):
            return f"its equation {layer.equation!r} may contract spatial axes"
    return None


def _functional(model: keras.Model) -> keras.Model:
    if isinstance(model, keras.Sequential):
        if not model.built or not model.inputs:
            raise ValueError(
                "spatialize needs a Sequential model with a known input shape (start it with "
                f"keras.Input). Received: model={model.name!r}"
            )
        return keras.Model(model.inputs, model.outputs, name=model.name)
    try:
        config = model.get_config()
    except NotImplementedError:
        config = None
    if not isinstance(config, dict) or "layers" not in config:
        raise ValueError(
            "spatialize needs a functional or Sequential Keras model. Received: "
            f"model={model.name!r} of type {type(model).__name__}"
        )
    return model


def _spatial_config(model: keras.Model) -> dict:
    """`model`'s config with every voxel-mixing Keras layer replaced by its twin."""
    config = copy.deepcopy(model.get_config())
    for layer_config, layer in zip(config["layers"], model.layers):
        if isinstance(layer, keras.Model):
            raise SpatialNotSupportedError(
                f"spatialize does not descend into nested models: layer {layer.name!r} is a "
                f"{type(layer).__name__}. Build the model from its layers directly. "
                f"Received: layer={layer.name!r}"
            )
        twin = None
        if type(layer) is keras.layers.InputLayer and len(layer.batch_shape) == 5:
            twin = SpatialInputLayer
        elif type(layer) in SPATIAL_TWINS:
            twin = SPATIAL_TWINS[type(layer)]
        if twin is not None:
            layer_config["module"] = twin.__module__
            layer_config["class_name"] = twin.__name__
            layer_config["registered_name"] = keras.saving.get_registered_name(twin)
            layer_config.pop("build_config", None)
    return config


def _check_sharded_layers(model: keras.Model, spatial_model_global: keras.Model, spatial_shape) -> None:
    """Refuse layers that would compute on a shard alone (before any compute)."""
    rows = plan_for_mesh(spatial_model_global, spatial_shape)  # raises for misaligned layouts
    sharded = {row["name"] for row in rows if row["split"] == "sharded"}
    for layer in model.layers:
        if layer.name not in sharded or isinstance(layer, keras.layers.InputLayer):
            continue
        if type(layer) in SPATIAL_TWINS or type(layer).__module__.startswith("keras_spatial."):
            continue
        if isinstance(layer, VOXELWISE_LAYERS):
            problem = _voxelwise_problem(layer)
        else:
            problem = ("keras_spatial has no split version of it, and it is not known to act "
                       "voxel by voxel")
        if problem is not None:
            raise SpatialNotSupportedError(
                f"Layer {layer.name!r} ({type(layer).__name__}) cannot run on a spatially "
                f"split volume: {problem}. Move it after a gather (Flatten or global pooling) "
                f"or replace it. Received: layer={layer.name!r}, type={type(layer).__name__}, "
                f"spatial_shape={tuple(spatial_shape)}"
            )


def spatialize(model: keras.Model, strategy=None) -> keras.Model:
    """The spatial model of a plain Keras 3D model: same layers, config and weights.

    Conv3D, Conv3DTranspose, Max/AveragePooling3D, UpSampling3D, global pooling, Flatten
    and BatchNormalization become their `keras_spatial.layers` twins; 5D inputs become
    `keras_spatial.Input` of the same global shape; voxel-wise layers (activations,
    Dense, merges, dropout, per-channel normalization) stay as they are; after a gather,
    every layer stays. The model is rebuilt under `strategy` (so its inputs take this
    rank's shards) and gets `model`'s weights. If `model` was compiled, the result is
    compiled the same way (loss, metrics, a fresh copy of the optimizer from its config)
    with the optimizer wrapped in `DistributedOptimizer`. `keras_spatial.to_keras_model`
    of the result gives `model` back.

    Args:
        model: a functional or Sequential Keras model (for instance from
            `keras.models.load_model`), channels last, built with global shapes.
        strategy: the `SpatialStrategy` to build for. Defaults to the active one
            (`keras_spatial.get_strategy()`); with none, the model is built for one
            process.

    Returns:
        A new, uncompiled functional `keras.Model`.

    Raises:
        SpatialNotSupportedError: for a layer that cannot run on a split volume (named,
            with the reason), or a nested model.
        ValueError: for a model that is neither functional nor Sequential, or a layout
            whose extents cannot be split over the strategy's mesh (the layer's message).

    Example:
    ```python
    strategy = keras_spatial.SpatialStrategy(spatial_shape=(2, 1, 1))
    model = keras_spatial.spatialize(keras.models.load_model("unet.keras"), strategy)
    ```
    """
    strategy = strategy if strategy is not None else get_strategy()
    spatial_shape = strategy.spatial_shape if strategy is not None else (1, 1, 1)
    model = _functional(model)
    config = _spatial_config(model)
    # The same model with global shapes first (no strategy): the layout and every layer
    # are checked on it, by arithmetic, before the model for this rank is built.
    from_config = keras.Model.from_config
    global_model = _build_without_strategy(from_config, config)
    _check_sharded_layers(model, global_model, spatial_shape)
    if strategy is None:
        spatial = global_model
    else:
        with strategy.scope():
            spatial = from_config(config)
    spatial.set_weights(model.get_weights())
    _compile_like(spatial, model, strategy)
    return spatial


def _compile_like(spatial: keras.Model, model: keras.Model, strategy) -> None:
    """Compile `spatial` as `model` was compiled (if it was), with its optimizer wrapped
    in `DistributedOptimizer` so that gradients are averaged over the world."""
    config = model.get_compile_config() if model.compiled else None
    if not config:
        return
    arguments = keras.saving.deserialize_keras_object(config)
    optimizer = arguments.get("optimizer")
    if optimizer is not None and not isinstance(optimizer, DistributedOptimizer):
        arguments["optimizer"] = DistributedOptimizer(optimizer)
    spatial.compile(**arguments)


def _build_without_strategy(from_config, config: dict) -> keras.Model:
    with no_strategy():
        return from_config(copy.deepcopy(config))
