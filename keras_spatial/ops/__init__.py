"""Differentiable spatial operations: halo exchange, convolution of exchanged halos, gather."""

from keras_spatial.ops.gather import gather_volume
from keras_spatial.ops.halo_convolution import convolve_halo_parts
from keras_spatial.ops.halo_convolution import convolve_with_boundary_planes
from keras_spatial.ops.halo_exchange import HaloParts
from keras_spatial.ops.halo_exchange import exchange_halos
from keras_spatial.ops.halo_exchange import extend_axis
from keras_spatial.ops.halo_exchange import extend_to_halo

__all__ = [
    "HaloParts",
    "convolve_halo_parts",
    "convolve_with_boundary_planes",
    "exchange_halos",
    "extend_axis",
    "extend_to_halo",
    "gather_volume",
]
