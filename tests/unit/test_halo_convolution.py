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


_PEAK_SCRIPT = """
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
            # As in CosmoFlow's first block: LeakyReLU's input is kept for its gradient.
            pooled = tf.nn.avg_pool3d(tf.nn.leaky_relu(y, 0.01), 2, 2, "VALID")
            loss = tf.reduce_sum(pooled * pooled)
        return tape.gradient(loss, [kernel])
    peaks.append(peak_rise_mib(lambda: [g.numpy() for g in step(x)]))
print("PEAKS", *peaks)
"""

PADDED_MIB = 34 * 66 * 66 * 16 * 4 / 2**20


def test_the_extended_shard_is_not_kept_for_the_backward_pass():
    """Peak of TensorFlow's allocator during one step on a kept 8 MiB shard, with oneDNN's
    kernels: the plain convolution keeps its 9 MiB padded copy until its backward pass, so
    it is alive at the peak (the pool's and LeakyReLU's backward, with the 8 MiB
    convolution output kept for LeakyReLU's gradient); recomputing it lowers the peak by
    about that copy. Own process: TensorFlow's BFC allocator reports peaks."""
    plain, recomputed = allocator_peaks(_PEAK_SCRIPT, onednn=True)
    assert plain - recomputed >= 0.9 * PADDED_MIB, (plain, recomputed)


def test_recomputing_the_extended_shard_never_raises_the_peak():
    """With TensorFlow's own (Eigen) kernels the peak lies inside the convolution's
    backward pass, whose scratch memory is many times the shard and where the extended
    shard exists either way: recomputing it must still not raise the peak."""
    plain, recomputed = allocator_peaks(_PEAK_SCRIPT, onednn=False)
    assert recomputed <= plain + 0.05 * PADDED_MIB, (plain, recomputed)


# convolve_with_boundary_planes --------------------------------------------------------------

def _same_padding(size):
    return (size - 1) // 2, size - 1 - (size - 1) // 2


def _boundary_case(spatial_axis, kernel_size, sides, seed):
    rng = np.random.default_rng(seed)
    shape = [2, 6, 7, 5, 3]
    before_planes, after_planes = _same_padding(kernel_size[spatial_axis])

    def planes(count):
        planes_shape = list(shape)
        planes_shape[spatial_axis + 1] = count
        return rng.standard_normal(planes_shape)

    return dict(
        x=rng.standard_normal(shape),
        kernel=rng.standard_normal((*kernel_size, 3, 4)),
        before=planes(before_planes) if sides[0] and before_planes else None,
        after=planes(after_planes) if sides[1] and after_planes else None,
        zeros=(np.zeros_like(planes(before_planes)), np.zeros_like(planes(after_planes))),
    )


def _conv_and_gradients(case, spatial_axis, kernel_size, dtype, graph, boundary):
    """The convolution and the gradients of a nonlinear loss with respect to every input,
    either by convolve_with_boundary_planes or by a 'valid' Conv3D of the extended shard."""
    from keras_spatial.ops.halo_convolution import convolve_with_boundary_planes

    tensors = {k: None if v is None else tf.constant(v, dtype) for k, v in case.items() if k != "zeros"}
    inputs = [v for v in tensors.values() if v is not None]

    def extended():
        before = tensors["before"] if tensors["before"] is not None else tf.constant(case["zeros"][0], dtype)
        after = tensors["after"] if tensors["after"] is not None else tf.constant(case["zeros"][1], dtype)
        padding = [[0, 0]] + [
            [0, 0] if axis == spatial_axis else list(_same_padding(k)) for axis, k in enumerate(kernel_size)
        ] + [[0, 0]]
        return tf.pad(tf.concat([before, tensors["x"], after], spatial_axis + 1), padding)

    def run():
        with tf.GradientTape() as tape:
            tape.watch(inputs)
            if boundary:
                y = convolve_with_boundary_planes(
                    tensors["x"], tensors["before"], tensors["after"], tensors["kernel"], spatial_axis
                )
            else:
                y = tf.nn.conv3d(extended(), tensors["kernel"], [1] * 5, "VALID")
            loss = tf.reduce_sum(y * tf.sin(y))
        return [y] + tape.gradient(loss, inputs)

    return [t.numpy().astype("float64") for t in (tf.function(run) if graph else run)()]


