"""Worker side of the training tests: spatial model.fit vs one process on global batches."""

from __future__ import annotations

import os

import numpy as np

from tests.comparison import excess
from tests.distributed.launcher import worker_setup

RTOL = ATOL = 1e-4  # weights after several optimizer steps (issue 3's acceptance)


def voxel_regression_model(global_shape):
    """conv -> avg pool -> conv -> max pool -> 1x1x1 conv: a per-voxel (sharded) output."""
    import keras

    import keras_spatial as ks

    inputs = ks.Input(global_shape)
    y = ks.layers.SpatialConv3D(4, 3, padding="same", activation="relu")(inputs)
    y = ks.layers.SpatialAveragePooling3D(3, strides=1, padding="same")(y)
    y = ks.layers.SpatialConv3D(4, 3, padding="same", activation="tanh")(y)
    y = ks.layers.SpatialMaxPooling3D(2, strides=1, padding="same")(y)
    y = ks.layers.SpatialConv3D(1, 1)(y)
    return keras.Model(inputs, y)


def cosmoflow_like_model(global_shape):
    """Conv, average pool, batch norm, conv, pool, flatten (gathered), dense head."""
    import keras

    import keras_spatial as ks

    L = ks.layers
    inputs = ks.Input(global_shape)
    y = L.SpatialConv3D(4, 3, padding="same", use_bias=False)(inputs)
    y = L.SpatialBatchNormalization()(y)
    y = keras.layers.LeakyReLU(0.01)(y)
    y = L.SpatialAveragePooling3D(3, strides=2, padding="same")(y)
    y = L.SpatialConv3D(8, 3, padding="same", activation="relu")(y)
    y = L.SpatialAveragePooling3D(2)(y)
    y = L.SpatialFlatten()(y)
    y = keras.layers.Dense(16, activation="relu")(y)
    y = keras.layers.Dense(4)(y)
    return keras.Model(inputs, y)


def unet_like_model(global_shape, classes=3):
    """Conv, batch norm, max pool, conv, transposed conv, concatenate, softmax per voxel."""
    import keras

    import keras_spatial as ks

    L = ks.layers
    inputs = ks.Input(global_shape)
    skip = L.SpatialConv3D(4, 3, padding="same", use_bias=False)(inputs)
    skip = L.SpatialBatchNormalization()(skip)
    skip = keras.layers.ReLU()(skip)
    y = L.SpatialMaxPooling3D(2)(skip)
    y = L.SpatialConv3D(8, 3, padding="same", activation="relu")(y)
    y = L.SpatialConv3DTranspose(4, 2, strides=2)(y)
    y = keras.layers.Concatenate()([y, skip])
    y = L.SpatialConv3D(4, 3, padding="same", activation="relu")(y)
    y = L.SpatialConv3D(classes, 1, activation="softmax")(y)
    return keras.Model(inputs, y)


def mlperf_model(global_shape):
    """The recipe's "mlperf" CosmoFlow (kernel 2 'same': one-sided halos), no dropout."""
    from recipes.cosmoflow.model import build_model

    return build_model(global_shape[0], "mlperf", channels=global_shape[-1], dropout=0.0)


MODELS = {
    "voxel": (voxel_regression_model, "mse", ["mae"]),
    "cosmoflow": (cosmoflow_like_model, "mse", ["mae"]),
    "mlperf": (mlperf_model, "mse", ["mae"]),
    "unet": (unet_like_model, "sparse_categorical_crossentropy", ["accuracy"]),
}


def make_optimizer(kind: str):
    import keras

    if kind == "adam":
        return keras.optimizers.Adam(1e-2)
    if kind == "fused-adam":
        from keras_spatial import FusedAdam

        return FusedAdam(1e-2)
    if kind == "sgd-schedule":
        schedule = keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=2, decay_rate=0.5)
        return keras.optimizers.SGD(schedule, momentum=0.9)
    if kind == "adamw":
        return keras.optimizers.AdamW(1e-2, weight_decay=0.01)
    raise ValueError(kind)


