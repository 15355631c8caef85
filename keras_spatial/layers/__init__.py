"""Spatially split Keras layers. Each subclasses the Keras layer it replaces."""

from keras_spatial.layers.convolutional import SpatialConv3D
from keras_spatial.layers.core import SpatialInputLayer
from keras_spatial.layers.pooling import SpatialAveragePooling3D
from keras_spatial.layers.pooling import SpatialAvgPool3D
from keras_spatial.layers.pooling import SpatialMaxPool3D
from keras_spatial.layers.pooling import SpatialMaxPooling3D

__all__ = [
    "SpatialConv3D",
    "SpatialInputLayer",
    "SpatialAveragePooling3D",
    "SpatialAvgPool3D",
    "SpatialMaxPool3D",
    "SpatialMaxPooling3D",
]
