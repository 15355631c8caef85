"""Performance model of a spatial model's training step on any layout. Pure arithmetic.

For a model built with no spatial strategy (global shapes) and a layout (a mesh of
`world_size` ranks: data groups x `spatial_shape` shards), `model_costs` lists per layer
what one rank does in one training step: forward and backward FLOPs, bytes moved in
memory, halo planes exchanged with its neighbours, collectives, parameters and activation
memory. `predict_step` turns those counts into a predicted step time and memory per
rank on a `Hardware` description; `auto_layout` picks the fastest layout that fits in
memory. Nothing here runs TensorFlow or Horovod: shapes come from
`keras_spatial.plan.plan_for_mesh` and the halo plans of the layers (`axis_plans`).

Where an extent does not divide by its shards (`keras_spatial.halo.split_bounds`), the
counts are rank 0's: it holds the largest shard on every axis, so it sets the step time.
A transposed convolution whose uneven output split needs a halo is counted without it.

What the counts follow (docs/design.md):

* **Compute.** Per local output voxel, a convolution costs 2 k_d k_h k_w Cin/groups Cout
  FLOPs forward (plus Cout for a bias); its backward pass costs the same for the weight
  gradient and again for the input gradient, which is skipped when nothing before the
  layer is trainable (TensorFlow does not differentiate with respect to the data). A
  transposed convolution costs 2 k^3 Cin Cout per INPUT voxel, a Dense layer 2 in x out
  per sample, a pooling layer one FLOP per window tap per output, element-wise layers
  the constants of `ELEMENTWISE_FLOPS` per element. Layers after a gather (`split` ==
  "replicated") run whole on every rank of the spatial group.
* **Memory traffic.** Forward: inputs read (the extended shard for sliding windows),
  outputs written, weights read. Backward: upstream gradient and saved input read,
  input gradient written (when needed), weights read and their gradient written.
* **Halo exchange.** Axes are exchanged one after another (depth, height, width), each
  carrying the planes of the axes already exchanged (so the face of a later axis
  includes the earlier axes' halos and padding). Each exchanging axis is one `alltoall`
  in the spatial group; a message goes to each neighbour that needs planes; its bytes
  are planes x face x channels x 4 x batch. Pooling that takes the in-place path
  (`keras_spatial.ops.halo_pooling.in_place_layout`) sends planes already pooled over
  the other axes. The backward pass sends the same bytes the other way.
* **Collectives of layers.** `SpatialFlatten` / `SpatialGather`: an allgather of the
  volume in the spatial group, backward an allreduce of it. Global average pooling: an
  allreduce of the channel means; global max: an allgather of the local maxima.
  `SpatialBatchNormalization`: one allgather of (2C + 1) floats per rank over the world
  (`synchronized=True`) or the spatial group, backward one allreduce of 2C floats.
* **Gradients** (docs/design.md, "Gradient rule"): the gradients of every variable are
  averaged over the world in one fused allreduce, except those of replicated layers
  (after the gather), which are identical inside a spatial group and are averaged over
  the position group only (not at all with one data group). Every rank then applies
  the optimizer to all parameters.

What is not modelled: input pipeline and I/O, kernel launch and framework overheads
beyond `Hardware.op_overhead`, network contention between jobs, the overlap of
communication with compute (the code does not overlap; `predict_step` can assume halo
overlap to bound what overlap would give), mixed precision, recomputation.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Optional, Sequence

import keras

from keras_spatial.hardware_profiles import PROFILES
from keras_spatial.layers.gather import SpatialGather
from keras_spatial.layers.global_pooling import SpatialGlobalAveragePooling3D, SpatialGlobalMaxPooling3D
from keras_spatial.layers.normalization import SpatialBatchNormalization
from keras_spatial.layers.reshaping import SpatialFlatten
from keras_spatial.layers.spatial_window import SpatialWindowMixin
from keras_spatial.mesh import Mesh
from keras_spatial.ops.halo_pooling import in_place_layout
from keras_spatial.plan import plan_for_mesh

BYTES_PER_ELEMENT = 4  # float32
# (forward, backward) FLOPs per output element of element-wise layers, by class name.
ELEMENTWISE_FLOPS = {
    "ReLU": (1, 1),
    "LeakyReLU": (2, 2),
    "Dropout": (2, 1),
    "Softmax": (4, 4),
    "BatchNormalization": (7, 10),  # mean 1, squared deviations 3, normalize + affine 3
    "SpatialBatchNormalization": (7, 10),
    "Normalization": (2, 2),
    "Rescaling": (1, 1),
    "Add": (1, 0),
    "Activation": (1, 1),
}
# Layers that only move data: no FLOPs, only bytes.
DATA_MOVEMENT_LAYERS = ("Flatten", "SpatialFlatten", "SpatialGather", "Reshape", "Concatenate",
                        "Identity", "UpSampling3D", "SpatialUpSampling3D", "InputLayer",
                        "SpatialInputLayer")
# FLOPs per element of a layer's fused `activation` argument.
ACTIVATION_FLOPS = {"linear": 0, "relu": 1, "leaky_relu": 2, "sigmoid": 4, "tanh": 4, "softmax": 4}
# Adam: per parameter ~12 FLOPs; reads parameter, gradient and two moments, writes three.
ADAM_FLOPS_PER_PARAMETER = 12
ADAM_SLOTS = 2


# ----------------------------------------------------------------------------- hardware


def _check_kernel_times(value) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise ValueError(f"`kernel_times` must be a dict of kernel keys to seconds. Received: {value!r}")
    for key, seconds in value.items():
        if (not isinstance(key, str) or isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                or not math.isfinite(seconds) or seconds <= 0):
            raise ValueError(
                "`kernel_times` must map kernel keys (strings) to positive seconds. "
                f"Received: {key!r}: {seconds!r}"
            )


@dataclasses.dataclass(frozen=True)
class Hardware:
    """A machine for `predict_step`: one rank per accelerator.

    Args:
        name: label of the description.
        peak_flops: peak float32 FLOP/s of one accelerator.
        flop_efficiency: fraction of `peak_flops` that convolutions and dense layers
            reach, in (0, 1].
        memory_bandwidth: device memory bandwidth, bytes/s.
        memory_efficiency: fraction of `memory_bandwidth` reached, in (0, 1].
        memory_capacity: device memory, bytes.
        intra_node_latency: latency of one message between two ranks of a node, s.
        intra_node_bandwidth: bandwidth between two ranks of a node, bytes/s per direction.
        inter_node_latency: latency of one message between nodes, s.
        inter_node_bandwidth: injection bandwidth of one NODE into the network, bytes/s
            per direction; the ranks of a node share it (`rank_network_bandwidth`).
        ranks_per_node: accelerators (ranks) per node; ranks are placed node by node.
        op_overhead: fixed time per layer and pass (kernel launches, framework), s.
            Defaults to 0.
        co_running_slowdown: factor on every rank's compute time when more than one
            rank runs on a node: what ranks sharing a node's memory system and caches
            cost each other (CPU cores; measured by running one independent copy of a
            one-rank step per core at once, `benchmarks/validate_cost_model.py`).
            Defaults to 1 (an accelerator per rank).
        kernel_times: measured seconds of the forward plus backward pass of single
            convolutions, keyed by `LayerCost.kernel` (the layer's class, per-rank input
            shape, filters, kernel, strides, padding, bias and whether the input
            gradient is computed): where a layer's key is listed, its compute time is
            the measured one instead of the roofline's (convolution throughput depends on
            the shape; `benchmarks/validate_cost_model.py` measures the table of the
            layouts it validates). Defaults to None (roofline for every layer).

    Raises:
        ValueError: for a missing, non-numeric, NaN, infinite or non-positive value, an
            efficiency above 1, a non-integer `ranks_per_node`, or `kernel_times` that is
            not a mapping of strings to positive seconds.
    """

    name: str
    peak_flops: float
    flop_efficiency: float
    memory_bandwidth: float
    memory_efficiency: float
    memory_capacity: float
    intra_node_latency: float
    intra_node_bandwidth: float
    inter_node_latency: float
    inter_node_bandwidth: float
    ranks_per_node: int
    op_overhead: float = 0.0
    co_running_slowdown: float = 1.0
    kernel_times: Optional[dict] = None

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "kernel_times":
                _check_kernel_times(value)
                continue
            if field.name == "name":
                if not isinstance(value, str) or not value:
                    raise ValueError(f"`name` must be a non-empty string. Received: name={value!r}")
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(
                    f"`{field.name}` must be a finite number. Received: {field.name}={value!r}"
                )
            if value < 0 or (value == 0 and field.name != "op_overhead"):
                raise ValueError(f"`{field.name}` must be positive. Received: {field.name}={value!r}")
        for field in ("flop_efficiency", "memory_efficiency"):
            if getattr(self, field) > 1:
                raise ValueError(
                    f"`{field}` is a fraction of the peak, at most 1. "
                    f"Received: {field}={getattr(self, field)!r}"
                )
        if int(self.ranks_per_node) != self.ranks_per_node:
            raise ValueError(
                f"`ranks_per_node` must be an integer. Received: ranks_per_node={self.ranks_per_node!r}"
            )

    @classmethod
    def from_dict(cls, description: dict) -> "Hardware":
        """A `Hardware` from a dict (e.g. read from JSON).

        Raises:
            ValueError: naming the missing or unknown keys, or a bad value.
        """
        if not isinstance(description, dict):
            raise ValueError(f"Expected a dict describing the hardware. Received: {description!r}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        required = [n for n, f in fields.items() if f.default is dataclasses.MISSING]
        missing = [n for n in required if n not in description]
        unknown = sorted(set(description) - set(fields))
        if missing or unknown:
            raise ValueError(
                f"Hardware description: missing fields {missing}, unknown fields {unknown}. "
                f"Received: keys={sorted(description)}"
            )
        return cls(**description)

    @property
    def effective_flops(self) -> float:
        """Achieved FLOP/s: peak x efficiency."""
        return self.peak_flops * self.flop_efficiency

    @property
    def effective_memory_bandwidth(self) -> float:
        """Achieved memory bandwidth, bytes/s."""
        return self.memory_bandwidth * self.memory_efficiency

    def compute_factor(self, world_size: int) -> float:
        """`co_running_slowdown` when a node holds more than one of the world's ranks, else 1."""
        return self.co_running_slowdown if min(world_size, self.ranks_per_node) > 1 else 1.0

    @property
    def rank_network_bandwidth(self) -> float:
        """One rank's share of its node's network bandwidth (all ranks sending at once)."""
        return self.inter_node_bandwidth / self.ranks_per_node

    def link(self, inter_node: bool) -> tuple[float, float]:
        """(latency, bandwidth per rank) of an intra- or inter-node link."""
        if inter_node:
            return self.inter_node_latency, self.rank_network_bandwidth
        return self.intra_node_latency, self.intra_node_bandwidth