def step_ordered(array, steps, groups, per_group, group):
    """This data group's samples, so that step k of every group together is global
    batch k of the serial run: samples [k*B + group*b, k*B + (group+1)*b)."""
    batch = groups * per_group
    parts = [array[k * batch + group * per_group : k * batch + (group + 1) * per_group] for k in range(steps)]
    return np.concatenate(parts)


def _data(strategy, global_shape, steps, per_group, seed, model_kind="voxel"):
    """Global inputs and targets, and this rank's part (its data group's samples, its
    sub-volume; replicated label vectors are not split spatially)."""
    rng = np.random.default_rng(seed)
    batch = per_group * strategy.data_size
    x = rng.standard_normal((steps * batch, *global_shape)).astype("float32")
    if model_kind in ("cosmoflow", "mlperf"):
        y = np.tanh(x.reshape(len(x), -1)[:, :4] + 0.1).astype("float32")
    elif model_kind == "unet":
        y = np.digitize(x[..., :1], [-0.5, 0.5]).astype("int32")  # 3 classes per voxel
    else:
        y = np.tanh(x[..., :1] * 0.5 + 0.1).astype("float32")

    def local(array, spatial):
        mine = step_ordered(array, steps, strategy.data_size, per_group, strategy.data_index)
        return strategy.shard(mine) if spatial else mine

    return x, y, local(x, True), local(y, model_kind not in ("cosmoflow", "mlperf"))


def _excess(actual, expected) -> float:
    return max(excess(a, b, RTOL, ATOL) for a, b in zip(actual, expected))


def fit_and_compare(strategy, optimizer_kind="adam", steps=5, per_group=2, size=8, model_kind="voxel") -> dict:
    """Train the spatial model for `steps` steps (with validation and evaluate) and, on
    rank 0, the plain Keras twin on the same global batches; return the comparison."""
    import keras

    import keras_spatial as ks
    from keras_spatial.optimizer import update_owners

    keras.utils.set_random_seed(100 + strategy.rank)  # different on purpose: broadcast fixes it
    global_shape = (size, size + 2, size - 2, 2) if model_kind == "voxel" else (size, size, size, 2)
    build, loss, metrics = MODELS[model_kind]
    with strategy.scope():
        model = build(global_shape)
    x, y, x_rank, y_rank = _data(strategy, global_shape, steps, per_group, seed=0, model_kind=model_kind)
    x_val, y_val, x_val_rank, y_val_rank = _data(strategy, global_shape, 2, per_group, seed=1, model_kind=model_kind)

    # "<optimizer>-buckets": gradients averaged in buckets of 4 KiB (many of them);
    # "<optimizer>-sharded": each rank of a spatial group updates its share of the variables.
    optimizer_kind, sharded = optimizer_kind.removesuffix("-sharded"), optimizer_kind.endswith("-sharded")
    optimizer_kind, buckets = optimizer_kind.removesuffix("-buckets"), optimizer_kind.endswith("-buckets")
    model.compile(optimizer=strategy.distribute_optimizer(make_optimizer(optimizer_kind),
                                                          bucket_bytes=4096 if buckets else None,
                                                          shard_update=sharded),
                  loss=loss, metrics=metrics)
    model.optimizer.build(model.trainable_variables)  # broadcasts rank 0's weights
    serial = ks.to_keras_model(model)  # plain Keras, same initial weights
    initial = [w.copy() for w in model.get_weights()]
    history = model.fit(
        x_rank, y_rank, batch_size=per_group, epochs=1, shuffle=False, verbose=0,
        validation_data=(x_val_rank, y_val_rank), callbacks=strategy.callbacks(),
    )
    evaluated = model.evaluate(x_val_rank, y_val_rank, batch_size=per_group, verbose=0,
                               callbacks=strategy.callbacks(), return_dict=True)
    weights = [w.copy() for w in model.get_weights()]
    spread = max(float(np.max(np.abs(strategy.allreduce(w, "average").numpy() - w))) for w in weights)
    result = {
        "spread": spread,
        "replicated": len(model.optimizer._replicated_ids),
        "bucket_bytes": model.optimizer.bucket_bytes,
        "shard_update": model.optimizer.shard_update,
        "owned": sum(owner == strategy.spatial_index for owner in update_owners(
            [v.shape for v in model.trainable_variables], strategy.spatial_size)),
        "variables": len(model.trainable_variables),
        "logs": {k: v[-1] for k, v in history.history.items()},
        "evaluate": evaluated,
    }
    if strategy.rank == 0:
        serial.compile(optimizer=make_optimizer(optimizer_kind), loss=loss, metrics=metrics)
        batch = per_group * strategy.data_size
        serial_history = serial.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
                                    validation_data=(x_val, y_val))
        result["serial_logs"] = {k: v[-1] for k, v in serial_history.history.items()}
        result["serial_evaluate"] = serial.evaluate(x_val, y_val, batch_size=batch, verbose=0, return_dict=True)
        result["weight_excess"] = _excess(weights, serial.get_weights())
        result["moved"] = max(float(np.max(np.abs(a - b))) for a, b in zip(weights, initial))
    strategy.barrier()
    return result


