"""Differentiable spatial operations: halo exchange and gather."""

from keras_spatial.ops.gather import gather_volume
from keras_spatial.ops.halo_exchange import extend_axis
from keras_spatial.ops.halo_exchange import extend_to_halo

__all__ = ["extend_axis", "extend_to_halo", "gather_volume"]
