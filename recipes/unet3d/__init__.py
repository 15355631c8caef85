"""3D U-Net recipe: synthetic segmentation volumes (ellipsoids of two classes in noise).

See `recipes.unet3d.segmentation` for the generator and the file format, and
`tools/write_segmentation.py` for the command-line writer. The network is
`recipes.unet3d.model.build_model` and its metric `recipes.unet3d.model.DiceScore` (both
also importable from `recipes.unet3d`); `python -m recipes.unet3d.train` trains it.

`build_model` and `DiceScore` are imported lazily, on first access, so that the data
writer (which imports `recipes.unet3d.segmentation`) does not load Keras and TensorFlow.
"""

__all__ = ["DiceScore", "build_model"]


def __getattr__(name):
    if name in __all__:
        from recipes.unet3d import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