# ----------------------------------------------------------------------------- costs


@dataclasses.dataclass(frozen=True)
class AxisExchange:
    """The halo exchange of one layer along one axis, for one rank of a spatial group.

    Attributes:
        axis: 0, 1, 2 for depth, height, width.
        received: ((peer spatial index, bytes), ...) of the planes this rank receives.
        sent: ((peer spatial index, bytes), ...) of the planes it sends.
    """

    axis: int
    received: tuple[tuple[int, int], ...]
    sent: tuple[tuple[int, int], ...]

    @property
    def bytes_received(self) -> int:
        return sum(b for _, b in self.received)

    @property
    def messages(self) -> int:
        """Messages received (the backward pass sends as many back)."""
        return len(self.received)


@dataclasses.dataclass(frozen=True)
class Collective:
    """A collective of a layer or of the gradient average, for `collective_time`.

    Attributes:
        kind: "allreduce" or "allgather".
        group: "spatial", "world" or "position" (the ranks holding the same spatial
            position in every data group).
        bytes: allreduce: bytes of the reduced buffer; allgather: bytes of the gathered
            result (all contributions together).
        label: what it is for.
    """

    kind: str
    group: str
    bytes: int
    label: str


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """One layer's work on one rank in one training step (per-rank batch included).

    Attributes:
        name, type: the layer's name and class name.
        split: "sharded" or "replicated" (runs whole on every rank of a spatial group).
        local_shape: local output shape without the batch axis.
        forward_flops, backward_flops: FLOPs of the forward and backward pass.
        forward_bytes, backward_bytes: device memory traffic of each pass.
        parameters: trainable parameters of the layer.
        replicated_parameters: whether their gradients are identical inside a spatial
            group (a replicated layer with a split volume), hence averaged over the
            position group only.
        activation_bytes: bytes of the local output (kept for the backward pass).
        input_gradient: whether the backward pass computes the gradient of the input
            (False when nothing before the layer is trainable); the backward halo
            exchange and the backward collectives run only then.
        exchanges: per spatial index of the group, the `AxisExchange`s of the forward
            pass (empty for layers without halos).
        forward_collectives, backward_collectives: `Collective`s of each pass.
        kernel: for a convolution or transposed convolution, the key of its kernel in
            `Hardware.kernel_times` (`kernel_key`); "" for other layers.
    """

    name: str
    type: str
    split: str
    local_shape: tuple
    forward_flops: int
    backward_flops: int
    forward_bytes: int
    backward_bytes: int
    parameters: int
    replicated_parameters: bool
    activation_bytes: int
    input_gradient: bool = True
    exchanges: tuple[tuple[AxisExchange, ...], ...] = ()
    forward_collectives: tuple[Collective, ...] = ()
    backward_collectives: tuple[Collective, ...] = ()
    kernel: str = ""

    def halo_bytes(self, spatial_index: int = 0) -> int:
        """Bytes the rank at `spatial_index` receives in the forward exchange."""
        if not self.exchanges:
            return 0
        return sum(e.bytes_received for e in self.exchanges[spatial_index])

    def halo_messages(self, spatial_index: int = 0) -> int:
        """Messages the rank at `spatial_index` receives in the forward exchange."""
        if not self.exchanges:
            return 0
        return sum(e.messages for e in self.exchanges[spatial_index])


