"""Convolution of a shard extended by its halos, without keeping the extended copy.

TensorFlow's gradient of a convolution needs the convolution's input, so a plain
`conv(extend_to_halo(x))` keeps the extended shard (a copy of `x` with the halo planes and
the zero padding around it) alive from the forward pass until the convolution's
backward pass. When `x` is itself kept (a model input, a tensor that a ReLU or a max pool
needs for its own gradient, a U-Net skip connection), that copy is extra memory of the
size of the shard at the moment of the peak. Here the gradient keeps `x` and the
received planes instead, and assembles the extended shard again (slices, one
concatenation, one padding: no communication) just before the convolution's backward
pass. The forward and backward kernels are the ones TensorFlow's own gradient of
Conv3D runs, with the same attributes, so results are bit for bit the same.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from keras_spatial.ops.halo_exchange import HaloParts


def convolve_halo_parts(halo: HaloParts, kernel, strides: Sequence[int]) -> tf.Tensor:
    """A 'valid' Conv3D of `halo.extended()` (channels last, no dilation, one group),
    whose gradient recomputes the extended shard instead of keeping it.

    Args:
        halo: the exchanged halos of a shard (`keras_spatial.ops.halo_exchange.exchange_halos`).
        kernel: the convolution kernel (d, h, w, in_channels, out_channels).
        strides: the 3 spatial strides.

    Returns:
        The convolution of the extended shard, as `tf.nn.conv3d(..., padding="VALID")`.
    """
    strides = [1, *strides, 1]
    kernel = tf.convert_to_tensor(kernel)

    @tf.custom_gradient
    def convolve(*tensors):
        *parts, weights = tensors
        outputs = tf.nn.conv3d(halo.assemble(*parts), weights, strides, "VALID")

        def gradient(d_outputs):
            # Recomputed in the backward pass: the copies depend on the output gradient,
            # so that Grappler cannot merge this assembly with the forward one (which
            # would keep the forward's extended shard alive after all).
            with tf.control_dependencies([d_outputs]):
                copies = [tf.identity(part) for part in parts]
            with tf.GradientTape() as tape:
                tape.watch(copies)
                extended = halo.assemble(*copies)
            # What TensorFlow's registered gradient of Conv3D runs.
            d_extended = tf.raw_ops.Conv3DBackpropInputV2(
                input_sizes=tf.shape(extended), filter=weights, out_backprop=d_outputs,
                strides=strides, padding="VALID",
            )
            d_weights = tf.raw_ops.Conv3DBackpropFilterV2(
                input=extended, filter_sizes=tf.shape(weights), out_backprop=d_outputs,
                strides=strides, padding="VALID",
            )
            d_parts = tape.gradient(extended, copies, output_gradients=d_extended)
            return (*d_parts, d_weights)

        return outputs, gradient

    return convolve(*halo.tensors, kernel)
