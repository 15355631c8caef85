"""What sliding-window spatial layers (convolution, pooling) share."""

from __future__ import annotations

from keras_spatial.errors import SpatialNotSupportedError
from keras_spatial.halo import AxisPlan, ShardAlignmentError, Window, plan_axis
from keras_spatial.layers.global_extents import GlobalExtentsMixin
from keras_spatial.mesh import SPATIAL_AXES
from keras_spatial.ops.halo_exchange import HaloParts, exchange_halos
from keras_spatial.context import get_strategy


def active_spatial_strategy():
    """The active strategy if it splits samples, else None (plain Keras behaviour)."""
    strategy = get_strategy()
    return strategy if strategy is not None and strategy.is_spatial else None


def check_channels_last(layer) -> None:
    """Refuse channels_first, and mark the layer as not XLA-compilable.

    Horovod's ops cannot be compiled by XLA, so a model with spatial layers must run
    with jit_compile=False; Keras's jit_compile="auto" (and True, with a warning) then
    resolves to False.
    """
    layer.supports_jit = False
    if layer.data_format != "channels_last":
        raise SpatialNotSupportedError(
            f"{type(layer).__name__} supports only data_format='channels_last'. "
            f"Received: data_format={layer.data_format!r}, layer={layer.name!r}"
        )


class SpatialWindowMixin(GlobalExtentsMixin):
    """Halo planning and exchange for a layer with one sliding window per axis.

    The subclass provides `_windows()`: one `keras_spatial.halo.Window` per spatial axis
    (or overrides `_plan_axis` and `_output_extent`, as the transposed convolution does).
    Input shapes seen by the layer are LOCAL (one shard); the global extents come from
    the model's graph (`GlobalExtentsMixin`).
    """

    def global_output_extents(self, extents):
        """The global output extents for global input extents (D, H, W)."""
        return tuple(self._output_extent(axis, extent) for axis, extent in enumerate(extents))

    def _windows(self) -> tuple[Window, Window, Window]:
        raise NotImplementedError

    def _plan_axis(self, axis: int, global_extent: int, shards: int) -> AxisPlan:
        """The halo plan of spatial `axis` (raises `ShardAlignmentError`)."""
        return plan_axis(global_extent, shards, self._windows()[axis])

    def _output_extent(self, axis: int, global_extent: int) -> int:
        """The global output extent along spatial `axis`, for error messages."""
        return self._windows()[axis].output_extent(global_extent)

    @property
    def exchanges_halos(self) -> bool:
        """Whether the layer's split needs halos at all (False where every input voxel
        maps to its own output block, as for a transposed convolution with kernel ==
        strides)."""
        return True

    def axis_plans(self, spatial_shape, input_shape, global_extents=None) -> tuple[AxisPlan, ...]:
        """The halo plan of each spatial axis (`keras_spatial.halo.AxisPlan`) for a
        LOCAL `input_shape` on a mesh that splits samples `spatial_shape` ways.

        `global_extents`: the input's global (D, H, W); by default the ones recorded for
        this local shape (`GlobalExtentsMixin.global_input_extents`).

        Raises:
            ValueError: if the shape is not 5D, an extent is unknown, or an axis's
                global input or output extent has fewer planes than shards (the message
                names layer, axis, extents and mesh).
        """
        spatial_shape = tuple(spatial_shape)
        if len(input_shape) != 5:
            raise ValueError(
                f"{type(self).__name__} expects 5D inputs (batch, depth, height, width, "
                f"channels). Received: input_shape={tuple(input_shape)}, layer={self.name!r}"
            )
        plans = []
        if global_extents is None:
            global_extents = self.global_input_extents(input_shape[1:4], spatial_shape)
        for axis, (local, shards) in enumerate(zip(input_shape[1:4], spatial_shape)):
            if local is None:
                raise ValueError(
                    f"A spatially split layer needs a known {SPATIAL_AXES[axis]} extent. "
                    f"Received: input_shape={tuple(input_shape)}, layer={self.name!r}"
                )
            global_extent = global_extents[axis]
            try:
                plans.append(self._plan_axis(axis, global_extent, shards))
            except ShardAlignmentError as error:
                raise ValueError(
                    f"Layer {self.name!r} cannot split its input or output over its shards "
                    f"along the {SPATIAL_AXES[axis]} axis: {error} Choose larger input "
                    "extents, fewer shards along this axis, or gather the volume before this "
                    "layer (keras_spatial.layers.SpatialGather). Received: "
                    f"layer={self.name!r}, axis={SPATIAL_AXES[axis]!r}, "
                    f"global_input_extent={global_extent}, "
                    f"global_output_extent={self._output_extent(axis, global_extent)}, "
                    f"local_input_extent={local}, shards={shards}, "
                    f"spatial_shape={spatial_shape}"
                ) from None
        return tuple(plans)

    def _spatial_output_shape(self, strategy, input_shape, channels):
        plans = self.axis_plans(strategy.spatial_shape, input_shape)
        return (input_shape[0],) + tuple(
            plan.local_output_extent(coord) for plan, coord in zip(plans, strategy.coords)
        ) + (channels,)

    def _exchange(self, inputs, strategy, plans, fill_value) -> HaloParts:
        """Exchange the halos of `inputs`; the extended shard is left to assemble."""
        return exchange_halos(
            inputs,
            plans,
            strategy.mesh,
            strategy.coords,
            strategy.spatial_process_set,
            fill_value=fill_value,
            name="ks_halo",
        )

    def _extend(self, inputs, strategy, plans, fill_value):
        """The shard extended by its halos (`keras_spatial.ops.extend_to_halo`)."""
        return self._exchange(inputs, strategy, plans, fill_value).extended()