def checkpoint_and_resume(strategy, directory, epochs=2, steps=3, per_group=2, size=8) -> dict:
    """Uninterrupted training vs training resumed from rank 0's epoch-1 checkpoint.

    Rank 0 also saves the input and the gathered prediction of the final model, for the
    pytest process to compare with the checkpoint loaded in one process.
    """
    import keras

    global_shape = (size, size, size, 2)
    x, y, x_rank, y_rank = _data(strategy, global_shape, steps, per_group, seed=2)

    def compiled_model():
        keras.utils.set_random_seed(7)
        with strategy.scope():
            model = voxel_regression_model(global_shape)
        model.compile(optimizer=strategy.distribute_optimizer(keras.optimizers.Adam(1e-2)), loss="mse")
        return model

    model = compiled_model()
    checkpoint = os.path.join(directory, "epoch{epoch}.keras")
    model.fit(x_rank, y_rank, batch_size=per_group, epochs=epochs, shuffle=False, verbose=0,
              callbacks=strategy.callbacks(keras.callbacks.ModelCheckpoint(checkpoint)))
    uninterrupted = model.get_weights()
    strategy.barrier()  # rank 0 has written the checkpoints

    with strategy.scope():
        resumed = keras.saving.load_model(os.path.join(directory, "epoch1.keras"))
    resumed.fit(x_rank, y_rank, batch_size=per_group, epochs=epochs, initial_epoch=1, shuffle=False,
                verbose=0, callbacks=strategy.callbacks())
    resume_difference = max(float(np.max(np.abs(a - b))) for a, b in zip(resumed.get_weights(), uninterrupted))

    predicted = strategy.gather(model.predict(strategy.shard(x[:2]), verbose=0)).numpy()
    if strategy.rank == 0:
        np.savez(os.path.join(directory, "final.npz"), x=x[:2], y=predicted)
    strategy.barrier()
    return {
        "resume_difference": resume_difference,
        "files": sorted(os.listdir(directory)),
        "optimizer": type(resumed.optimizer).__name__,
        "iterations": int(resumed.optimizer.iterations.numpy()),
    }


def early_stopping_agrees(strategy, size=8) -> dict:
    """EarlyStopping on the (world-averaged) loss stops every rank at the same epoch."""
    import keras

    global_shape = (size, size, size, 2)
    x, y, x_rank, y_rank = _data(strategy, global_shape, 2, 1, seed=3)
    keras.utils.set_random_seed(11)
    with strategy.scope():
        model = voxel_regression_model(global_shape)
    model.compile(optimizer=strategy.distribute_optimizer(keras.optimizers.SGD(1e-3)), loss="mse")
    # Per-rank losses differ (different voxels); only their average is comparable.
    stopper = keras.callbacks.EarlyStopping(monitor="loss", min_delta=10.0, patience=1)
    history = model.fit(x_rank, y_rank, batch_size=1, epochs=10, shuffle=False, verbose=0,
                        callbacks=strategy.callbacks(stopper))
    strategy.barrier()
    return {"epochs": len(history.history["loss"]), "losses": history.history["loss"]}


