"""HDF5 files -> distribute_dataset -> spatial model -> model.fit, on every rank."""

import numpy as np

from tests.distributed.launcher import worker_setup


def fit_from_files(pattern, spatial_shape, epochs=2):
    worker_setup()
    import keras

    import keras_spatial as ks

    strategy = ks.SpatialStrategy(spatial_shape)
    files = ks.data.HDF5Dataset(pattern, x="full", y="unitPar", preprocess=np.log1p)
    ds = strategy.distribute_dataset(files, batch_size=2, shuffle=True, seed=0)
    with strategy.scope():
        x = ks.Input(files.sample_shape)
        y = ks.layers.SpatialConv3D(4, 3, padding="same", activation="relu")(x)
        y = ks.layers.SpatialAveragePooling3D(3, strides=2, padding="same")(y)
        y = ks.layers.SpatialGlobalAveragePooling3D()(y)
        model = keras.Model(x, keras.layers.Dense(4)(y))
    model.compile(optimizer=strategy.distribute_optimizer(keras.optimizers.Adam(1e-2)), loss="mse", metrics=["mae"])
    history = model.fit(ds, epochs=epochs, shuffle=False, verbose=0, callbacks=strategy.callbacks())
    weights = model.get_weights()
    spread = max(float(np.max(np.abs(strategy.allreduce(w, "average").numpy() - w))) for w in weights)
    strategy.barrier()
    return {"history": history.history, "spread": spread}
