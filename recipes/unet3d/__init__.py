"""3D U-Net recipe: synthetic segmentation volumes (ellipsoids of two classes in noise).

See `recipes.unet3d.segmentation` for the generator and the file format, and
`tools/write_segmentation.py` for the command-line writer.
"""
