"""Spatially split 3D transposed convolution (the up-sampling path of a U-Net)."""

import keras
from keras import ops

from keras_spatial.errors import SpatialNotSupportedError
from keras_spatial.halo import plan_transposed_axis, transposed_output_extent
from keras_spatial.ops.halo_convolution import transposed_convolution_shard
from keras_spatial.layers.spatial_window import (
    SpatialWindowMixin,
    active_spatial_strategy,
    check_channels_last,
)


def _check_supported(layer) -> None:
    if any(d != 1 for d in layer.dilation_rate):
        raise SpatialNotSupportedError(
            f"{type(layer).__name__} supports only dilation_rate=1. Received: "
            f"kernel_size={layer.kernel_size}, strides={layer.strides}, "
            f"padding={layer.padding!r}, dilation_rate={layer.dilation_rate}, "
            f"output_padding={layer.output_padding}, layer={layer.name!r}"
        )


@keras.saving.register_keras_serializable(package="keras_spatial")
class SpatialConv3DTranspose(SpatialWindowMixin, keras.layers.Conv3DTranspose):
    """3D transposed convolution over a volume split across a spatial group.

    Takes the arguments of `keras.layers.Conv3DTranspose`: any kernel size, strides,
    padding and output padding Keras accepts (dilation_rate must be 1). The output shards
    are exactly the output of `keras.layers.Conv3DTranspose` on the whole volume:

    - where every input voxel fills its own output block (kernel_size <= strides on
      every axis and no output_padding, e.g. the usual U-Net up-sampling with kernel and
      strides 2) and the shards' outputs line up with their inputs (always when the
      extents divide by the shards), each rank computes its output shard from its own
      inputs, with no communication;
    - otherwise each rank receives the neighbours' input planes its outputs read
      (`keras_spatial.halo.plan_transposed_axis`: about (kernel - 1) / strides planes),
      runs the 'valid' transposed convolution on its extended shard and keeps its own
      outputs (`keras_spatial.ops.transposed_convolution_shard`).

    Without an active spatial strategy (one process, or `spatial_shape=(1, 1, 1)`)
    it is `keras.layers.Conv3DTranspose`. channels_last only.

    Args:
        filters: number of output channels.
        kernel_size: int or 3 ints.
        strides: int or 3 ints. Defaults to 1.
        padding: 'valid' or 'same'. Defaults to 'valid'.
        output_padding: None (the default), or an int or 3 ints, each less than its
            stride, as for `keras.layers.Conv3DTranspose`.
        dilation_rate: must be 1 (the default).
        Other arguments as `keras.layers.Conv3DTranspose` (activation, use_bias,
        initializers, regularizers, constraints).

    Input shape:
        LOCAL shard `(batch, d, h, w, channels)` of the global input
        (`keras_spatial.halo.split_bounds`).

    Output shape:
        LOCAL shard of the global output of `keras.layers.Conv3DTranspose` (for
        example `(batch, d * sd, h * sh, w * sw, filters)` with padding 'same' and no
        output padding, (sd, sh, sw) being `strides`).

    Raises:
        SpatialNotSupportedError: at construction, for dilation_rate other than 1 or
            data_format='channels_first'; the message names the layer and the values.
        ValueError: at build time, if a spatial extent of the input is unknown, or if a
            split axis's global input or output extent has fewer planes than shards.

    Example:
    ```python
    with strategy.scope():
        x = keras_spatial.Input((64, 64, 64, 16))
        y = SpatialConv3DTranspose(8, 2, strides=2)(x)                  # no communication
        z = SpatialConv3DTranspose(8, 3, strides=2, padding="same")(y)  # halo exchange
    ```
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_channels_last(self)
        _check_supported(self)

    @property
    def exchanges_halos(self) -> bool:
        """False when every input voxel fills its own output block (kernel_size <=
        strides on every axis, no output padding): the shard's transposed convolution
        is then the shard of the whole volume's, with no halo."""
        return self.output_padding is not None or any(
            k > s for k, s in zip(self.kernel_size, self.strides)
        )

    def _output_padding(self, axis: int):
        return None if self.output_padding is None else self.output_padding[axis]

    def _plan_axis(self, axis, global_extent, shards):
        return plan_transposed_axis(
            global_extent, shards, self.kernel_size[axis], self.strides[axis],
            self.padding, self._output_padding(axis),
        )

    def _output_extent(self, axis, global_extent):
        return transposed_output_extent(
            global_extent, self.kernel_size[axis], self.strides[axis], self.padding,
            self._output_padding(axis),
        )

    def blockwise(self, plans) -> bool:
        """Whether each shard's outputs are the transposed convolution of its own inputs
        alone: no halo by the layer's config (`exchanges_halos`) and, on every axis, every
        shard's outputs are `strides` times its inputs (always with equal shards; with
        uneven ones, when the output split lines up with the input split)."""
        return not self.exchanges_halos and all(
            plan.needed == plan.owned
            and all(plan.output_start(j) == 0 for j in range(plan.shards))
            for plan in plans
        )

    def call(self, inputs):
        strategy = active_spatial_strategy()
        if strategy is None:
            return super().call(inputs)
        plans = self.axis_plans(strategy.spatial_shape, inputs.shape)
        if self.blockwise(plans):
            # The transposed convolution of a shard is the shard of the transposed
            # convolution of the volume.
            return super().call(inputs)
        extended = self._extend(inputs, strategy, plans, fill_value=0.0)
        outputs = transposed_convolution_shard(extended, self.kernel, plans, strategy.coords)
        if self.use_bias:
            outputs = ops.add(outputs, ops.reshape(self.bias, (1, 1, 1, 1, self.filters)))
        if self.activation is not None:
            return self.activation(outputs)
        return outputs

    def compute_output_shape(self, input_shape):
        strategy = active_spatial_strategy()
        if strategy is None:
            return super().compute_output_shape(input_shape)
        return self._spatial_output_shape(strategy, input_shape, self.filters)
