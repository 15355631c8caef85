"""CosmoFlow recipe: synthetic lognormal universes with cosmological-parameter labels.

See `recipes.cosmoflow.universe` for the physics and the file format, and
`tools/write_universes.py` for the command-line writer.
"""
