"""A plain Keras 3D U-Net, trained spatially: the lines marked `# keras_spatial` are all
that differs from the script one would write for one process.

Each sample (synthetic noisy spheres, 16^3, with their masks) is split in depth over the
2 ranks of a spatial group; the ranks exchange halo planes before every convolution and
pooling and train exactly what one process would train on the whole volumes.

    .venv/bin/horovodrun --gloo -np 2 -H localhost:2 .venv/bin/python examples/spatial_unet.py

Without the marked lines (and with `model.fit(x, y, ...)`), the same script trains the
same model in one process; tests/recipes/test_example.py checks that both end with the same
weights (the 2-rank run against one process on the whole volumes).
"""

import argparse

import keras
import numpy as np

import keras_spatial as ks  # keras_spatial


def unet(size: int = 16, filters: int = 8) -> keras.Model:
    """A two-level 3D U-Net of plain Keras layers, one sigmoid output channel."""
    x = keras.Input((size, size, size, 1))
    c1 = keras.layers.Conv3D(filters, 3, padding="same", activation="relu")(x)
    c2 = keras.layers.Conv3D(2 * filters, 3, padding="same", activation="relu")(keras.layers.MaxPooling3D(2)(c1))
    c2 = keras.layers.BatchNormalization()(c2)
    up = keras.layers.Conv3DTranspose(filters, 2, strides=2)(c2)
    c3 = keras.layers.Conv3D(filters, 3, padding="same", activation="relu")(keras.layers.Concatenate()([c1, up]))
    return keras.Model(x, keras.layers.Conv3D(1, 1, activation="sigmoid")(c3))


def spheres(count: int, size: int = 16, seed: int = 0):
    """`count` volumes of noise with one bright sphere each, and the spheres' masks."""
    rng = np.random.default_rng(seed)
    grid = np.stack(np.meshgrid(*[np.arange(size)] * 3, indexing="ij"), -1)
    masks = []
    for _ in range(count):
        centre, radius = rng.uniform(4, size - 4, 3), rng.uniform(2, 5)
        masks.append(np.linalg.norm(grid - centre, axis=-1) < radius)
    y = np.stack(masks)[..., None].astype("float32")
    x = (y + 0.5 * rng.standard_normal(y.shape)).astype("float32")
    return x, y


def main(argv=None) -> keras.Model:
    """Train; returns the trained model."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)

    keras.utils.set_random_seed(0)
    x, y = spheres(8)
    strategy = ks.SpatialStrategy(spatial_shape=(2, 1, 1))  # keras_spatial
    model = unet()
    model.compile(keras.optimizers.Adam(1e-3), "binary_crossentropy")
    model = strategy.spatialize(model)  # keras_spatial
    model.fit(strategy.shard(x), strategy.shard(y), batch_size=4, epochs=args.epochs, shuffle=False, verbose=2, callbacks=strategy.callbacks())  # keras_spatial
    return model


if __name__ == "__main__":
    main()
