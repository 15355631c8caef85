"""Exceptions raised by keras_spatial."""


class SpatialNotSupportedError(NotImplementedError):
    """A layer configuration or layout that spatial parallelism does not support.

    Raised at model-build time, never replaced by a silent fallback.
    """
