"""convolve_halo_parts: TensorFlow's convolution and gradients, bit for bit, without
keeping the extended shard (one process; the halo planes are made locally)."""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from keras_spatial.ops.halo_convolution import convolve_halo_parts  # noqa: E402
from keras_spatial.ops.halo_exchange import HaloParts  # noqa: E402
from tests.allocator_peaks import allocator_peaks  # noqa: E402


def _assemble(x, before, after):
    """As a depth-split rank does: received planes around the shard along depth, zero
    padding on height and width."""
    extended = tf.concat([before, x, after], axis=1)
    return tf.pad(extended, [[0, 0], [0, 0], [1, 1], [1, 1], [0, 0]])


@pytest.mark.parametrize("strides", [(1, 1, 1), (2, 1, 2)])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
def test_matches_tensorflow_convolution_and_its_gradient(strides, graph):
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((2, 6, 7, 8, 3)).astype("float32"))
    before = tf.constant(rng.standard_normal((2, 1, 7, 8, 3)).astype("float32"))
    after = tf.constant(rng.standard_normal((2, 1, 7, 8, 3)).astype("float32"))
    kernel = tf.Variable(rng.standard_normal((3, 3, 3, 3, 4)).astype("float32"))

    def run(recompute):
        with tf.GradientTape() as tape:
            tape.watch([x, before, after])
            if recompute:
                y = convolve_halo_parts(HaloParts([x, before, after], _assemble), kernel, strides)
            else:
                y = tf.nn.conv3d(_assemble(x, before, after), kernel, [1, *strides, 1], "VALID")
            loss = tf.reduce_sum(y * tf.sin(y))
        return [y] + tape.gradient(loss, [x, before, after, kernel])

    if graph:
        run = tf.function(run)
    for actual, expected in zip(run(True), run(False)):
        np.testing.assert_array_equal(actual.numpy(), expected.numpy())


def test_the_extended_shard_is_not_kept_for_the_backward_pass():
    """Peak of TensorFlow's allocator during one step on a kept 8 MiB shard: the plain
    convolution keeps its 9 MiB padded copy until its backward pass, so it is alive at
    the peak (the pool's and LeakyReLU's backward, with the 16 MiB convolution output
    kept for LeakyReLU's gradient); recomputing it lowers the peak by about that copy.
    Own process: TensorFlow's BFC allocator reports peaks."""
    plain, recomputed = allocator_peaks(
        """
        import numpy as np, tensorflow as tf
        from keras_spatial.ops.halo_convolution import convolve_halo_parts
        from keras_spatial.ops.halo_exchange import HaloParts
        tf.config.threading.set_intra_op_parallelism_threads(1)
        def assemble(x):
            return tf.pad(x, [[0, 0], [1, 1], [1, 1], [1, 1], [0, 0]])
        x = tf.constant(np.random.default_rng(0).standard_normal((1, 32, 64, 64, 16)).astype("float32"))
        kernel = tf.Variable(np.full((3, 3, 3, 16, 16), 0.01, "float32"))
        peaks = []
        for recompute in (False, True):
            @tf.function
            def step(x):
                with tf.GradientTape() as tape:
                    if recompute:
                        y = convolve_halo_parts(HaloParts([x], assemble), kernel, (1, 1, 1))
                    else:
                        y = tf.nn.conv3d(assemble(x), kernel, [1] * 5, "VALID")
                    # As in CosmoFlow's first block: the peak is in the pool's backward,
                    # while LeakyReLU's input is kept for its gradient.
                    pooled = tf.nn.avg_pool3d(tf.nn.leaky_relu(y, 0.01), 2, 2, "VALID")
                    loss = tf.reduce_sum(pooled * pooled)
                return tape.gradient(loss, [kernel])
            peaks.append(peak_rise_mib(lambda: [g.numpy() for g in step(x)]))
        print("PEAKS", *peaks)
        """
    )
    padded_mib = 34 * 66 * 66 * 16 * 4 / 2**20
    assert plain - recomputed >= 0.9 * padded_mib, (plain, recomputed)
