"""Layout plan of a spatial model: per-layer shapes, halos and activation memory per rank.

Two entry points:

* `summary(model, strategy)` (also `SpatialStrategy.summary(model)`): the plan of a model
  on the strategy's mesh, for the calling rank. The model may have been built inside the
  strategy's scope (local shapes; the global ones are local extent x shards on split axes)
  or with no spatial strategy (global shapes); in the second case the layout is checked
  here, before any compute, and an incompatible one raises the same ValueError that
  building the model under the strategy would.
* `plan_for_mesh(model_or_builder, spatial_shape, rank=0)`: the same plan for ANY mesh,
  without Horovod: pure arithmetic (`keras_spatial.mesh.Mesh`, `keras_spatial.halo.
  plan_axis`) on the global shapes of a model built with no spatial strategy, so a 4-way
  split can be planned on a laptop (`tools/plan_layout.py` is its command line).

Each row (a dict) describes one layer:

* `name`, `type`: the layer's name and class name.
* `split`: "sharded" (each rank holds a sub-volume) or "replicated" (every rank of the
  spatial group holds the whole tensor: after `SpatialFlatten` or global pooling).
* `global_shape`, `local_shape`: output shape without the batch axis, of the whole sample
  and of this rank's part.
* `halo`: for sliding-window layers (conv, pooling, non-blockwise transposed conv, and
  up-sampling where uneven shards make its output split differ from its input's), per axis
  (depth, height, width) the pair (before, after) of planes this rank's shard receives from
  its neighbours (positive) or crops off its own slab (negative); zero padding at the
  global border is not counted here but in `padding` (the sum of both is
  `keras_spatial.halo.AxisPlan.halo`). None for layers without windows.
* `padding`: per axis (before, after) planes of padding value at the global border, or None.
* `bytes`: activation memory of the layer's local output: elements x batch_size x
  bytes_per_element (4, float32). The total over rows (printed) estimates forward
  activation memory per rank; halo buffers, gradients and optimizer state are not counted.

Raises (both entry points):
    ValueError: for a layout that cannot be split (an extent smaller than its number of
        shards: the message names the layer, axis, extents and mesh), for a rank outside
        the world, for a volume flattened or pooled by a plain Keras layer while sharded.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

import keras

from keras_spatial.mesh import Mesh
from keras_spatial.layers.core import SpatialInputLayer
from keras_spatial.layers.global_pooling import (
    SpatialGlobalAveragePooling3D,
    SpatialGlobalMaxPooling3D,
)
from keras_spatial.layers.convolutional_transpose import SpatialConv3DTranspose
from keras_spatial.layers.gather import SpatialGather
from keras_spatial.layers.global_extents import symbolic_global_extents
from keras_spatial.layers.reshaping import SpatialFlatten
from keras_spatial.layers.spatial_window import SpatialWindowMixin
from keras_spatial.layers.upsampling import SpatialUpSampling3D

GATHERING_LAYERS = (SpatialFlatten, SpatialGather, SpatialGlobalAveragePooling3D, SpatialGlobalMaxPooling3D)
# Keras layers that mix voxels (or normalize over them): wrong on a shard unless spatial.
_VOXEL_MIXING_KERAS_LAYERS = (
    keras.layers.Conv3D,
    keras.layers.Conv3DTranspose,
    keras.layers.MaxPooling3D,
    keras.layers.AveragePooling3D,
    keras.layers.UpSampling3D,
    keras.layers.Flatten,
    keras.layers.Reshape,
    keras.layers.GlobalAveragePooling3D,
    keras.layers.GlobalMaxPooling3D,
    keras.layers.BatchNormalization,
)


def _tensors(value: Any) -> list:
    return list(keras.tree.flatten(value))


def _layer_inputs(layer) -> list:
    if isinstance(layer, keras.layers.InputLayer):
        return []
    try:
        return _tensors(layer.input)
    except (AttributeError, ValueError):  # a layer called more than once
        return [t for node in layer._inbound_nodes for t in _tensors(node.input_tensors)]


def _layer_outputs(layer) -> list:
    try:
        return _tensors(layer.output)
    except (AttributeError, ValueError):
        return [t for node in layer._inbound_nodes for t in _tensors(node.output_tensors)]


def _is_spatial_class(layer) -> bool:
    return type(layer).__module__.startswith("keras_spatial.")


def _check_global_model(model: keras.Model) -> None:
    for layer in model.layers:
        if isinstance(layer, SpatialInputLayer):
            local = tuple(layer.output.shape)
            if local[1:] != tuple(layer.global_batch_shape[1:]):
                raise ValueError(
                    "plan_for_mesh needs the model built with no spatial strategy (global "
                    f"shapes), but input {layer.name!r} declares the local shape {local[1:]} "
                    f"of the global {tuple(layer.global_batch_shape[1:])}. Build it outside "
                    "any `SpatialStrategy.scope()` in a plain `python` process, or pass a "
                    f"builder function. Received: model={model.name!r}"
                )


def _global_shapes(model: keras.Model, spatial_shape: Sequence[int], is_local: bool) -> tuple[dict, set]:
    """Global output shape (no batch) of every tensor id, and the ids of sharded tensors."""
    shapes: dict[int, tuple] = {}
    sharded: set[int] = set()
    for layer in model.layers:
        inputs = _layer_inputs(layer)
        outputs = _layer_outputs(layer)
        if isinstance(layer, keras.layers.InputLayer):
            is_sharded = len(outputs[0].shape) == 5
        elif isinstance(layer, GATHERING_LAYERS):
            is_sharded = False
        else:
            is_sharded = any(id(t) in sharded for t in inputs)
            if not is_sharded and inputs and isinstance(layer, SpatialWindowMixin):
                raise ValueError(
                    f"Layer {layer.name!r} ({type(layer).__name__}) follows a gather: its input "
                    "is the whole volume on every rank, which it would treat as one shard. "
                    "Use the plain keras.layers counterpart after SpatialGather. Received: "
                    f"layer={layer.name!r}, type={type(layer).__name__}"
                )
            if is_sharded and isinstance(layer, _VOXEL_MIXING_KERAS_LAYERS) and not _is_spatial_class(layer):
                raise ValueError(
                    f"Layer {layer.name!r} is a plain keras.layers.{type(layer).__name__} on a "
                    "spatially sharded volume: it would compute on each shard alone. Use its "
                    "keras_spatial.layers counterpart. Received: "
                    f"layer={layer.name!r}, type={type(layer).__name__}"
                )
        for tensor in outputs:
            shape = tuple(tensor.shape[1:])
            if is_sharded:
                if len(shape) != 4:
                    raise ValueError(
                        f"Layer {layer.name!r} outputs a {len(shape) + 1}D tensor from a "
                        "sharded volume; only 5D (batch, depth, height, width, channels) "
                        "volumes can stay sharded. Gather first with SpatialFlatten or "
                        f"global pooling. Received: layer={layer.name!r}, shape={shape}"
                    )
                if is_local:
                    extents = symbolic_global_extents(tensor)
                    if extents is None:  # not traceable to a keras_spatial.Input: equal shards
                        extents = tuple(n * s for n, s in zip(shape[:3], spatial_shape))
                    shape = tuple(extents) + shape[3:]
                sharded.add(id(tensor))
            shapes[id(tensor)] = shape
    return shapes, sharded


def _rows(model, shapes, sharded, mesh: Mesh, rank: int, batch_size: int, bytes_per_element: int) -> list[dict]:
    coords = mesh.coords(rank)
    rows = []
    for layer in model.layers:
        inputs, outputs = _layer_inputs(layer), _layer_outputs(layer)
        halo = padding = None
        planned = isinstance(layer, (SpatialWindowMixin, SpatialUpSampling3D))
        if planned and inputs and id(inputs[0]) in sharded:
            global_in = shapes[id(inputs[0])]
            local_in = (None,) + mesh.local_extents(global_in[:3], coords) + global_in[3:]
            # raises the layer's own ValueError
            plans = layer.axis_plans(mesh.spatial_shape, local_in, global_extents=global_in[:3])
            if isinstance(layer, SpatialConv3DTranspose) and layer.blockwise(plans):
                plans = ()  # no window reaches a neighbour
            elif isinstance(layer, SpatialUpSampling3D) and all(p.needed == p.owned for p in plans):
                plans = ()
        else:
            plans = ()
        if plans:
            halo, padding = [], []
            for plan, shard in zip(plans, coords):
                (i0, i1), (n0, n1) = plan.owned[shard], plan.needed[shard]
                halo.append((i0 - max(n0, 0), min(n1, plan.global_extent) - i1))
                padding.append((plan.padding_before(shard), plan.padding_after(shard)))
            halo, padding = tuple(halo), tuple(padding)
        for tensor in outputs:
            global_shape = shapes[id(tensor)]
            if id(tensor) in sharded:
                try:
                    local_shape = mesh.local_extents(global_shape[:3], coords) + global_shape[3:]
                except ValueError as error:
                    raise ValueError(
                        f"Layer {layer.name!r} cannot split its output over the shards: {error}"
                    ) from None
            else:
                local_shape = global_shape
            elements = math.prod(d for d in local_shape if d is not None)
            rows.append(
                {
                    "name": layer.name,
                    "type": type(layer).__name__,
                    "split": "sharded" if id(tensor) in sharded else "replicated",
                    "global_shape": global_shape,
                    "local_shape": local_shape,
                    "halo": halo,
                    "padding": padding,
                    "bytes": elements * batch_size * bytes_per_element,
                }
            )
    return rows


def _format_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.2f} {unit}"
        count /= 1024
    return ""  # unreachable


def _shape_text(shape: tuple) -> str:
    return "x".join(str(d) for d in shape)


def format_plan(rows: list[dict], mesh: Mesh, rank: int, batch_size: int = 1) -> str:
    """The plan as a text table with a header line and the total memory."""
    header = (
        f"Layout plan: spatial_shape={mesh.spatial_shape}, world_size={mesh.world_size}, "
        f"rank={rank}, coords={mesh.coords(rank)}, batch_size={batch_size}\n"
        "halo d/h/w = planes received from neighbours (+) or cropped (-), before/after; "
        "global zero padding not counted"
    )
    columns = ("layer", "type", "split", "global output", "local output", "halo d", "halo h", "halo w", "memory")
    table = []
    for row in rows:
        halos = ["-"] * 3 if row["halo"] is None else [f"{b}/{a}" for b, a in row["halo"]]
        table.append(
            (row["name"], row["type"], row["split"], _shape_text(row["global_shape"]),
             _shape_text(row["local_shape"]), *halos, _format_bytes(row["bytes"]))
        )
    widths = [max(len(c), *(len(r[i]) for r in table)) if table else len(c) for i, c in enumerate(columns)]
    lines = [header, "  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines.append("-" * len(lines[-1]))
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in table]
    total = sum(row["bytes"] for row in rows)
    lines.append(f"Total activation memory per rank (forward outputs): {_format_bytes(total)} ({total} bytes)")
    return "\n".join(lines)


def plan_for_mesh(
    model_or_builder: Any,
    spatial_shape: Sequence[int],
    rank: int = 0,
    *,
    world_size: Optional[int] = None,
    batch_size: int = 1,
    bytes_per_element: int = 4,
    print_fn: Optional[Callable[[str], Any]] = None,
) -> list[dict]:
    """The layout plan of a model on any mesh, without Horovod.

    Args:
        model_or_builder: a functional model built with NO spatial strategy (global
            shapes), or a function of no arguments returning one.
        spatial_shape: shards along (depth, height, width), e.g. (4, 1, 1).
        rank: the rank whose shard is described. Defaults to 0.
        world_size: ranks in the world. Defaults to the spatial size (one data group).
        batch_size: samples per rank, for the memory column. Defaults to 1.
        bytes_per_element: 4 for float32. Defaults to 4.
        print_fn: if given, called with the formatted table. Defaults to None.

    Returns:
        One dict per layer output (see the module docstring).

    Raises:
        ValueError: for an incompatible layout (the message of the layer that would fail
            at build time), a rank outside the world, or a model built under a spatial
            strategy.

    Example:
    >>> from recipes.cosmoflow.model import build_model
    >>> rows = plan_for_mesh(lambda: build_model(64), (2, 1, 1), rank=1)
    >>> rows[1]["local_shape"], rows[1]["halo"]
    ((32, 64, 64, 16), ((1, 0), (0, 0), (0, 0)))
    """
    mesh = Mesh(world_size=world_size or math.prod(int(s) for s in spatial_shape), spatial_shape=tuple(spatial_shape))
    mesh.coords(rank)  # validates the rank
    model = model_or_builder if isinstance(model_or_builder, keras.Model) else model_or_builder()
    if not isinstance(model, keras.Model):
        raise ValueError(f"Expected a keras.Model or a function returning one. Received: {model!r}")
    _check_global_model(model)
    shapes, sharded = _global_shapes(model, mesh.spatial_shape, is_local=False)
    rows = _rows(model, shapes, sharded, mesh, rank, batch_size, bytes_per_element)
    if print_fn is not None:
        print_fn(format_plan(rows, mesh, rank, batch_size))
    return rows


def _is_local_model(model: keras.Model, strategy) -> bool:
    """Whether `model` was built under a spatial strategy (its inputs are shards)."""
    for layer in model.layers:
        if isinstance(layer, SpatialInputLayer):
            local = tuple(layer.output.shape[1:])
            global_shape = tuple(layer.global_batch_shape[1:])
            if local == global_shape:
                return False
            expected = tuple(strategy.local_shape((None,) + global_shape)[1:])
            if local != expected:
                raise ValueError(
                    f"Input {layer.name!r} holds shards of shape {local}, which is not the "
                    f"shard {expected} of the strategy's mesh: the model was built under "
                    "another strategy. Received: "
                    f"spatial_shape={tuple(strategy.spatial_shape)}, global_shape={global_shape}"
                )
            return True
    return bool(strategy.is_spatial)


def summary(model: keras.Model, strategy, print_fn: Callable[[str], Any] = print, *, batch_size: int = 1) -> list[dict]:
    """Print the layout plan of `model` on `strategy`'s mesh for this rank; return the rows.

    Args:
        model: a functional model, built inside `strategy.scope()` (local shapes) or
            with no spatial strategy (global shapes; then this checks the layout
            before anything is computed).
        strategy: a `SpatialStrategy` (or any object with `mesh`, `rank`,
            `spatial_shape`, `is_spatial` and `local_shape`).
        print_fn: called with the formatted table. Defaults to `print`.
        batch_size: samples per rank, for the memory column. Defaults to 1.

    Returns:
        One dict per layer output (see the module docstring).

    Raises:
        ValueError: for a layout the mesh cannot serve, or a model built for another mesh.
    """
    mesh, rank = strategy.mesh, strategy.rank
    shapes, sharded = _global_shapes(model, mesh.spatial_shape, is_local=_is_local_model(model, strategy))
    rows = _rows(model, shapes, sharded, mesh, rank, batch_size, 4)
    if print_fn is not None:
        print_fn(format_plan(rows, mesh, rank, batch_size))
    return rows


def replicated_layers(model: keras.Model, strategy) -> list:
    """The layers of `model` that compute on replicated (whole, gathered) tensors only.

    On every rank of a spatial group such a layer sees the same inputs and, when it is
    deterministic, computes the same outputs and the same weight gradients (e.g. the
    dense head after a `SpatialFlatten` or `SpatialGather`). `DistributedOptimizer`
    averages those gradients over data groups only (no communication at all when there
    is one data group), instead of over the whole world.

    Args:
        model: a functional model built inside `strategy.scope()`.
        strategy: its `SpatialStrategy`.

    Returns:
        The layers, in model order (input layers and gathering layers excluded).
    """
    shapes, sharded = _global_shapes(
        model, strategy.spatial_shape, is_local=_is_local_model(model, strategy)
    )
    del shapes
    layers = []
    for layer in model.layers:
        if isinstance(layer, keras.layers.InputLayer) or isinstance(layer, GATHERING_LAYERS):
            continue
        inputs = _layer_inputs(layer)
        if inputs and not any(id(t) in sharded for t in inputs):
            layers.append(layer)
    return layers


__all__ = ["format_plan", "plan_for_mesh", "replicated_layers", "summary"]
