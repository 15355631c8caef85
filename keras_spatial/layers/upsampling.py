"""Spatially split 3D nearest-neighbour up-sampling."""

import keras

from keras_spatial.halo import ShardAlignmentError, plan_upsampling_axis
from keras_spatial.layers.global_extents import GlobalExtentsMixin
from keras_spatial.layers.spatial_window import active_spatial_strategy, check_channels_last
from keras_spatial.mesh import SPATIAL_AXES
from keras_spatial.ops.halo_exchange import extend_to_halo


@keras.saving.register_keras_serializable(package="keras_spatial")
class SpatialUpSampling3D(GlobalExtentsMixin, keras.layers.UpSampling3D):
    """3D nearest-neighbour up-sampling of a volume split across a spatial group.

    Repeating every voxel `size` times along each axis is local when the extents divide
    by the shards: the up-sampled shard is exactly the shard of `keras.layers.
    UpSampling3D` applied to the whole volume, so each rank runs the Keras layer on its
    own shard and nothing is exchanged. With uneven shards the split of the output
    (`keras_spatial.halo.split_bounds` of extent x size) need not line up with the
    input's: a shard then receives the input planes its outputs repeat
    (`keras_spatial.halo.plan_upsampling_axis`), up-samples them and keeps its outputs.

    Args:
        size: int or 3 ints, the up-sampling factors along depth, height and width.
            Defaults to `(2, 2, 2)`.
        data_format: must be 'channels_last' (the default when Keras's
            `image_data_format` is unchanged).

    Input shape:
        LOCAL shard `(batch, d, h, w, channels)`.

    Output shape:
        LOCAL shard of the global output (`(batch, d * size[0], h * size[1],
        w * size[2], channels)` when the extents divide by the shards).

    Raises:
        SpatialNotSupportedError: for data_format='channels_first'.

    Example:
    ```python
    with strategy.scope():
        x = keras_spatial.Input((32, 32, 32, 8))
        y = SpatialUpSampling3D(2)(x)  # global 64^3, local shard
    ```
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_channels_last(self)

    def axis_plans(self, spatial_shape, input_shape, global_extents=None):
        """The plan of each spatial axis (`keras_spatial.halo.plan_upsampling_axis`) for
        a LOCAL `input_shape`.

        Raises:
            ValueError: if an extent is unknown or smaller than its shards.
        """
        if global_extents is None:
            global_extents = self.global_input_extents(input_shape[1:4], spatial_shape)
        plans = []
        for axis, (extent, shards, size) in enumerate(zip(global_extents, spatial_shape, self.size)):
            try:
                if extent is None:
                    raise ShardAlignmentError("the extent is unknown.")
                plans.append(plan_upsampling_axis(extent, shards, size))
            except ShardAlignmentError as error:
                raise ValueError(
                    f"Layer {self.name!r} cannot split its input along the "
                    f"{SPATIAL_AXES[axis]} axis: {error} Received: layer={self.name!r}, "
                    f"input_shape={tuple(input_shape)}, global_input_extent={extent}, "
                    f"shards={shards}, spatial_shape={tuple(spatial_shape)}"
                ) from None
        return tuple(plans)

    def global_output_extents(self, extents):
        return tuple(extent * size for extent, size in zip(extents, self.size))

    def call(self, inputs):
        strategy = active_spatial_strategy()
        if strategy is None:
            return super().call(inputs)
        plans = self.axis_plans(strategy.spatial_shape, inputs.shape)
        if all(plan.needed == plan.owned for plan in plans):
            return super().call(inputs)  # every shard repeats its own planes only
        extended = extend_to_halo(
            inputs, plans, strategy.mesh, strategy.coords, strategy.spatial_process_set,
            name="ks_upsampling_halo",
        )
        outputs = super().call(extended)
        for spatial_axis, (plan, coord, size) in enumerate(zip(plans, strategy.coords, self.size)):
            start = plan.outputs[coord][0] - plan.needed[coord][0] * size
            count = plan.local_output_extent(coord)
            if start or count != outputs.shape[spatial_axis + 1]:
                index = [slice(None)] * 5
                index[spatial_axis + 1] = slice(start, start + count)
                outputs = outputs[tuple(index)]
        return outputs

    def compute_output_shape(self, input_shape):
        strategy = active_spatial_strategy()
        if strategy is None:
            return super().compute_output_shape(input_shape)
        plans = self.axis_plans(strategy.spatial_shape, input_shape)
        return (input_shape[0],) + tuple(
            plan.local_output_extent(coord) for plan, coord in zip(plans, strategy.coords)
        ) + (input_shape[4],)
