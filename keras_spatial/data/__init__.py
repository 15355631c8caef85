"""Spatially sharded input: each rank reads only its hyperslab of every sample.

`HDF5Dataset` describes samples stored in HDF5 files (many per file, or one per file
CosmoFlow style); `distribute_dataset` (also `SpatialStrategy.distribute_dataset`)
turns it into this rank's tf.data pipeline of `(x_local, y)` batches. The sample
order is pure arithmetic in `keras_spatial.data.order`; augmentation by the symmetries
of the cube (`distribute_dataset(augment=...)`) in `keras_spatial.data.augment`.
"""

from keras_spatial.data import augment
from keras_spatial.data.augment import CubeSymmetry
from keras_spatial.data.errors import InvalidDataError
from keras_spatial.data.errors import UnreadableFileError
from keras_spatial.data.files import open_hdf5
from keras_spatial.data.hdf5 import HDF5Dataset
from keras_spatial.data.order import data_group_order
from keras_spatial.data.order import epoch_order
from keras_spatial.data.order import steps_per_epoch
from keras_spatial.data.pipeline import distribute_dataset

__all__ = [
    "CubeSymmetry",
    "HDF5Dataset",
    "InvalidDataError",
    "UnreadableFileError",
    "data_group_order",
    "distribute_dataset",
    "epoch_order",
    "open_hdf5",
    "steps_per_epoch",
]
