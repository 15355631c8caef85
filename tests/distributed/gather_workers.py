"""Worker side of the SpatialGather tests: spatial trunk, gather, plain Keras tail."""

import numpy as np

from tests.distributed.launcher import worker_setup


def gathered_model(global_shape):
    import keras

    import keras_spatial as ks

    inputs = ks.Input(global_shape)
    y = ks.layers.SpatialConv3D(4, 3, padding="same", activation="relu")(inputs)
    y = ks.layers.SpatialAveragePooling3D(3, strides=2, padding="same")(y)
    y = ks.layers.SpatialGather()(y)
    y = keras.layers.Conv3D(4, 3, padding="same", activation="relu")(y)
    y = keras.layers.AveragePooling3D(2)(y)
    y = keras.layers.Flatten()(y)
    return keras.Model(inputs, keras.layers.Dense(3)(y))


def compare_with_twin(meshes, global_shape=(8, 8, 8, 2), batch_per_group=2):
    """World-averaged gradients of a replicated-head loss vs the plain twin's."""
    worker_setup()
    import keras
    import tensorflow as tf

    import keras_spatial as ks

    results = {}
    for spatial_shape in meshes:
        strategy = ks.SpatialStrategy(spatial_shape)
        keras.utils.set_random_seed(5)
        with strategy.scope():
            model = gathered_model(global_shape)
        twin = ks.to_keras_model(model)
        batch = batch_per_group * strategy.data_size
        rng = np.random.default_rng(0)
        x = rng.standard_normal((batch, *global_shape)).astype("float32")
        target = rng.standard_normal((batch, 3)).astype("float32")

        @tf.function
        def spatial_step(x_local, t_local):
            with tf.GradientTape() as tape:
                y = model(x_local)
                loss = tf.reduce_mean(tf.square(y - t_local))
            return y, tape.gradient(loss, model.trainable_weights)

        @tf.function
        def twin_step(x_all, t_all):
            with tf.GradientTape() as tape:
                y = twin(x_all)
                loss = tf.reduce_mean(tf.square(y - t_all))
            return y, tape.gradient(loss, twin.trainable_weights)

        per_group = slice(strategy.data_index * batch_per_group, (strategy.data_index + 1) * batch_per_group)
        y, grads = spatial_step(tf.constant(strategy.shard(x, split_batch=True)), tf.constant(target[per_group]))
        # The optimizer's averaging: layers after the gather are replicated, so their
        # gradients are averaged over data groups only (not at all with one data group).
        from keras_spatial.plan import replicated_layers

        optimizer = strategy.distribute_optimizer(keras.optimizers.SGD())
        replicated = [v for layer in replicated_layers(model, strategy) for v in layer.trainable_variables]
        optimizer.set_replicated_variables(replicated)
        partitioned = [g.numpy() for g in optimizer.average_gradients(grads, model.trainable_weights)]
        grads = [strategy.allreduce(g, "average").numpy() for g in grads]
        y_twin, grads_twin = twin_step(tf.constant(x), tf.constant(target))
        results[tuple(spatial_shape)] = {
            "output": float(np.max(np.abs(y.numpy() - y_twin.numpy()[per_group]))),
            "grads": max(
                float(np.max(np.abs(g - r) - (1e-5 + 1e-5 * np.abs(r)))) for g, r in zip(grads, grads_twin)
            ),
            "partitioned_grads": max(
                float(np.max(np.abs(g - r) - (1e-5 + 1e-5 * np.abs(r)))) for g, r in zip(partitioned, grads_twin)
            ),
            "replicated": len(replicated),
            "output_shape": tuple(model.output_shape),
        }
    strategy.barrier()
    return results