def _tensors(value) -> list:
    return list(keras.tree.flatten(value))


def _layer_inputs(layer) -> list:
    if isinstance(layer, keras.layers.InputLayer):
        return []
    return _tensors(layer.input)


def _elements(shape) -> int:
    return math.prod(int(d) for d in shape)


def _local(shape: tuple, sharded: bool, spatial_shape) -> tuple:
    if not sharded or len(shape) != 4:
        return tuple(shape)
    return tuple(n // s for n, s in zip(shape[:3], spatial_shape)) + tuple(shape[3:])


def _activation_flops(layer) -> int:
    activation = getattr(layer, "activation", None)
    name = getattr(activation, "__name__", "linear") if activation is not None else "linear"
    return ACTIVATION_FLOPS.get(name, 4)


def _kernel_volume(layer) -> int:
    return math.prod(int(k) for k in layer.kernel_size)


def _compute_flops(layer, in_shapes, out_shape, needs_input_grad: bool) -> tuple[int, int]:
    """(forward, backward) FLOPs of one sample, local shapes."""
    out = _elements(out_shape)
    cls = type(layer).__name__
    if isinstance(layer, keras.layers.Conv3DTranspose):
        core = 2 * _kernel_volume(layer) * in_shapes[0][-1] * int(layer.filters) * _elements(in_shapes[0][:-1])
    elif isinstance(layer, keras.layers.Conv3D):
        cin = in_shapes[0][-1] // int(getattr(layer, "groups", 1) or 1)
        core = 2 * _kernel_volume(layer) * cin * out
    elif isinstance(layer, keras.layers.Dense):
        core = 2 * in_shapes[0][-1] * out
    else:
        core = None
    if core is not None:
        extra = out * ((1 if getattr(layer, "use_bias", False) else 0) + _activation_flops(layer))
        return core + extra, core * (2 if needs_input_grad else 1) + extra
    if isinstance(layer, (keras.layers.MaxPooling3D, keras.layers.AveragePooling3D)):
        taps = math.prod(int(k) for k in layer.pool_size)
        return out * taps, out * taps
    if isinstance(layer, (keras.layers.GlobalAveragePooling3D, keras.layers.GlobalMaxPooling3D)):
        return _elements(in_shapes[0]), _elements(in_shapes[0])
    if cls in DATA_MOVEMENT_LAYERS or isinstance(layer, keras.layers.InputLayer):
        # Up-sampling's backward sums each block of repeated gradients.
        backward = out if isinstance(layer, keras.layers.UpSampling3D) else 0
        return 0, backward
    forward, backward = ELEMENTWISE_FLOPS.get(cls, (1, 1))
    if cls == "Activation":
        forward = backward = _activation_flops(layer)
    return forward * out, backward * out


def _face_extents(plans, exchanging, coords, local_in, axis, in_place_pool, local_out) -> list[int]:
    """Extents along the other axes of the planes sent along `axis` (see the module doc)."""
    face = []
    for other in range(3):
        if other == axis:
            continue
        plan = plans[other]
        if in_place_pool:
            face.append(plan.local_output_extent(coords[other]))
        elif other < axis and exchanging[other]:
            face.append(plan.extended_extent(coords[other]))
        elif other < axis:
            kept = plan.kept(coords[other])
            face.append(0 if kept is None else kept[1] - kept[0])
        else:
            face.append(plan.local_input_extent(coords[other]))
    return face


def _exchanges(layer, mesh: Mesh, local_in, local_out, batch: int, global_in) -> tuple:
    """Per spatial index, the `AxisExchange`s of `layer`'s forward halo exchange."""
    plans = layer.axis_plans(mesh.spatial_shape, (None,) + tuple(local_in), global_extents=tuple(global_in))
    exchanging = [plan.exchanges for plan in plans]
    if not any(exchanging):
        return ()
    channels = local_in[-1]
    kind = {keras.layers.MaxPooling3D: "max", keras.layers.AveragePooling3D: "average"}
    pool_kind = next((k for cls, k in kind.items() if isinstance(layer, cls)), None)
    # Whether the in-place path applies is decided alike on every shard.
    in_place = pool_kind is not None and in_place_layout(plans, (0, 0, 0), pool_kind) is not None
    # Planes moved along each axis between shard positions: (sender, receiver) -> planes.
    planes = [
        {(p, q): t[1] - t[0] for p in range(plan.shards) for q in range(plan.shards)
         if (t := plan.transfer(p, q)) is not None} if exchanging[axis] else {}
        for axis, plan in enumerate(plans)
    ]
    result = []
    for index in range(mesh.spatial_size):
        coords = mesh.coords_of_spatial_index(index)
        axes = []
        for axis, plan in enumerate(plans):
            if not exchanging[axis]:
                continue
            face = math.prod(_face_extents(plans, exchanging, coords, local_in, axis, in_place, local_out))
            plane_bytes = face * channels * batch * BYTES_PER_ELEMENT
            received, sent = [], []
            me = coords[axis]
            for (sender, receiver), count in planes[axis].items():
                if me not in (sender, receiver):
                    continue
                peer = list(coords)
                peer[axis] = receiver if sender == me else sender
                entry = (mesh.spatial_index_of(peer), count * plane_bytes)
                (sent if sender == me else received).append(entry)
            axes.append(AxisExchange(axis, tuple(received), tuple(sent)))
        result.append(tuple(axes))
    return tuple(result)


def _layer_collectives(layer, mesh: Mesh, in_local, out_global, batch: int) -> tuple[tuple, tuple]:
    spatial = mesh.spatial_size > 1
    out_bytes = _elements(out_global) * batch * BYTES_PER_ELEMENT
    if spatial and isinstance(layer, (SpatialFlatten, SpatialGather)):
        return (Collective("allgather", "spatial", out_bytes, "gather"),), (
            Collective("allreduce", "spatial", out_bytes, "gather gradient"),)
    if spatial and isinstance(layer, SpatialGlobalAveragePooling3D):
        return (Collective("allreduce", "spatial", out_bytes, "global average"),), (
            Collective("allreduce", "spatial", out_bytes, "global average gradient"),)
    if spatial and isinstance(layer, SpatialGlobalMaxPooling3D):
        return (Collective("allgather", "spatial", out_bytes * mesh.spatial_size, "global max"),), (
            Collective("allreduce", "spatial", out_bytes, "global max gradient"),)
    if isinstance(layer, SpatialBatchNormalization) and mesh.world_size > 1:
        group = "world" if layer.synchronized else "spatial"
        ranks = mesh.world_size if layer.synchronized else mesh.spatial_size
        if ranks == 1:
            return (), ()
        channels = in_local[-1]
        forward = [Collective("allgather", group, (2 * channels + 1) * BYTES_PER_ELEMENT * ranks, "moments")]
        if not layer.synchronized and mesh.data_size > 1:
            forward.append(Collective("allreduce", "position", 2 * channels * BYTES_PER_ELEMENT, "moving statistics"))
        return tuple(forward), (Collective("allreduce", group, 2 * channels * BYTES_PER_ELEMENT, "moments gradient"),)
    return (), ()


def kernel_key(spec: dict) -> str:
    """The `Hardware.kernel_times` key of a convolution described by `spec`.

    `spec` holds "class" ("Conv3D" or "Conv3DTranspose"), "input" (the per-rank input
    shape, batch first, channels last), "filters", "kernel_size", "strides", "padding",
    "use_bias" and "input_gradient" (as `kernel_spec` returns). The key is readable and
    can be parsed back by `parse_kernel_key`.

    Example:
    >>> kernel_key({"class": "Conv3D", "input": (1, 32, 64, 64, 4), "filters": 16,
    ...             "kernel_size": (3, 3, 3), "strides": (1, 1, 1), "padding": "same",
    ...             "use_bias": False, "input_gradient": False})
    'Conv3D 1x32x64x64x4 f16 k3x3x3 s1x1x1 same nobias nodx'
    """
    def text(values):
        return "x".join(str(int(v)) for v in values)

    return (f"{spec['class']} {text(spec['input'])} f{int(spec['filters'])} k{text(spec['kernel_size'])} "
            f"s{text(spec['strides'])} {spec['padding']} {'bias' if spec['use_bias'] else 'nobias'} "
            f"{'dx' if spec['input_gradient'] else 'nodx'}")


def parse_kernel_key(key: str) -> dict:
    """The spec of a `kernel_key`, for a tool that measures the kernel.

    Raises:
        ValueError: for a string that is not a kernel key.
    """
    parts = key.split()
    try:
        cls, shape, filters, kernel, strides, padding, bias, dx = parts
        if cls not in ("Conv3D", "Conv3DTranspose") or padding not in ("same", "valid"):
            raise ValueError
        if not (filters[0] == "f" and kernel[0] == "k" and strides[0] == "s"
                and bias in ("bias", "nobias") and dx in ("dx", "nodx")):
            raise ValueError
        return {"class": cls, "input": tuple(int(v) for v in shape.split("x")), "filters": int(filters[1:]),
                "kernel_size": tuple(int(v) for v in kernel[1:].split("x")),
                "strides": tuple(int(v) for v in strides[1:].split("x")), "padding": padding,
                "use_bias": bias == "bias", "input_gradient": dx == "dx"}
    except ValueError:
        raise ValueError(f"Not a kernel key (see `kernel_key`). Received: {key!r}") from None


def kernel_spec(layer, local_input: tuple, batch_size: int, input_gradient: bool) -> Optional[dict]:
    """The spec `kernel_key` describes for a (spatial or plain) Conv3D or Conv3DTranspose
    running on a per-rank input of shape `local_input` (no batch axis); None for other
    layers."""
    if (not isinstance(layer, (keras.layers.Conv3D, keras.layers.Conv3DTranspose))
            or int(getattr(layer, "groups", 1) or 1) != 1):
        return None
    cls = "Conv3DTranspose" if isinstance(layer, keras.layers.Conv3DTranspose) else "Conv3D"
    return {"class": cls, "input": (int(batch_size), *(int(d) for d in local_input)),
            "filters": int(layer.filters), "kernel_size": tuple(int(k) for k in layer.kernel_size),
            "strides": tuple(int(s) for s in layer.strides), "padding": layer.padding,
            "use_bias": bool(layer.use_bias), "input_gradient": bool(input_gradient)}


def model_costs(
    model_or_builder: Any,
    spatial_shape: Sequence[int],
    *,
    world_size: Optional[int] = None,
    batch_size: int = 1,
    rows: Optional[Sequence[dict]] = None,
) -> list[LayerCost]:
    """Per-layer costs of one training step on one rank of a layout.

    Args:
        model_or_builder: a functional model built with NO spatial strategy (global
            shapes), or a function of no arguments returning one; or, with `rows`, a
            model built under a strategy of this layout (local shapes).
        spatial_shape: shards along (depth, height, width).
        world_size: ranks in the world. Defaults to the spatial size (one data group).
        batch_size: samples per rank (the per-data-group batch). Defaults to 1.
        rows: the layout plan of the model on this layout (`keras_spatial.plan.summary`
            or `plan_for_mesh` rows). Defaults to `plan_for_mesh` of the model.

    Returns:
        One `LayerCost` per layer, in model order.

    Raises:
        ValueError: for a layout the model cannot keep aligned (the plan's message), a
            world size that is not a multiple of the spatial size, or a bad batch size.

    Example:
    >>> from recipes.cosmoflow.model import build_model
    >>> costs = model_costs(lambda: build_model(32), (2, 1, 1))
    >>> costs[1].name, costs[1].forward_flops  # 16 x 32 x 32 x 16 outputs x 2 x 27 x 4
    ('block1_conv', 56623104)
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size` must be a positive integer. Received: batch_size={batch_size!r}")
    spatial_shape = tuple(int(s) for s in spatial_shape)
    mesh = Mesh(world_size=world_size or math.prod(spatial_shape), spatial_shape=spatial_shape)
    model = model_or_builder if isinstance(model_or_builder, keras.Model) else model_or_builder()
    if rows is None:
        rows = plan_for_mesh(model, spatial_shape, 0, world_size=mesh.world_size, batch_size=batch_size)
    rows = iter(rows)
    split: dict[int, bool] = {}  # tensor id -> sharded
    local_of: dict[int, tuple] = {}  # tensor id -> local shape without the batch axis
    needs_grad: dict[int, bool] = {}  # tensor id -> depends on a trainable weight
    costs = []
    for layer in model.layers:
        inputs = _layer_inputs(layer)
        outputs = _tensors(layer.output)
        layer_rows = [next(rows) for _ in outputs]
        row = layer_rows[0]
        in_local = [local_of[id(t)] if id(t) in local_of
                    else _local(tuple(t.shape[1:]), split.get(id(t), False), spatial_shape) for t in inputs]
        out_local = tuple(row["local_shape"])
        params = sum(_elements(w.shape) for w in layer.trainable_weights)
        input_grad = any(needs_grad.get(id(t), False) for t in inputs)
        for tensor, out_row in zip(outputs, layer_rows):
            split[id(tensor)] = out_row["split"] == "sharded"
            local_of[id(tensor)] = tuple(out_row["local_shape"])
            needs_grad[id(tensor)] = input_grad or params > 0
        forward, backward = _compute_flops(layer, in_local, out_local, input_grad)
        exchanges = ()
        read = sum(_elements(s) for s in in_local)
        if (isinstance(layer, SpatialWindowMixin) and layer.exchanges_halos and inputs
                and split.get(id(inputs[0]), False) and mesh.spatial_size > 1):
            exchanges = _exchanges(layer, mesh, in_local[0], out_local, batch_size,
                                   tuple(inputs[0].shape[1:4]))
            read += sum(e.bytes_received for e in exchanges[0]) // (BYTES_PER_ELEMENT * batch_size) if exchanges else 0
        written = sum(_elements(r["local_shape"]) for r in layer_rows)
        differentiated = input_grad or params > 0
        forward_bytes = (read + written) * batch_size * BYTES_PER_ELEMENT + params * BYTES_PER_ELEMENT
        backward_bytes = 0
        if differentiated:
            backward_bytes = ((written + read + (read if input_grad else 0)) * batch_size
                              + 2 * params) * BYTES_PER_ELEMENT
        else:
            backward = 0
        forward_collectives, backward_collectives = _layer_collectives(
            layer, mesh, in_local[0] if in_local else out_local, row["global_shape"], batch_size
        )
        replicated = row["split"] == "replicated" and bool(inputs) and not any(
            split.get(id(t), False) for t in inputs
        )
        spec = kernel_spec(layer, in_local[0], batch_size, input_grad) if in_local else None
        costs.append(LayerCost(
            name=layer.name, type=type(layer).__name__, split=row["split"], local_shape=out_local,
            forward_flops=forward * batch_size, backward_flops=backward * batch_size,
            forward_bytes=forward_bytes, backward_bytes=backward_bytes, parameters=params,
            replicated_parameters=replicated and mesh.spatial_size > 1,
            activation_bytes=sum(r["bytes"] for r in layer_rows), input_gradient=input_grad,
            exchanges=exchanges, forward_collectives=forward_collectives,
            backward_collectives=backward_collectives if input_grad else (),
            kernel=kernel_key(spec) if spec else "",
        ))
    return costs


def gradient_collectives(costs: Sequence[LayerCost], mesh: Mesh) -> list[Collective]:
    """The gradient averages of `DistributedOptimizer.average_gradients` for `costs`.

    Replicated layers' gradients (identical inside a spatial group) are averaged over the
    position group when there are several data groups, and need nothing with one; all
    others over the world. A world of one rank averages nothing.
    """
    if mesh.world_size == 1:
        return []
    world = sum(c.parameters for c in costs if not c.replicated_parameters) * BYTES_PER_ELEMENT
    position = sum(c.parameters for c in costs if c.replicated_parameters) * BYTES_PER_ELEMENT
    result = []
    if world:
        result.append(Collective("allreduce", "world", world, "gradients"))
    if position and mesh.data_size > 1:
        result.append(Collective("allreduce", "position", position, "replicated gradients"))
    return result


# ----------------------------------------------------------------------------- times


def group_ranks(mesh: Mesh, group: str) -> list[int]:
    """The ranks of data group 0's `group` ("spatial", "world", "position")."""
    if group == "world":
        return list(range(mesh.world_size))
    if group == "spatial":
        return mesh.spatial_group(0)
    if group == "position":
        return mesh.position_group(0)
    raise ValueError(f"`group` must be 'spatial', 'world' or 'position'. Received: group={group!r}")


COLLECTIVE_ALGORITHMS = ("ring", "tree")


def ring_time(kind: str, size: int, ranks: int, latency: float, bandwidth: float,
              algorithm: str = "ring") -> float:
    """Time of a collective on `ranks` ranks of `size` bytes.

    "ring": allreduce 2 (p - 1) / p x size / bandwidth + 2 (p - 1) x latency; allgather
    (of a `size`-byte result) (p - 1) / p x size / bandwidth + (p - 1) x latency.
    "tree": the same bandwidth terms with latency terms of 2 ceil(log2 p) x latency
    (allreduce) and ceil(log2 p) x latency (allgather), as for tree or recursive-doubling
    algorithms, which libraries pick for small messages on many ranks.

    Raises:
        ValueError: for an unknown `kind` or `algorithm`.
    """
    if kind not in ("allreduce", "allgather"):
        raise ValueError(f"`kind` must be 'allreduce' or 'allgather'. Received: kind={kind!r}")
    if algorithm not in COLLECTIVE_ALGORITHMS:
        raise ValueError(f"`algorithm` must be one of {COLLECTIVE_ALGORITHMS}. Received: algorithm={algorithm!r}")
    if ranks <= 1:
        return 0.0
    steps = 2 if kind == "allreduce" else 1
    hops = ranks - 1 if algorithm == "ring" else math.ceil(math.log2(ranks))
    return steps * ((ranks - 1) / ranks * size / bandwidth + hops * latency)


def collective_time(collective: Collective, mesh: Mesh, hardware: Hardware, algorithm: str = "ring") -> float:
    """Time of `collective` (`ring_time`) on the link its group needs (inter-node if it
    spans nodes)."""
    ranks = group_ranks(mesh, collective.group)
    inter = ranks[0] // hardware.ranks_per_node != ranks[-1] // hardware.ranks_per_node
    latency, bandwidth = hardware.link(inter)
    return ring_time(collective.kind, collective.bytes, len(ranks), latency, bandwidth, algorithm)


def exchange_time(cost: LayerCost, mesh: Mesh, hardware: Hardware) -> float:
    """Time of one layer's halo exchange (the slowest rank; axes one after another).

    Per axis and rank, each link class (intra-, inter-node) carries max(bytes sent,
    bytes received) in max(messages sent, received) messages, at latency x messages +
    bytes / bandwidth; the two classes run concurrently. Every placement of a spatial
    group on nodes that occurs in the world is considered.
    """
    if not cost.exchanges:
        return 0.0
    rpn = hardware.ranks_per_node
    offsets = sorted({(g * mesh.spatial_size) % rpn for g in range(min(mesh.data_size, rpn))})
    worst = 0.0
    for offset in offsets:
        for index, axes in enumerate(cost.exchanges):
            total = 0.0
            for exchange in axes:
                links = {False: [0, 0, 0, 0], True: [0, 0, 0, 0]}  # sent, received, n sent, n recv
                for peers, slot in ((exchange.sent, 0), (exchange.received, 1)):
                    for peer, size in peers:
                        inter = (offset + peer) // rpn != (offset + index) // rpn
                        links[inter][slot] += size
                        links[inter][slot + 2] += 1
                times = []
                for inter, (sent, received, n_sent, n_received) in links.items():
                    if n_sent or n_received:
                        latency, bandwidth = hardware.link(inter)
                        times.append(latency * max(n_sent, n_received) + max(sent, received) / bandwidth)
                total += max(times, default=0.0)
            worst = max(worst, total)
    return worst


def compute_time(flops: int, memory_bytes: int, hardware: Hardware) -> float:
    """Roofline time: max(FLOPs / achieved FLOP/s, bytes / achieved bandwidth)."""
    return max(flops / hardware.effective_flops, memory_bytes / hardware.effective_memory_bandwidth)


@dataclasses.dataclass(frozen=True)
class LayerTime:
    """Predicted time of one layer in one training step (forward + backward), s.

    Attributes:
        name, type: the layer's.
        compute: both passes (the measured `Hardware.kernel_times` entry of the layer's
            kernel if there is one, else the roofline) plus `Hardware.op_overhead` per
            pass, times `Hardware.compute_factor` (ranks sharing a node).
        halo: halo exchange of both passes (the backward one only when the input
            gradient is computed).
        collectives: the layer's own collectives (gathers, global pooling, batch-norm
            statistics) of both passes.
        memory: the layer's activation memory per rank, bytes.
    """

    name: str
    type: str
    compute: float
    halo: float
    collectives: float
    memory: int

    @property
    def total(self) -> float:
        """compute + halo + collectives (no overlap)."""
        return self.compute + self.halo + self.collectives


def layer_time(cost: LayerCost, mesh: Mesh, hardware: Hardware, collectives: str = "ring") -> LayerTime:
    """The predicted `LayerTime` of one layer's `LayerCost` on `mesh` and `hardware`."""
    overhead = hardware.op_overhead if cost.forward_flops or cost.forward_bytes else 0.0
    measured = (hardware.kernel_times or {}).get(cost.kernel) if cost.kernel else None
    if measured is not None:
        passes = measured
    else:
        passes = (compute_time(cost.forward_flops, cost.forward_bytes, hardware)
                  + compute_time(cost.backward_flops, cost.backward_bytes, hardware))
    compute = (passes + overhead * (2 if cost.backward_bytes else 1)) * hardware.compute_factor(mesh.world_size)
    exchange = exchange_time(cost, mesh, hardware)
    halo = exchange + (exchange if cost.input_gradient else 0.0)
    communication = sum(collective_time(c, mesh, hardware, collectives)
                        for c in cost.forward_collectives + cost.backward_collectives)
    return LayerTime(cost.name, cost.type, compute, halo, communication, cost.activation_bytes)


@dataclasses.dataclass(frozen=True)
class StepPrediction:
    """Predicted training step on one layout.

    Attributes:
        spatial_shape, world_size, data_groups, batch_size: the layout (batch per rank).
        compute: forward + backward compute time, s.
        replicated_compute: the part of `compute` spent in replicated layers, s.
        halo: halo exchange time, forward + backward, s (0 where hidden by overlap).
        layer_collectives: gathers, global poolings, batch-norm statistics, s.
        gradient_allreduce: gradient averaging, s.
        optimizer: optimizer update of all parameters, s.
        step: total step time, s.
        memory: estimated peak memory per rank, bytes (see `memory_per_rank`).
        flops: FLOPs per rank per step.
        halo_bytes: halo bytes received per step, forward and backward, summed over
            layers of each layer's busiest rank.
        overlap_halo: whether halo exchange was assumed hidden behind compute.
        collectives: the collective latency model ("ring" or "tree").
    """

    spatial_shape: tuple
    world_size: int
    data_groups: int
    batch_size: int
    compute: float
    replicated_compute: float
    halo: float
    layer_collectives: float
    gradient_allreduce: float
    optimizer: float
    step: float
    memory: int
    flops: int
    halo_bytes: int
    overlap_halo: bool
    collectives: str = "ring"

    @property
    def samples_per_second(self) -> float:
        """Global throughput: global batch / step time."""
        return self.batch_size * self.data_groups / self.step


def memory_per_rank(costs: Sequence[LayerCost], optimizer_slots: int = ADAM_SLOTS) -> int:
    """Estimated peak memory of one rank, bytes.

    Activations of every layer (kept for the backward pass) + twice the largest one (an
    upstream and an input gradient alive at once) + the largest halo received by a rank
    + weights, their gradients and `optimizer_slots` moments per parameter (every rank
    holds all parameters).
    """
    activations = sum(c.activation_bytes for c in costs)
    largest = max((c.activation_bytes for c in costs), default=0)
    halo = max((c.halo_bytes(i) for c in costs for i in range(len(c.exchanges))), default=0)
    params = sum(c.parameters for c in costs)
    return activations + 2 * largest + halo + params * BYTES_PER_ELEMENT * (2 + optimizer_slots)


def predict_step(
    model_or_costs: Any,
    spatial_shape: Sequence[int],
    world_size: int,
    global_batch: int,
    hardware: Hardware,
    *,
    overlap_halo: bool = False,
    optimizer_slots: int = ADAM_SLOTS,
    collectives: str = "ring",
) -> StepPrediction:
    """Predicted step time and memory per rank of a model on a layout.

    Each layer's forward and backward pass cost compute (`compute_time`) + halo
    exchange (`exchange_time`, the same bytes both ways) + its collectives, one after
    another (with `overlap_halo`, max(compute, halo) instead of their sum); then the
    gradient average (`gradient_collectives`), the optimizer update (memory bound,
    `ADAM_FLOPS_PER_PARAMETER`) and the per-batch metric average (one small world
    allreduce).

    Args:
        model_or_costs: a model or builder (as for `model_costs`), or the `LayerCost`
            list `model_costs` returned for this layout and batch.
        spatial_shape: shards along (depth, height, width).
        world_size: ranks in the world.
        global_batch: samples per step over the world; a multiple of the data groups.
        hardware: the machine.
        overlap_halo: assume halo exchange hidden behind the layer's compute. The code
            does not overlap. Defaults to False.
        optimizer_slots: moments per parameter (2 for Adam). Defaults to 2.
        collectives: "ring" or "tree", the latency model of collectives (`ring_time`).
            Defaults to "ring".

    Raises:
        ValueError: for a global batch that the data groups cannot share evenly, a bad
            layout, or a `hardware` that is not a `Hardware`.
    """
    if not isinstance(hardware, Hardware):
        raise ValueError(f"`hardware` must be a Hardware. Received: hardware={hardware!r}")
    if collectives not in COLLECTIVE_ALGORITHMS:
        raise ValueError(
            f"`collectives` must be one of {COLLECTIVE_ALGORITHMS}. Received: collectives={collectives!r}"
        )
    mesh = Mesh(world_size=world_size, spatial_shape=tuple(spatial_shape))
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1 \
            or global_batch % mesh.data_size:
        raise ValueError(
            f"`global_batch` must be a positive multiple of the {mesh.data_size} data groups. "
            f"Received: global_batch={global_batch!r}, world_size={world_size}, "
            f"spatial_shape={mesh.spatial_shape}"
        )
    batch = global_batch // mesh.data_size
    if isinstance(model_or_costs, (list, tuple)) and all(isinstance(c, LayerCost) for c in model_or_costs):
        costs = list(model_or_costs)
    else:
        costs = model_costs(model_or_costs, mesh.spatial_shape, world_size=world_size, batch_size=batch)
    compute = replicated = halo = layer_collectives = 0.0
    halo_bytes = 0
    for cost in costs:
        times = layer_time(cost, mesh, hardware, collectives)
        compute += times.compute
        if cost.split == "replicated":
            replicated += times.compute
        halo += max(times.halo - times.compute, 0.0) if overlap_halo else times.halo
        if cost.exchanges:
            busiest = max(cost.halo_bytes(i) for i in range(len(cost.exchanges)))
            halo_bytes += busiest * (2 if cost.input_gradient else 1)
        layer_collectives += times.collectives
    gradients = sum(collective_time(c, mesh, hardware, collectives) for c in gradient_collectives(costs, mesh))
    metric = collective_time(Collective("allreduce", "world", 2 * BYTES_PER_ELEMENT, "metrics"), mesh, hardware,
                             collectives)
    params = sum(c.parameters for c in costs)
    optimizer = compute_time(
        params * ADAM_FLOPS_PER_PARAMETER,
        params * BYTES_PER_ELEMENT * (3 + 2 * optimizer_slots),  # read p, g, slots; write p, slots
        hardware,
    ) * hardware.compute_factor(world_size)
    step = compute + halo + layer_collectives + gradients + optimizer + metric
    return StepPrediction(
        spatial_shape=mesh.spatial_shape, world_size=world_size, data_groups=mesh.data_size,
        batch_size=batch, compute=compute, replicated_compute=replicated, halo=halo,
        layer_collectives=layer_collectives + metric, gradient_allreduce=gradients, optimizer=optimizer,
        step=step, memory=memory_per_rank(costs, optimizer_slots),
        flops=sum(c.forward_flops + c.backward_flops for c in costs), halo_bytes=halo_bytes,
        overlap_halo=bool(overlap_halo), collectives=collectives,
    )


# ----------------------------------------------------------------------------- layouts


def spatial_shapes(spatial_size: int) -> list[tuple[int, int, int]]:
    """Every (sd, sh, sw) with sd x sh x sw == `spatial_size`, deepest splits first."""
    shapes = []
    for sd in range(spatial_size, 0, -1):
        if spatial_size % sd:
            continue
        for sh in range(spatial_size // sd, 0, -1):
            if (spatial_size // sd) % sh == 0:
                shapes.append((sd, sh, spatial_size // sd // sh))
    return shapes


@dataclasses.dataclass(frozen=True)
class LayoutChoice:
    """What `auto_layout` chose.

    Attributes:
        spatial_shape: the chosen shards along (depth, height, width).
        data_groups: world size / spatial size.
        prediction: its `StepPrediction`.
        candidates: the `StepPrediction` of every layout that fits, fastest first.
        rejected: ((spatial_shape, reason), ...) of the layouts that do not (with the
            model variant's label in front of the reason when several were given).
        explanation: the choice in words.
        variant: the label of the chosen model variant when `auto_layout` was given a
            dict of them, else None.
    """

    spatial_shape: tuple
    data_groups: int
    prediction: StepPrediction
    candidates: tuple
    rejected: tuple
    explanation: str
    variant: Any = None


def _gib(count: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if count < 1024:
            return f"{count:.0f} B" if unit == "B" else f"{count:.2f} {unit}"
        count /= 1024
    return f"{count:.2f} GiB"


def _describe(p: StepPrediction) -> str:
    return (f"spatial_shape={p.spatial_shape} x {p.data_groups} data group(s), batch {p.batch_size} "
            f"per rank: step {p.step * 1e3:.3f} ms (compute {p.compute * 1e3:.3f}, halo "
            f"{p.halo * 1e3:.3f}, layer collectives {p.layer_collectives * 1e3:.3f}, gradient "
            f"allreduce {p.gradient_allreduce * 1e3:.3f}, optimizer {p.optimizer * 1e3:.3f} ms), "
            f"memory {_gib(p.memory)}")


def _rejections(rejected: Sequence[tuple], memory: dict) -> str:
    """The rejected layouts in a few words: how many and the nearest miss of each kind."""
    over = [(memory[index], shape) for index, (shape, reason) in enumerate(rejected) if index in memory]
    misaligned = [(shape, reason) for index, (shape, reason) in enumerate(rejected) if index not in memory]
    parts = []
    if over:
        need, shape = min(over, key=lambda item: item[0])
        parts.append(f"{len(over)} over the memory limit (the smallest, {shape}, needs {_gib(need)} per rank)")
    if misaligned:
        shape, reason = misaligned[0]
        parts.append(f"{len(misaligned)} not aligned (e.g. {shape}: {reason.splitlines()[0][:160]})")
    return "; ".join(parts)


def auto_layout(
    model_or_builder: Any,
    world_size: int,
    hardware: Hardware,
    memory_limit: Optional[float] = None,
    *,
    global_batch: int,
    overlap_halo: bool = False,
    max_spatial_size: Optional[int] = None,
    collectives: str = "ring",
) -> LayoutChoice:
    """The fastest layout (spatial shape, data groups) of `world_size` ranks that fits.

    Every spatial size S dividing `world_size` whose data groups (world_size / S) divide
    `global_batch` is tried with every (sd, sh, sw) of product S; layouts the model
    cannot keep aligned, or whose predicted memory per rank (`predict_step`) exceeds
    `memory_limit`, are rejected. The fastest predicted step wins; ties go to the smaller
    spatial size, then to the split deepest along depth.

    Args:
        model_or_builder: a model built with no spatial strategy, or a function of no
            arguments returning one; or a dict {label: model or function} of variants
            of the model (e.g. where its spatial split stops: CosmoFlow's
            `gather_before_block`), every one tried with every layout.
        world_size: ranks in the world.
        hardware: the machine (`Hardware`).
        memory_limit: bytes per rank. Defaults to `hardware.memory_capacity`.
        global_batch: samples per step over the world.
        overlap_halo: as for `predict_step`. Defaults to False.
        max_spatial_size: largest spatial size tried. Defaults to `world_size`.
        collectives: as for `predict_step`. Defaults to "ring".

    Returns:
        A `LayoutChoice`.

    Raises:
        ValueError: if no layout fits (the message counts the rejected layouts and names
            the nearest miss of each kind), or for a bad argument.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"`world_size` must be a positive integer. Received: world_size={world_size!r}")
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"`global_batch` must be a positive integer. Received: global_batch={global_batch!r}")
    if not isinstance(hardware, Hardware):
        raise ValueError(f"`hardware` must be a Hardware. Received: hardware={hardware!r}")
    limit = hardware.memory_capacity if memory_limit is None else memory_limit
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0:
        raise ValueError(f"`memory_limit` must be a positive number of bytes. Received: memory_limit={memory_limit!r}")
    variants = model_or_builder if isinstance(model_or_builder, dict) else {None: model_or_builder}
    if not variants:
        raise ValueError("`model_or_builder` is an empty dict: give at least one model variant.")
    largest = world_size if max_spatial_size is None else min(world_size, max_spatial_size)
    fitting, rejected, memory = [], [], {}
    for label, variant in variants.items():
        model = variant if isinstance(variant, keras.Model) else variant()
        prefix = "" if label is None else f"{label}: "
        for size in range(1, largest + 1):
            if world_size % size or global_batch % (world_size // size):
                continue
            for shape in spatial_shapes(size):
                try:
                    costs = model_costs(model, shape, world_size=world_size,
                                        batch_size=global_batch // (world_size // size))
                except ValueError as error:
                    rejected.append((shape, f"{prefix}not aligned: {error}"))
                    continue
                prediction = predict_step(costs, shape, world_size, global_batch, hardware,
                                          overlap_halo=overlap_halo, collectives=collectives)
                if prediction.memory > limit:
                    memory[len(rejected)] = prediction.memory
                    rejected.append((shape, f"{prefix}memory {_gib(prediction.memory)} > limit {_gib(limit)}"))
                else:
                    fitting.append((prediction, label))
    if not fitting:
        raise ValueError(
            f"No layout of {world_size} ranks with a global batch of {global_batch} fits in "
            f"{_gib(limit)} per rank. Rejected: "
            f"{_rejections(rejected, memory) or 'no spatial size divides the world and the batch'}."
        )
    fitting.sort(key=lambda item: (item[0].step, math.prod(item[0].spatial_shape),
                                   tuple(-s for s in item[0].spatial_shape)))
    best, label = fitting[0]
    chosen = "" if label is None else f" ({label})"
    explanation = (f"Chosen{chosen}: {_describe(best)}, limit {_gib(limit)}. {len(fitting)} layout(s) fit, "
                   f"{len(rejected)} rejected")
    explanation += f" ({_rejections(rejected, memory)})." if rejected else "."
    if len(fitting) > 1:
        runner, runner_label = fitting[1]
        explanation += f" Next{'' if runner_label is None else f' ({runner_label})'}: {_describe(runner)}."
    return LayoutChoice(best.spatial_shape, best.data_groups, best, tuple(p for p, _ in fitting),
                        tuple(rejected), explanation, label)


def as_hardware(hardware: Any) -> Hardware:
    """`hardware` as a `Hardware`.

    Args:
        hardware: a `Hardware`; a dict of its fields (`Hardware.from_dict`); the name of a
            profile of `keras_spatial.hardware_profiles.PROFILES` ("lassen", "h100"); or
            the path of a JSON file holding such a dict.

    Raises:
        ValueError: for anything else, an unreadable file, or a bad description (naming
            the field).
    """
    if isinstance(hardware, Hardware):
        return hardware
    if isinstance(hardware, dict):
        return Hardware.from_dict(hardware)
    if isinstance(hardware, (str, os.PathLike)):
        if str(hardware) in PROFILES:
            return Hardware(**PROFILES[str(hardware)])
        if not os.path.isfile(hardware):
            raise ValueError(
                f"`hardware` {str(hardware)!r} is neither a profile ({sorted(PROFILES)}) "
                "nor an existing JSON file."
            )
        try:
            with open(hardware) as handle:
                description = json.load(handle)
        except (OSError, ValueError) as error:
            raise ValueError(f"Cannot read the hardware description {str(hardware)!r}: {error}") from None
        return Hardware.from_dict(description)
    raise ValueError(
        "`hardware` must be a keras_spatial.cost_model.Hardware, a dict of its fields, a profile "
        f"name or a JSON file. Received: hardware={hardware!r}"
    )


def format_predictions(costs: Sequence[LayerCost], mesh: Mesh, hardware: Hardware,
                       global_batch: int, collectives: str = "ring") -> str:
    """Predicted time and memory per layer and the step total, as a text table.

    Args:
        costs: `model_costs` of the layout.
        mesh: the layout.
        hardware: the machine.
        global_batch: samples per step over the world.
        collectives: as for `predict_step`. Defaults to "ring".
    """
    prediction = predict_step(list(costs), mesh.spatial_shape, mesh.world_size, global_batch,
                              hardware, collectives=collectives)
    columns = ("layer", "type", "compute ms", "halo ms", "collectives ms", "total ms", "memory")
    table = []
    for cost in costs:
        t = layer_time(cost, mesh, hardware, collectives)
        table.append((t.name, t.type, f"{t.compute * 1e3:.3f}", f"{t.halo * 1e3:.3f}",
                      f"{t.collectives * 1e3:.3f}", f"{t.total * 1e3:.3f}", _gib(t.memory)))
    widths = [max(len(c), *(len(r[i]) for r in table)) if table else len(c) for i, c in enumerate(columns)]
    lines = [f"Predicted on {hardware.name!r} (docs/performance_model.md), global batch {global_batch}, "
             f"{collectives} collectives, no overlap",
             "  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines.append("-" * len(lines[-1]))
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in table]
    lines.append(f"Step: {_describe(prediction)}")
    return "\n".join(lines)


__all__ = [
    "ACTIVATION_FLOPS", "ADAM_FLOPS_PER_PARAMETER", "AxisExchange", "BYTES_PER_ELEMENT", "COLLECTIVE_ALGORITHMS",
    "Collective",
    "ELEMENTWISE_FLOPS", "Hardware", "LayerCost", "LayerTime", "LayoutChoice", "StepPrediction", "auto_layout",
    "collective_time", "compute_time", "exchange_time", "format_predictions", "gradient_collectives", "group_ranks",
    "layer_time", "as_hardware", "kernel_key", "kernel_spec", "parse_kernel_key",
    "memory_per_rank", "model_costs", "predict_step", "ring_time", "spatial_shapes",
]
