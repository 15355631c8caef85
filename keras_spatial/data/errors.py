"""Exceptions of the input pipeline: bad content, and files that cannot be read."""


class InvalidDataError(ValueError):
    """The HDF5 files open, but their content does not fit the dataset description.

    Raised for a missing dataset key, shapes that differ between files, a dtype that
    cannot be cast to a number, a label that fits neither as a vector nor as a volume,
    or a volume the mesh cannot split. The message names the file, key and shape.
    """


class UnreadableFileError(OSError):
    """An HDF5 file is missing, not HDF5, truncated or corrupt.

    Raised while the dataset is described (every file is opened once) or, for damage
    that only shows when the data is read, at the first read of the file. The message
    names the file and, where known, the key and the sample.
    """