def dropout_head_agrees(strategy, steps=4, per_group=2, size=8) -> dict:
    """A head with Dropout, different seeds on every rank: after fit, weights must still
    be identical on all ranks (head seeds aligned within spatial groups, head gradients
    averaged over data groups only)."""
    import keras

    import keras_spatial as ks

    keras.utils.set_random_seed(200 + strategy.rank)
    L = ks.layers
    global_shape = (size, size, size, 2)
    with strategy.scope():
        inputs = ks.Input(global_shape)
        y = L.SpatialConv3D(4, 3, padding="same", activation="relu")(inputs)
        y = L.SpatialAveragePooling3D(2)(y)
        y = L.SpatialFlatten()(y)
        y = keras.layers.Dropout(0.5)(y)
        y = keras.layers.Dense(16, activation="relu")(y)
        y = keras.layers.Dropout(0.5)(y)
        y = keras.layers.Dense(4)(y)
        model = keras.Model(inputs, y)
    _, _, x_rank, y_rank = _data(strategy, global_shape, steps, per_group, seed=3, model_kind="cosmoflow")
    model.compile(optimizer=strategy.distribute_optimizer(keras.optimizers.Adam(1e-2)), loss="mse")
    model.fit(x_rank, y_rank, batch_size=per_group, epochs=1, shuffle=False, verbose=0,
              callbacks=strategy.callbacks())
    weights = model.get_weights()
    spread = max(float(np.max(np.abs(strategy.allreduce(w, "average").numpy() - w))) for w in weights)
    strategy.barrier()
    return {"spread": spread, "replicated": len(model.optimizer._replicated_ids)}


def run_training_suite(meshes_and_runs, directory=None) -> dict:
    """For each (spatial_shape, runs): a strategy, then each named run on it."""
    worker_setup()
    import keras_spatial as ks

    results = {}
    for spatial_shape, runs in meshes_and_runs:
        strategy = ks.SpatialStrategy(spatial_shape)
        for run in runs:
            key = (tuple(spatial_shape), run)
            if run.startswith("fit-"):  # fit-<model>-<optimizer>
                _, model_kind, optimizer_kind = run.split("-", 2)
                # The "mlperf" model pools by 2 five times: 64^3 is the least a 2-way
                # split keeps aligned; one sample per group and 2 steps keep it quick.
                size = {"mlperf": {"size": 64, "steps": 2, "per_group": 1}}.get(model_kind, {})
                # "-odd": extents that do not divide by the shards (uneven shards): the
                # CosmoFlow-like model on 9^3 (split 5 + 4, then 3 + 2 after its first
                # pool), the U-Net-like one on 10^3 (5 + 5, pooled to 3 + 2, up-sampled
                # back to 5 + 5 through a halo).
                if optimizer_kind.endswith("-odd"):
                    optimizer_kind = optimizer_kind.removesuffix("-odd")
                    size = {"size": {"cosmoflow": 9, "unet": 10}[model_kind]}
                results[key] = fit_and_compare(strategy, optimizer_kind=optimizer_kind,
                                               model_kind=model_kind, **size)
            elif run == "checkpoint":
                path = os.path.join(directory, "x".join(map(str, spatial_shape)))
                os.makedirs(path, exist_ok=True)
                results[key] = checkpoint_and_resume(strategy, path)
            elif run == "early-stopping":
                results[key] = early_stopping_agrees(strategy)
            elif run == "dropout-head":
                results[key] = dropout_head_agrees(strategy)
            else:
                raise ValueError(run)
    strategy.barrier()
    return results
