"""Spatially split 3D transposed convolution (the up-sampling path of a U-Net)."""

import keras
from keras import ops

from keras_spatial.errors import SpatialNotSupportedError
from keras_spatial.halo import Window
from keras_spatial.layers.spatial_window import (
    SpatialWindowMixin,
    active_spatial_strategy,
    check_channels_last,
)


def as_convolution_kernel(kernel):
    """The `Conv3D` kernel of the convolution equal to a stride-1 transposed convolution.

    A transposed convolution with stride 1 is a convolution with the spatially flipped
    kernel and the channel axes swapped; with an odd kernel its 'same' padding is the
    convolution's 'same' padding, (k - 1) / 2 planes on each side.

    Args:
        kernel: a `Conv3DTranspose` kernel `(kd, kh, kw, filters, in_channels)`.

    Returns:
        A `Conv3D` kernel `(kd, kh, kw, in_channels, filters)`.
    """
    flipped = ops.flip(ops.flip(ops.flip(kernel, axis=0), axis=1), axis=2)
    return ops.transpose(flipped, (0, 1, 2, 4, 3))


def _check_supported(layer) -> None:
    received = (
        f"Received: kernel_size={layer.kernel_size}, strides={layer.strides}, "
        f"padding={layer.padding!r}, dilation_rate={layer.dilation_rate}, "
        f"output_padding={layer.output_padding}, layer={layer.name!r}"
    )
    name = type(layer).__name__
    if layer.output_padding is not None:
        raise SpatialNotSupportedError(
            f"{name} does not support `output_padding`; leave it None. {received}"
        )
    if any(d != 1 for d in layer.dilation_rate):
        raise SpatialNotSupportedError(f"{name} supports only dilation_rate=1. {received}")
    if layer.kernel_size == layer.strides:
        return
    if all(s == 1 for s in layer.strides) and all(k % 2 for k in layer.kernel_size):
        if layer.padding == "same":
            return
    raise SpatialNotSupportedError(
        f"{name} supports kernel_size equal to strides on every axis (each input voxel "
        "fills its own output block, so no halo is needed), or strides=1 with odd "
        f"kernel sizes and padding='same' (a convolution with a halo). {received}"
    )


@keras.saving.register_keras_serializable(package="keras_spatial")
class SpatialConv3DTranspose(SpatialWindowMixin, keras.layers.Conv3DTranspose):
    """3D transposed convolution over a volume split across a spatial group.

    Takes the arguments of `keras.layers.Conv3DTranspose`, of which two kinds of
    configuration are supported, so that the output shards are exactly the output of
    `keras.layers.Conv3DTranspose` on the whole volume:

    - `kernel_size == strides` on every axis (e.g. 2 and 2, the usual U-Net
      up-sampling; 'valid' and 'same' coincide): every input voxel fills its own
      `strides`-sized output block, so each rank computes its output shard locally,
      with no communication.
    - `strides=1`, odd kernel sizes, `padding='same'`: the convolution with the
      spatially flipped kernel (see `as_convolution_kernel`); each rank receives a
      halo of (k - 1) / 2 planes from its neighbours, as `SpatialConv3D` does.

    Without an active spatial strategy (one process, or `spatial_shape=(1, 1, 1)`)
    it is `keras.layers.Conv3DTranspose`. channels_last only.

    Args:
        filters: number of output channels.
        kernel_size: int or 3 ints. Equal to `strides`, or odd with `strides=1`.
        strides: int or 3 ints. Defaults to 1.
        padding: 'valid' or 'same' ('same' when `strides=1`). Defaults to 'valid'.
        output_padding: must be None (the default).
        dilation_rate: must be 1 (the default).
        Other arguments as `keras.layers.Conv3DTranspose` (activation, use_bias,
        initializers, regularizers, constraints).

    Input shape:
        LOCAL shard `(batch, d, h, w, channels)`, where (d, h, w) is the global extent
        divided by the strategy's `spatial_shape`.

    Output shape:
        LOCAL shard `(batch, d * sd, h * sh, w * sw, filters)` of the global output,
        (sd, sh, sw) being `strides`.

    Raises:
        SpatialNotSupportedError: at construction, for any other kernel/stride/padding
            combination (e.g. kernel 3 with stride 2), dilation, `output_padding`, or
            data_format='channels_first'; the message names the layer and the values.
        ValueError: at build time, if a spatial extent of the input is unknown (halo
            configuration only).

    Example:
    ```python
    with strategy.scope():
        x = keras_spatial.Input((64, 64, 64, 16))
        y = SpatialConv3DTranspose(8, 2, strides=2)(x)      # global 128^3, local shard
        z = SpatialConv3DTranspose(8, 3, padding="same")(y)  # halo exchange
    ```
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_channels_last(self)
        _check_supported(self)

    @property
    def exchanges_halos(self) -> bool:
        """False when every input voxel maps to its own output block (kernel ==
        strides): the shard's transposed convolution is then the shard of the whole
        volume's, with no halo."""
        return self.kernel_size != self.strides

    def _windows(self):
        # The equivalent convolution: stride 1, 'same', odd kernel.
        return tuple(Window(k, 1, 1, "same") for k in self.kernel_size)

    def call(self, inputs):
        strategy = active_spatial_strategy()
        if strategy is None or not self.exchanges_halos:
            # Blockwise: the transposed convolution of a shard is the shard of the
            # transposed convolution of the volume.
            return super().call(inputs)
        plans = self.axis_plans(strategy.spatial_shape, inputs.shape)
        extended = self._extend(inputs, strategy, plans, fill_value=0.0)
        outputs = ops.conv(
            extended,
            as_convolution_kernel(self.kernel),
            strides=1,
            padding="valid",
            data_format=self.data_format,
        )
        if self.use_bias:
            outputs = ops.add(outputs, ops.reshape(self.bias, (1, 1, 1, 1, self.filters)))
        if self.activation is not None:
            return self.activation(outputs)
        return outputs

    def compute_output_shape(self, input_shape):
        strategy = active_spatial_strategy()
        if strategy is None or not self.exchanges_halos:
            return super().compute_output_shape(input_shape)
        return self._spatial_output_shape(strategy, input_shape, self.filters)
