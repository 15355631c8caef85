"""keras_spatial: spatial and hybrid data x spatial parallelism for 3D CNNs in Keras 3.

Each sample's volume is split across the ranks of a spatial group; halo exchanges
between neighbours make every layer compute exactly what it would on the whole volume.
"""

from keras_spatial import callbacks
from keras_spatial import data
from keras_spatial import layers
from keras_spatial.batch_norm_statistics import recompute_batch_norm_statistics
from keras_spatial.conversion import to_keras_model
from keras_spatial.errors import SpatialNotSupportedError
from keras_spatial.fused_adam import FusedAdam
from keras_spatial.layers.core import Input
from keras_spatial.mesh import Mesh
from keras_spatial.optimizer import DistributedOptimizer
from keras_spatial.spatialize import spatialize
from keras_spatial.strategy import SpatialStrategy
from keras_spatial.strategy import get_strategy

__version__ = "0.1.0"

__all__ = [
    "DistributedOptimizer",
    "FusedAdam",
    "callbacks",
    "data",
    "Input",
    "Mesh",
    "SpatialNotSupportedError",
    "SpatialStrategy",
    "get_strategy",
    "layers",
    "recompute_batch_norm_statistics",
    "spatialize",
    "to_keras_model",
]
