"""Batch-norm statistics of a batch split over several ranks, with their gradient."""

import keras
import tensorflow as tf

from keras_spatial import comm


def global_moments(x, process_set, mask=None):
    """Per-channel mean and variance of `x` over every element the ranks of
    `process_set` hold together (all axes but the last), or over the elements `mask`
    selects.

    Forward: each rank computes its count n_r, mean m_r and sum of squared deviations
    M_r = sum (x - m_r)^2 (two passes over its own data, as `tf.nn.moments`), and ONE
    allgather brings every rank's (n_r, m_r, M_r). They are combined as Chan et al.'s
    parallel algorithm does: mean = sum n_r m_r / N, variance = (sum M_r + sum n_r
    (m_r - mean)^2) / N. No large sums are subtracted, so the result equals the
    two-pass moments of the whole batch to float32 rounding, with one collective where
    a sum followed by a sum of squared deviations from the global mean needs two in a
    row.

    Backward: as for `tf.nn.moments` on the whole batch (the mean is stopped inside the
    variance, whose gradient through the mean is zero anyway): d/dx = dmean / N +
    dvar * 2 (x - mean) / N, where dmean and dvar are the upstream gradients summed
    over the ranks (every rank's loss uses the same statistics): ONE allreduce-SUM.

    Cost: the allgather carries 2 C + 1 floats per rank (C channels), so it grows with
    the number of ranks P, where an allreduce of sums would not: 131 KB for P = 64 and
    C = 256, 2 MB for P = 1024. A single allreduce of sum, sum of squares and count
    (docs/design.md, "Batch-norm statistics") would stay at 2 C + 1 floats but loses
    about mean^2 / variance x float32 epsilon of the variance (an estimate: 5e-3
    relative for a mean of 300 and a standard deviation of 1), which is why it is not
    used.

    With a mask, as `keras.layers.BatchNormalization` with a mask on one device: the
    counts are the numbers of selected positions, the sums run over the selected
    elements only, and mean and variance are divided by (count + `keras.backend.epsilon()`)
    as Keras divides them (a rank that holds no selected element contributes nothing);
    the gradient reaches the selected elements only.

    Args:
        x: a tensor, channels last.
        process_set: the Horovod process set of the ranks sharing the statistics.
        mask: None, or a tensor of the shape of `x` without its last axis, true (or
            non-zero) where an element counts.

    Returns:
        (mean, variance), each of shape (channels,).
    """
    axes = list(range(len(x.shape) - 1))
    channels = x.shape[-1]
    if mask is None:
        weights, epsilon = None, 0.0
    else:
        weights = tf.cast(tf.cast(mask, tf.bool), x.dtype)[..., None]
        epsilon = keras.backend.epsilon()

    @tf.custom_gradient
    def _moments(inputs):
        if weights is None:
            count = tf.cast(tf.reduce_prod(tf.shape(inputs, out_type=tf.int64)[:-1]), inputs.dtype)
            local_mean = tf.reduce_mean(inputs, axis=axes)
            local_deviations = tf.reduce_sum(tf.square(inputs - local_mean), axis=axes)
        else:
            count = tf.reduce_sum(weights)
            local_mean = tf.math.divide_no_nan(tf.reduce_sum(weights * inputs, axis=axes), count)
            local_deviations = tf.reduce_sum(weights * tf.square(inputs - local_mean), axis=axes)
        local = tf.concat([count[None], local_mean, local_deviations], axis=0)
        every_rank = comm.allgather(local[None], process_set, name="ks_moments")
        mark = comm.mark_forward(every_rank)
        counts = every_rank[:, :1]
        means = every_rank[:, 1 : 1 + channels]
        deviations = every_rank[:, 1 + channels :]
        total = tf.reduce_sum(counts)
        exact_mean = tf.math.divide_no_nan(tf.reduce_sum(counts * means, axis=0), total)
        spread = tf.reduce_sum(counts * tf.square(means - exact_mean), axis=0)
        divisor = total + epsilon
        mean = exact_mean if weights is None else exact_mean * (total / divisor)
        variance = (tf.reduce_sum(deviations, axis=0) + spread) / divisor

        def grad(upstream_mean, upstream_variance):
            upstream = [
                tf.zeros_like(mean) if g is None else g
                for g in (upstream_mean, upstream_variance)
            ]
            with comm.backward_of(mark, process_set):
                summed = comm.allreduce(tf.concat(upstream, axis=0), process_set, name="grad")
            d_mean, d_variance = summed[:channels], summed[channels:]
            gradient = d_mean / divisor + d_variance * (2.0 / divisor) * (inputs - mean)
            return gradient if weights is None else weights * gradient

        return (mean, variance), grad

    return _moments(x)