@pytest.mark.parametrize("spatial_axis", [0, 1, 2], ids=["depth", "height", "width"])
@pytest.mark.parametrize("kernel_size", [(3, 3, 3), (5, 3, 1), (4, 2, 3), (3, 4, 5)], ids=str)
@pytest.mark.parametrize("sides", [(1, 1), (1, 0), (0, 1)], ids=["both", "before", "after"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
def test_boundary_planes_give_the_convolution_of_the_extended_shard(spatial_axis, kernel_size, sides, graph):
    """Outputs and gradients (shard, received planes, kernel) against float64: within the
    float32 rounding of TensorFlow's own convolution of the extended shard."""
    case = _boundary_case(spatial_axis, kernel_size, sides, seed=spatial_axis + 10 * sides[0])
    reference = _conv_and_gradients(case, spatial_axis, kernel_size, tf.float64, graph, boundary=False)
    plain = _conv_and_gradients(case, spatial_axis, kernel_size, tf.float32, graph, boundary=False)
    actual = _conv_and_gradients(case, spatial_axis, kernel_size, tf.float32, graph, boundary=True)
    assert len(actual) == len(reference)
    for got, tensorflow, exact in zip(actual, plain, reference):
        assert got.shape == exact.shape
        rounding = np.abs(tensorflow - exact).max()
        assert np.abs(got - exact).max() <= 4 * rounding + 1e-6 * np.abs(exact).max(), (
            np.abs(got - exact).max(), rounding)


@pytest.mark.parametrize("shared_before", [False, True], ids=["different-before", "same-before"])
def test_boundary_planes_of_two_calls_on_the_same_shard_and_kernel_stay_apart(shared_before):
    """The output is updated in place: two calls with the same shard and kernel tensors,
    whose 'same' convolutions TensorFlow merges into one (and, with the same planes
    before the shard, their first correction too), must not add their corrections to
    one buffer. With different planes before the shard they did, before the Snapshot
    got a control dependency; the same-before case passed then too, and guards the
    Snapshot's dependency on every correction."""
    from keras_spatial.ops.halo_convolution import convolve_with_boundary_planes

    rng = np.random.default_rng(3)
    x, planes, first, second = (tf.constant(rng.standard_normal(s).astype("float32"))
                                for s in [(1, 6, 5, 5, 2)] + [(1, 1, 5, 5, 2)] * 3)
    kernel = tf.constant(rng.standard_normal((3, 3, 3, 2, 3)).astype("float32"))
    # (before, after) of each call: different planes before the shard and none after it,
    # or the same planes before it and different ones after it.
    calls = [(planes, first), (planes, second)] if shared_before else [(first, None), (second, None)]

    @tf.function
    def both(x, kernel, calls):
        return [convolve_with_boundary_planes(x, before, after, kernel, 0) for before, after in calls]

    for got, (before, after) in zip(both(x, kernel, calls), calls):
        after = tf.zeros_like(before) if after is None else after  # zeros: the volume's face
        extended = tf.pad(tf.concat([before, x, after], 1), [[0, 0], [0, 0], [1, 1], [1, 1], [0, 0]])
        expected = tf.nn.conv3d(extended, kernel, [1] * 5, "VALID")
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-5, atol=1e-5)


def test_boundary_planes_copy_nothing_of_the_shard_size():
    """No concatenation, padding, slice or scatter of the shard's size, forward or
    backward, in the traced step (the received planes and the kernel are small)."""
    from keras_spatial.ops.halo_convolution import convolve_with_boundary_planes

    rng = np.random.default_rng(4)
    x = tf.constant(rng.standard_normal((1, 16, 12, 12, 4)).astype("float32"))
    planes = tf.constant(rng.standard_normal((1, 1, 12, 12, 4)).astype("float32"))
    kernel = tf.Variable(rng.standard_normal((3, 3, 3, 4, 4)).astype("float32"))

    @tf.function
    def step(x, before, after, d_y):
        with tf.GradientTape() as tape:
            tape.watch([x, before, after])
            y = convolve_with_boundary_planes(x, before, after, kernel, 0)
        return y, tape.gradient(y, [x, before, after, kernel], output_gradients=d_y)

    graph = step.get_concrete_function(x, planes, planes, x).graph
    copies = {"ConcatV2", "Pad", "PadV2", "Slice", "StridedSlice", "TensorScatterAdd",
              "TensorScatterUpdate", "AddN", "Tile", "Transpose", "AddV2", "Add"}
    large = [
        (op.type, op.name) for op in graph.get_operations() if op.type in copies
        for out in op.outputs if out.shape.is_fully_defined() and out.shape.num_elements() >= x.shape.num_elements() // 4
    ]
    assert not large, large
    assert {"InplaceAdd", "Conv3DBackpropInputV2"} <= {op.type for op in graph.get_operations()}
