"""Turn a spatial model into the plain Keras model of the whole volume."""

from __future__ import annotations

import copy

import keras


def keras_parent(layer_class: type) -> type:
    """The first Keras class in `layer_class`'s MRO (the layer it replaces)."""
    for cls in layer_class.__mro__:
        if cls.__module__.startswith("keras.") or cls.__module__ == "keras":
            return cls
    raise TypeError(f"{layer_class.__name__} is not a Keras layer. Received: {layer_class!r}")


def to_keras_model(model: keras.Model) -> keras.Model:
    """A plain Keras model of the GLOBAL volume with `model`'s layers and weights.

    Each keras_spatial layer becomes the Keras layer it subclasses (same config, same
    weights), and `keras_spatial.Input` becomes a `keras.InputLayer` of the global shape
    (its config already holds it). The result is built from the model's config, is not
    compiled, runs in one process on whole volumes whatever strategy is active, and does
    no communication: it is the reference the spatial model must agree with, and a way
    to export a model.

    Args:
        model: a functional model built from keras_spatial layers (and Keras layers).

    Returns:
        A new, uncompiled functional `keras.Model`.

    Raises:
        ValueError: if `model` is not a functional model.
    """
    try:
        config = copy.deepcopy(model.get_config())
    except NotImplementedError:
        raise ValueError(
            "to_keras_model needs a functional model (keras.Model(inputs, outputs)). "
            f"Received: model={model.name!r} of type {type(model).__name__}"
        ) from None
    if "layers" not in config:
        raise ValueError(
            "to_keras_model needs a functional model (keras.Model(inputs, outputs)). "
            f"Received: model={model.name!r} of type {type(model).__name__}"
        )
    for layer_config, layer in zip(config["layers"], model.layers):
        parent = keras_parent(type(layer))
        if parent is not type(layer):
            layer_config["module"] = "keras.layers"
            layer_config["class_name"] = parent.__name__
            layer_config["registered_name"] = None
        layer_config.pop("build_config", None)  # local shapes; rebuilt from the inputs
    plain = keras.Model.from_config(config)
    plain.set_weights(model.get_weights())
    return plain
