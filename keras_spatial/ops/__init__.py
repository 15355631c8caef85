"""Differentiable spatial operations: halo exchange, convolution and pooling of exchanged
halos, global reductions, batch-norm moments, gather."""

from keras_spatial.ops.batch_norm_moments import global_moments
from keras_spatial.ops.gather import gather_volume
from keras_spatial.ops.global_reductions import global_max
from keras_spatial.ops.global_reductions import global_mean
from keras_spatial.ops.halo_convolution import boundary_plane_axis
from keras_spatial.ops.halo_convolution import convolve_halo_parts
from keras_spatial.ops.halo_convolution import convolve_with_boundary_planes
from keras_spatial.ops.halo_exchange import HaloParts
from keras_spatial.ops.halo_exchange import exchange_halos
from keras_spatial.ops.halo_exchange import extend_axis
from keras_spatial.ops.halo_exchange import extend_to_halo
from keras_spatial.ops.halo_exchange import slice_axis
from keras_spatial.ops.halo_pooling import border_scale
from keras_spatial.ops.halo_pooling import in_place_layout
from keras_spatial.ops.halo_pooling import pool_shard_in_place

__all__ = [
    "HaloParts",
    "border_scale",
    "boundary_plane_axis",
    "convolve_halo_parts",
    "convolve_with_boundary_planes",
    "exchange_halos",
    "extend_axis",
    "extend_to_halo",
    "gather_volume",
    "global_max",
    "global_mean",
    "global_moments",
    "in_place_layout",
    "pool_shard_in_place",
    "slice_axis",
]
