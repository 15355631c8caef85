"""Spatially split Keras layers. Each subclasses the Keras layer it replaces."""

from keras_spatial.layers.convolutional import SpatialConv3D
from keras_spatial.layers.convolutional_transpose import SpatialConv3DTranspose
from keras_spatial.layers.core import SpatialInputLayer
from keras_spatial.layers.gather import SpatialGather
from keras_spatial.layers.global_pooling import SpatialGlobalAveragePooling3D
from keras_spatial.layers.global_pooling import SpatialGlobalMaxPooling3D
from keras_spatial.layers.normalization import SpatialBatchNormalization
from keras_spatial.layers.pooling import SpatialAveragePooling3D
from keras_spatial.layers.pooling import SpatialAvgPool3D
from keras_spatial.layers.pooling import SpatialMaxPool3D
from keras_spatial.layers.pooling import SpatialMaxPooling3D
from keras_spatial.layers.reshaping import SpatialFlatten
from keras_spatial.layers.upsampling import SpatialUpSampling3D

__all__ = [
    "SpatialConv3D",
    "SpatialConv3DTranspose",
    "SpatialInputLayer",
    "SpatialBatchNormalization",
    "SpatialFlatten",
    "SpatialGather",
    "SpatialGlobalAveragePooling3D",
    "SpatialGlobalMaxPooling3D",
    "SpatialAveragePooling3D",
    "SpatialAvgPool3D",
    "SpatialMaxPool3D",
    "SpatialMaxPooling3D",
    "SpatialUpSampling3D",
]
