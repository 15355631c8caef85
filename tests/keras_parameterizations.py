"""Keras's own unit-test parameterizations of its 3D layers, read from the installed Keras.

Each Keras test file decorates its 3D tests with `parameterized.parameters(...)` or
`parameterized.named_parameters(...)`; the arguments are literals (dicts, or tuples in
the order of the test's arguments). They are read here with `ast`, without importing
Keras's test modules, and reduced to the layer's constructor arguments (channels_last
only: keras_spatial refuses channels_first). Nothing imports TensorFlow.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import itertools
import os
from typing import Any

# (layer class name, test file under keras/src/layers, pattern in the test's name)
SOURCES = (
    ("Conv3D", "convolutional/conv_test.py", "conv3d"),
    ("Conv3DTranspose", "convolutional/conv_transpose_test.py", "conv3d_transpose"),
    ("MaxPooling3D", "pooling/max_pooling_test.py", "max_pooling3d"),
    ("AveragePooling3D", "pooling/average_pooling_test.py", "average_pooling3d"),
    ("GlobalAveragePooling3D", "pooling/global_average_pooling_test.py", "global_average_pooling3d"),
    ("GlobalMaxPooling3D", "pooling/global_max_pooling_test.py", "global_max_pooling3d"),
    ("UpSampling3D", "reshaping/up_sampling3d_test.py", "test_upsampling_3d"),
    ("BatchNormalization", "normalization/batch_normalization_test.py", "test_correctness"),
)


def _upsampling(kwargs: dict) -> dict:
    names = ("length_dim1", "length_dim2", "length_dim3")
    if all(n in kwargs for n in names):
        kwargs = dict(kwargs, size=tuple(kwargs[n] for n in names))
    return kwargs


def _batch_norm(kwargs: dict) -> dict:
    # Its correctness test runs on 3D and 4D inputs; on 5D volumes the channel axis is
    # the one a split volume can normalize over (axis=1 would normalize per depth
    # plane: keras_spatial refuses it).
    return kwargs if kwargs.get("axis") == -1 else {}


# Test arguments that map onto constructor arguments (an empty result drops the case).
ADAPTERS = {"UpSampling3D": _upsampling, "BatchNormalization": _batch_norm}


@dataclasses.dataclass(frozen=True)
class KerasCase:
    """One parameterization: the Keras layer's class name and constructor kwargs."""

    layer: str
    kwargs: tuple  # sorted (name, value) pairs
    source: str  # "file:test_name[index]"

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.kwargs)

    @property
    def name(self) -> str:
        text = "-".join(f"{k}={v}" for k, v in self.kwargs if k != "data_format")
        return f"{self.layer}({text})".replace(" ", "")


def keras_layers_dir() -> str:
    spec = importlib.util.find_spec("keras")
    return os.path.join(os.path.dirname(spec.origin), "src", "layers")


def _decorator_cases(function: ast.FunctionDef):
    for decorator in function.decorator_list:
        if not isinstance(decorator, ast.Call):
            continue
        name = ast.unparse(decorator.func)
        if name == "parameterized.product":
            try:
                axes = {k.arg: ast.literal_eval(k.value) for k in decorator.keywords}
            except ValueError:
                continue
            for values in itertools.product(*axes.values()):
                yield False, dict(zip(axes, values))
            continue
        if name not in ("parameterized.parameters", "parameterized.named_parameters"):
            continue
        named = name.endswith("named_parameters")
        for node in decorator.args:
            try:
                value = ast.literal_eval(node)
            except ValueError:
                continue  # a computed parameterization: not a literal case
            yield named, value


def _as_kwargs(value, argument_names, named) -> dict:
    if isinstance(value, dict):
        return {k: v for k, v in value.items() if k != "testcase_name"}
    values = list(value)
    if named:
        values = values[1:]  # (testcase_name, ...)
    return dict(zip(argument_names, values))


def read_cases(layer_signatures: dict) -> list[KerasCase]:
    """Every literal 3D parameterization of the files in `SOURCES`.

    Args:
        layer_signatures: layer class name -> the set of its constructor's argument
            names (test arguments that are not among them, e.g. input shapes, are
            dropped).
    """
    root = keras_layers_dir()
    cases, seen = [], set()
    for layer, path, pattern in SOURCES:
        tree = ast.parse(open(os.path.join(root, path)).read())
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef) or pattern not in function.name:
                continue
            argument_names = [a.arg for a in function.args.args if a.arg != "self"]
            for index, (named, value) in enumerate(_decorator_cases(function)):
                kwargs = ADAPTERS.get(layer, dict)(_as_kwargs(value, argument_names, named))
                if not kwargs or kwargs.get("data_format", "channels_last") != "channels_last":
                    continue
                kwargs = {k: _hashable(v) for k, v in kwargs.items() if k in layer_signatures[layer]}
                key = (layer, tuple(sorted(kwargs.items())))
                if key in seen:
                    continue
                seen.add(key)
                cases.append(KerasCase(layer, key[1], f"{path}:{function.name}[{index}]"))
    return cases


def _hashable(value):
    return tuple(value) if isinstance(value, list) else value


def signatures(keras_module) -> dict:
    """Constructor argument names of the layers in `SOURCES`, from `keras_module`."""
    return {
        layer: set(inspect.signature(getattr(keras_module.layers, layer).__init__).parameters)
        for layer, _, _ in SOURCES
    }
