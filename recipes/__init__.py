"""Recipes: the CosmoFlow and 3D U-Net models, their synthetic data sets and trainers.

- `recipes.cosmoflow`: lognormal universes, the paper's and MLPerf's CosmoFlow models,
  reference estimators, learning-rate schedules and `python -m recipes.cosmoflow.train`.
- `recipes.unet3d`: ellipsoid segmentation volumes, the 3D U-Net and
  `python -m recipes.unet3d.train`.
- `recipes.writing`: what the data set writers share (seeded streams, atomic HDF5 files,
  resume, a process pool with a progress bar).
- `recipes.cli`: the argparse types and options every command shares, and error
  reporting; `recipes.training`: the training harness of the trainers.
"""
