"""The GLOBAL extents of a sharded symbolic tensor, for layers that see only the shard.

Under a spatial strategy a layer's input shape is the LOCAL shard's. When every extent
divides by its shards, the global extent is the local one times the shards; when it
does not (`keras_spatial.halo.split_bounds`: shards differ by one plane), the same
local extent can come from two global ones (7 planes on the first of 2 shards: 13 or
14 in all), so the global extents are read from the model's graph instead:
`symbolic_global_extents` follows a Keras tensor back to its `keras_spatial.Input`,
through the layers in between (each spatial layer says how it maps extents,
`global_output_extents`; every other layer on a sharded volume acts voxel by voxel and
keeps them). `GlobalExtentsMixin` records the answer when a spatial layer is called on
a symbolic tensor (building a functional model), for its build and its later calls on
the shards.
"""

from __future__ import annotations

from typing import Optional, Sequence

from keras_spatial.context import get_strategy
from keras_spatial.halo import shard_extent

Extents = tuple[int, int, int]


def symbolic_global_extents(tensor) -> Optional[Extents]:
    """The global (D, H, W) of the sharded Keras tensor `tensor`, or None when the graph
    does not say (a tensor not made from a `keras_spatial.Input`, a replicated one
    after a gather, or one made by a layer that changes extents without saying how).
    """
    return _walk(tensor, {})


def _walk(tensor, memo: dict) -> Optional[Extents]:
    key = id(tensor)
    if key in memo:
        return memo[key]
    memo[key] = None  # a cycle (none in a Keras graph) reads as unknown
    history = getattr(tensor, "_keras_history", None)
    shape = getattr(tensor, "shape", None)
    result = None
    if history is not None and shape is not None and len(shape) == 5:
        layer, node_index, _ = history
        global_batch_shape = getattr(layer, "global_batch_shape", None)
        if global_batch_shape is not None:  # keras_spatial.Input
            result = tuple(global_batch_shape[1:4])
        else:
            node = layer._inbound_nodes[node_index]
            upstream = [t for t in node.input_tensors if len(getattr(t, "shape", ())) == 5]
            extents = _walk(upstream[0], memo) if upstream else None
            if extents is not None:
                rule = getattr(layer, "global_output_extents", None)
                if rule is not None:
                    result = rule(extents)
                elif tuple(upstream[0].shape[1:4]) == tuple(shape[1:4]):
                    result = extents  # a voxel-wise layer keeps the extents
    memo[key] = result
    return result


def consistent(global_extents: Sequence[int], local_extents: Sequence[Optional[int]],
               spatial_shape: Sequence[int], coords: Sequence[int]) -> bool:
    """Whether `local_extents` is the shard at `coords` of `global_extents`."""
    try:
        return all(
            local == shard_extent(extent, shards, coord)
            for extent, local, shards, coord in zip(global_extents, local_extents, spatial_shape, coords)
        )
    except ValueError:
        return False


class GlobalExtentsMixin:
    """For spatial layers: the global extents of each input they are called on.

    `__call__` on a symbolic input (building a functional model, before Keras builds the
    layer and before `call` ever sees a shard) records the input's global extents by its
    local ones; `global_input_extents`
    gives them back for a local shape. A layer called only on real tensors (never on a
    symbolic one) takes the global extent to be local x shards, which holds when the
    extents divide by the shards; with uneven shards, call spatial layers in a model
    built from `keras_spatial.Input`.
    """

    def __call__(self, *args, **kwargs):
        # Before Keras builds the layer: a layer's build may already plan its output
        # shape (Keras's convolutions validate it in `build`).
        if args and getattr(args[0], "_keras_history", None) is not None:
            strategy = get_strategy()
            self.record_global_extents(args[0], strategy if strategy is not None and strategy.is_spatial else None)
        return super().__call__(*args, **kwargs)

    def _recorded_extents(self) -> dict:
        recorded = self.__dict__.get("_ks_global_extents")
        if recorded is None:
            recorded = {}
            # Not a tracked attribute: Keras's auto-tracking would wrap the dict.
            object.__setattr__(self, "_ks_global_extents", recorded)
        return recorded

    def record_global_extents(self, inputs, strategy) -> None:
        """Record the global extents of the symbolic `inputs` (a 5D Keras tensor)."""
        if strategy is None or len(getattr(inputs, "shape", ())) != 5:
            return
        extents = symbolic_global_extents(inputs)
        local = tuple(inputs.shape[1:4])
        if extents is None or not consistent(extents, local, strategy.spatial_shape, strategy.coords):
            return
        recorded = self._recorded_extents()
        previous = recorded.get(local)
        if previous is not None and previous != extents:
            raise ValueError(
                f"Layer {self.name!r} is called on two sharded volumes with the same local "
                f"extents {local} but different global ones ({previous} and {extents}); "
                "with uneven shards a spatial layer cannot be shared between them. Use two "
                f"layers. Received: layer={self.name!r}"
            )
        recorded[local] = extents

    def global_input_extents(self, local_extents: Sequence[Optional[int]], spatial_shape) -> tuple:
        """The global extents of an input with these local extents (see the class)."""
        recorded = self._recorded_extents().get(tuple(local_extents))
        if recorded is not None:
            return recorded
        return tuple(None if n is None else n * s for n, s in zip(local_extents, spatial_shape))
