"""keras_spatial.cost_model: per-layer counts checked against hand computations.

The tiny model (global 8x8x8x2 input, batch 1 unless stated):
  conv1  3^3 'same', 4 filters, bias: 8^3 x 4 = 2048 outputs x (2 x 27 x 2) = 221,184
         FLOPs + 2048 for the bias. Its input is the data, so the backward pass computes
         the weight gradient only: 221,184 + 2048. 27 x 2 x 4 + 4 = 220 parameters.
  conv2  3^3 'same', 4 -> 4 filters, no bias: 2048 x (2 x 27 x 4) = 442,368 forward,
         twice that backward (input and weight gradients). 432 parameters.
  relu   2048 elements, 1 FLOP each way.
  pool   average 2^3 stride 2: 4^3 x 4 = 256 outputs x 8 taps = 2048 each way; windows stay
         inside every shard of a 2-way split: no exchange.
  flatten, dense 256 -> 3: 2 x 256 x 3 + 3 = 1539 forward, 2 x 1536 + 3 backward; 771
         parameters, replicated on the spatial group when the volume is split.

Halos of conv1 (2 channels, one plane each side):
  2x1x1: local input 4x8x8; each rank receives one 8x8 plane from its neighbour:
         8 x 8 x 2 x 4 bytes = 512 bytes, one message.
  1x2x2: local input 8x4x4; height first: face 8 (depth) x 4 (width) = 32 voxels x 2 x 4
         = 256 bytes; then width, carrying the height halo and padding: face 8 x (4 + 1 +
         1) = 48 voxels x 2 x 4 = 384 bytes. 640 bytes in two messages.
"""

import math

import pytest

keras = pytest.importorskip("keras")

import keras_spatial as ks  # noqa: E402
from keras_spatial import cost_model as cm  # noqa: E402
from keras_spatial.mesh import Mesh  # noqa: E402


def tiny_model():
    x = ks.Input((8, 8, 8, 2), name="x")
    y = ks.layers.SpatialConv3D(4, 3, padding="same", name="conv1")(x)
    y = ks.layers.SpatialConv3D(4, 3, padding="same", use_bias=False, name="conv2")(y)
    y = keras.layers.ReLU(name="relu")(y)
    y = ks.layers.SpatialAveragePooling3D(2, name="pool")(y)
    y = ks.layers.SpatialFlatten(name="flatten")(y)
    y = keras.layers.Dense(3, name="dense")(y)
    return keras.Model(x, y)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def by_name(costs):
    return {c.name: c for c in costs}


def hardware(**changes):
    description = dict(
        name="test", peak_flops=1e12, flop_efficiency=0.5, memory_bandwidth=1e11,
        memory_efficiency=1.0, memory_capacity=2**30, intra_node_latency=5e-7,
        intra_node_bandwidth=1e10, inter_node_latency=1e-6, inter_node_bandwidth=2e9,
        ranks_per_node=2,
    )
    description.update(changes)
    return cm.Hardware(**description)


# ---------------------------------------------------------------- single layers


def test_conv3d_flops_bytes_and_parameters(model):
    costs = by_name(cm.model_costs(model, (1, 1, 1)))
    conv1, conv2 = costs["conv1"], costs["conv2"]
    assert (conv1.forward_flops, conv1.backward_flops, conv1.parameters) == (223232, 223232, 220)
    assert conv1.input_gradient is False
    # forward: read 8^3 x 2 = 1024, write 2048 elements, read 220 weights, 4 bytes each
    assert conv1.forward_bytes == (1024 + 2048) * 4 + 220 * 4 == 13168
    # backward: read upstream 2048 and input 1024, weights 220 read and their gradient written
    assert conv1.backward_bytes == (2048 + 1024) * 4 + 2 * 220 * 4 == 14048
    assert (conv2.forward_flops, conv2.backward_flops, conv2.parameters) == (442368, 884736, 432)
    assert conv2.input_gradient is True


def test_batch_multiplies_flops(model):
    three = by_name(cm.model_costs(model, (1, 1, 1), batch_size=3))["conv2"]
    assert three.forward_flops == 3 * 442368
    assert three.activation_bytes == 3 * 2048 * 4


def test_pooling_relu_and_dense(model):
    costs = by_name(cm.model_costs(model, (1, 1, 1)))
    assert (costs["pool"].forward_flops, costs["pool"].backward_flops) == (2048, 2048)
    assert (costs["relu"].forward_flops, costs["relu"].backward_flops) == (2048, 2048)
    dense = costs["dense"]
    assert (dense.forward_flops, dense.backward_flops, dense.parameters) == (1539, 3075, 771)
    assert (costs["flatten"].forward_flops, costs["x"].forward_flops) == (0, 0)


def test_costs_of_a_split_conv(model):
    conv1 = by_name(cm.model_costs(model, (2, 1, 1)))["conv1"]
    assert conv1.local_shape == (4, 8, 8, 4)
    assert conv1.forward_flops == 223232 // 2
    # reads its 4x8x8x2 shard and the 8x8x2 halo plane
    assert conv1.forward_bytes == (512 + 128 + 1024) * 4 + 220 * 4 == 7536


# ---------------------------------------------------------------- halos


def test_halo_bytes_two_by_one_by_one(model):
    costs = by_name(cm.model_costs(model, (2, 1, 1)))
    conv1, conv2 = costs["conv1"], costs["conv2"]
    assert [conv1.halo_bytes(i) for i in range(2)] == [512, 512]
    assert [conv1.halo_messages(i) for i in range(2)] == [1, 1]
    assert conv1.exchanges[0] == (cm.AxisExchange(0, ((1, 512),), ((1, 512),)),)
    assert [conv2.halo_bytes(i) for i in range(2)] == [1024, 1024]  # 4 channels
    assert costs["pool"].exchanges == ()


def test_halo_bytes_one_by_two_by_two(model):
    conv1 = by_name(cm.model_costs(model, (1, 2, 2)))["conv1"]
    assert [conv1.halo_bytes(i) for i in range(4)] == [640] * 4
    assert [conv1.halo_messages(i) for i in range(4)] == [2] * 4
    # rank (0, 0, 0): its height neighbour is spatial index 2, its width neighbour 1
    assert conv1.exchanges[0] == (
        cm.AxisExchange(1, ((2, 256),), ((2, 256),)),
        cm.AxisExchange(2, ((1, 384),), ((1, 384),)),
    )


def test_halo_and_layer_collectives_scale_with_batch(model):
    costs = by_name(cm.model_costs(model, (2, 1, 1), world_size=2, batch_size=2))
    assert costs["conv1"].halo_bytes(0) == 1024
    assert costs["flatten"].forward_collectives == (cm.Collective("allgather", "spatial", 2048, "gather"),)
    assert costs["flatten"].backward_collectives == (
        cm.Collective("allreduce", "spatial", 2048, "gather gradient"),)


def test_gradient_collectives_follow_the_replicated_rule(model):
    split = cm.model_costs(model, (2, 1, 1), world_size=4)
    assert [c.name for c in split if c.replicated_parameters] == ["dense"]
    assert cm.gradient_collectives(split, Mesh(4, (2, 1, 1))) == [
        cm.Collective("allreduce", "world", (220 + 432) * 4, "gradients"),
        cm.Collective("allreduce", "position", 771 * 4, "replicated gradients"),
    ]
    # one data group: the replicated gradients are final
    one_group = cm.model_costs(model, (2, 1, 1))
    assert cm.gradient_collectives(one_group, Mesh(2, (2, 1, 1))) == [
        cm.Collective("allreduce", "world", (220 + 432) * 4, "gradients")]
    # no split: nothing is replicated, everything is averaged over the world
    data = cm.model_costs(model, (1, 1, 1), world_size=2)
    assert cm.gradient_collectives(data, Mesh(2, (1, 1, 1))) == [
        cm.Collective("allreduce", "world", 1423 * 4, "gradients")]


def test_memory_per_rank(model):
    costs = cm.model_costs(model, (1, 1, 1))
    activations = (1024 + 2048 * 3 + 256 + 256 + 3) * 4
    assert cm.memory_per_rank(costs) == activations + 2 * 2048 * 4 + 1423 * 4 * 4 == 69884


# ---------------------------------------------------------------- times


def test_ring_and_tree_times():
    assert cm.ring_time("allreduce", 10**6, 4, 1e-6, 1e9) == pytest.approx(2 * (0.75e-3 + 3e-6), rel=1e-12)
    assert cm.ring_time("allgather", 10**6, 4, 1e-6, 1e9) == pytest.approx(0.75e-3 + 3e-6, rel=1e-12)
    assert cm.ring_time("allreduce", 10**6, 8, 1e-6, 1e9, "tree") == pytest.approx(
        2 * (7 / 8 * 1e-3 + 3e-6), rel=1e-12)
    assert cm.ring_time("allreduce", 10**6, 1, 1e-6, 1e9) == 0.0
    with pytest.raises(ValueError, match="kind"):
        cm.ring_time("broadcast", 1, 2, 1.0, 1.0)
    with pytest.raises(ValueError, match="algorithm"):
        cm.ring_time("allreduce", 1, 2, 1.0, 1.0, "butterfly")


def test_exchange_time_uses_the_link_between_neighbours(model):
    conv1 = by_name(cm.model_costs(model, (2, 1, 1)))["conv1"]
    mesh = Mesh(2, (2, 1, 1))
    # both ranks on one node: intra-node latency + 512 bytes / 1e10
    assert cm.exchange_time(conv1, mesh, hardware(ranks_per_node=2)) == pytest.approx(5e-7 + 512 / 1e10, rel=1e-12)
    # one rank per node: inter-node, the whole 2e9 node bandwidth for the one rank
    assert cm.exchange_time(conv1, mesh, hardware(ranks_per_node=1)) == pytest.approx(1e-6 + 512 / 2e9, rel=1e-12)


def test_compute_time_is_a_roofline():
    hw = hardware()
    assert cm.compute_time(10**9, 0, hw) == pytest.approx(2e-3, rel=1e-12)  # 1e9 / (1e12 x 0.5)
    assert cm.compute_time(0, 10**9, hw) == pytest.approx(1e-2, rel=1e-12)  # 1e9 / 1e11


def test_predict_step_single_rank_sums_the_layers(model):
    hw = hardware()
    costs = cm.model_costs(model, (1, 1, 1))
    prediction = cm.predict_step(costs, (1, 1, 1), 1, 1, hw)
    expected = sum(cm.compute_time(c.forward_flops, c.forward_bytes, hw)
                   + cm.compute_time(c.backward_flops, c.backward_bytes, hw) for c in costs)
    assert prediction.compute == pytest.approx(expected, rel=1e-12)
    assert (prediction.halo, prediction.gradient_allreduce, prediction.layer_collectives) == (0.0, 0.0, 0.0)
    assert prediction.flops == 223232 * 2 + 442368 * 3 + 2048 * 4 + 1539 + 3075
    assert prediction.step == pytest.approx(prediction.compute + prediction.optimizer, rel=1e-12)


def test_co_running_slowdown_scales_compute_of_ranks_sharing_a_node(model):
    plain, shared = hardware(), hardware(co_running_slowdown=1.25)
    assert (plain.compute_factor(2), shared.compute_factor(1), shared.compute_factor(2)) == (1.0, 1.0, 1.25)
    assert hardware(ranks_per_node=1, co_running_slowdown=1.25).compute_factor(8) == 1.0
    one = [cm.predict_step(model, (1, 1, 1), 1, 1, hw) for hw in (plain, shared)]
    assert one[0] == one[1]  # one rank: nothing shares its node
    two = [cm.predict_step(model, (2, 1, 1), 2, 1, hw) for hw in (plain, shared)]
    assert two[1].compute == pytest.approx(1.25 * two[0].compute, rel=1e-12)
    assert two[1].optimizer == pytest.approx(1.25 * two[0].optimizer, rel=1e-12)
    assert (two[1].halo, two[1].gradient_allreduce) == (two[0].halo, two[0].gradient_allreduce)
    apart = [cm.predict_step(model, (2, 1, 1), 2, 1, hardware(ranks_per_node=1, co_running_slowdown=c))
             for c in (1.0, 1.25)]
    assert apart[0].compute == apart[1].compute


def test_more_ranks_less_compute_per_rank(model):
    hw = hardware()
    layouts = [(1, 1, 1), (2, 1, 1), (2, 2, 1), (2, 2, 2)]
    predictions = [cm.predict_step(model, s, math.prod(s), 1, hw) for s in layouts]
    flops = [p.flops for p in predictions]
    assert flops == sorted(flops, reverse=True) and len(set(flops)) == 4
    compute = [p.compute for p in predictions]
    assert all(a > b for a, b in zip(compute, compute[1:]))
    memory = [p.memory for p in predictions]
    assert all(a > b for a, b in zip(memory, memory[1:]))


def test_convolutions_carry_the_key_of_their_kernel(model):
    costs = by_name(cm.model_costs(model, (2, 1, 1), batch_size=3))
    # conv1 reads the data (no input gradient), conv2 a trainable layer's output.
    assert costs["conv1"].kernel == "Conv3D 3x4x8x8x2 f4 k3x3x3 s1x1x1 same bias nodx"
    assert costs["conv2"].kernel == "Conv3D 3x4x8x8x4 f4 k3x3x3 s1x1x1 same nobias dx"
    assert {c.kernel for c in costs.values() if c.type not in ("SpatialConv3D",)} == {""}
    for cost in costs.values():
        if cost.kernel:
            assert cm.kernel_key(cm.parse_kernel_key(cost.kernel)) == cost.kernel


def test_transposed_convolution_kernel_key_and_bad_keys():
    x = keras.Input((4, 4, 4, 3))
    layer = keras.layers.Conv3DTranspose(5, 2, strides=2, name="up")
    keras.Model(x, layer(x))
    spec = cm.kernel_spec(layer, (4, 4, 4, 3), 1, True)
    assert cm.kernel_key(spec) == "Conv3DTranspose 1x4x4x4x3 f5 k2x2x2 s2x2x2 valid bias dx"
    assert cm.kernel_spec(keras.layers.Dense(2), (4,), 1, True) is None
    for bad in ("Conv3D 1x4x4x4x3", "Conv2D 1x4x4x3 f5 k2x2 s1x1 same bias dx",
                "Conv3D 1x4x4x4x3 f5 k2x2x2 s1x1x1 causal bias dx", "Conv3D 1xax4x4x3 f5 k2 s1 same bias dx"):
        with pytest.raises(ValueError, match="Not a kernel key"):
            cm.parse_kernel_key(bad)


def test_measured_kernel_times_replace_the_roofline_of_their_layers(model):
    costs = cm.model_costs(model, (2, 1, 1), world_size=2)
    conv2 = by_name(costs)["conv2"]
    mesh = Mesh(world_size=2, spatial_shape=(2, 1, 1))
    plain = hardware(op_overhead=1e-5, co_running_slowdown=1.5)
    measured = hardware(op_overhead=1e-5, co_running_slowdown=1.5, kernel_times={conv2.kernel: 0.25})
    # Measured seconds of both passes, plus the overhead of each, times the co-running factor.
    assert cm.layer_time(conv2, mesh, measured).compute == pytest.approx((0.25 + 2e-5) * 1.5, rel=1e-12)
    assert cm.layer_time(conv2, mesh, plain).compute < 0.01
    others = [c for c in costs if c.name != "conv2"]
    assert [cm.layer_time(c, mesh, measured) for c in others] == [cm.layer_time(c, mesh, plain) for c in others]
    # A key of another shape (the 1x1x1 layout's conv2) is not used on this layout.
    serial = by_name(cm.model_costs(model, (1, 1, 1)))["conv2"]
    assert serial.kernel != conv2.kernel
    assert cm.layer_time(serial, Mesh(world_size=1, spatial_shape=(1, 1, 1)), measured).compute < 0.01


def test_predict_step_rejects_a_batch_the_groups_cannot_share(model):
    with pytest.raises(ValueError, match="multiple of the 4 data groups"):
        cm.predict_step(model, (1, 1, 1), 4, 6, hardware())
    with pytest.raises(ValueError, match="collectives"):
        cm.predict_step(model, (1, 1, 1), 1, 1, hardware(), collectives="star")


# ---------------------------------------------------------------- hardware


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("peak_flops", 0, "must be positive"),
        ("memory_bandwidth", -1e9, "must be positive"),
        ("inter_node_latency", float("nan"), "finite number"),
        ("intra_node_bandwidth", float("inf"), "finite number"),
        ("flop_efficiency", 1.5, "at most 1"),
        ("ranks_per_node", 2.5, "integer"),
        ("memory_capacity", "16GB", "finite number"),
        ("op_overhead", -1e-6, "must be positive"),
        ("co_running_slowdown", 0.0, "must be positive"),
        ("name", "", "non-empty string"),
        ("ranks_per_node", True, "finite number"),
        ("kernel_times", [1.0], "must be a dict"),
        ("kernel_times", {"Conv3D": 0.0}, "positive seconds"),
        ("kernel_times", {"Conv3D": float("nan")}, "positive seconds"),
        ("kernel_times", {3: 1.0}, "positive seconds"),
    ],
)
def test_hardware_validation(field, value, message):
    with pytest.raises(ValueError, match=message):
        hardware(**{field: value})


def test_hardware_from_dict_names_missing_and_unknown_fields():
    description = dataclass_dict(hardware())
    assert cm.Hardware.from_dict(description) == hardware()
    del description["peak_flops"]
    description["peak_tflops"] = 15.7
    with pytest.raises(ValueError, match=r"missing fields \['peak_flops'\], unknown fields \['peak_tflops'\]"):
        cm.Hardware.from_dict(description)


def dataclass_dict(value):
    import dataclasses

    return dataclasses.asdict(value)


def test_hardware_shares_the_node_bandwidth():
    hw = hardware(ranks_per_node=4, inter_node_bandwidth=25e9)
    assert hw.rank_network_bandwidth == 6.25e9
    assert hw.link(True) == (1e-6, 6.25e9) and hw.link(False) == (5e-7, 1e10)


# ---------------------------------------------------------------- layouts


def test_spatial_shapes():
    assert cm.spatial_shapes(4) == [(4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 4, 1), (1, 2, 2), (1, 1, 4)]
    assert len(cm.spatial_shapes(64)) == 28


def memory_of(model, shape, world, batch):
    return cm.predict_step(model, shape, world, batch, hardware()).memory


def test_auto_layout_one_worker(model):
    unsplit = memory_of(model, (1, 1, 1), 1, 1)
    choice = cm.auto_layout(model, 1, hardware(), unsplit, global_batch=1)
    assert (choice.spatial_shape, choice.data_groups) == ((1, 1, 1), 1)
    assert choice.explanation.startswith("Chosen: spatial_shape=(1, 1, 1) x 1 data group(s)")
    with pytest.raises(ValueError, match="No layout of 1 ranks"):
        cm.auto_layout(model, 1, hardware(), unsplit - 1, global_batch=1)


# Per-rank memory depends on the samples per rank divided by the shards per sample
# (global batch / world size) plus what is not divided (parameters, the replicated head,
# halos). With a global batch of 2 and a limit one byte below a whole sample on one rank,
# 1 and 2 workers cannot fit (a whole sample's worth per rank), and 4, 8 and 64 workers
# must split each sample over at least 2 of them.


@pytest.mark.parametrize(
    "world, expected",
    [
        (4, ((2, 1, 1), 2)),
        (8, ((4, 1, 1), 2)),
        (64, ((4, 2, 4), 2)),
    ],
)
def test_auto_layout_under_a_memory_limit(model, world, expected):
    limit = memory_of(model, (1, 1, 1), 1, 1) - 1
    choice = cm.auto_layout(model, world, hardware(), limit, global_batch=2)
    assert (choice.spatial_shape, choice.data_groups) == expected
    assert all(p.memory <= limit for p in choice.candidates)
    assert [p.step for p in choice.candidates] == sorted(p.step for p in choice.candidates)
    assert choice.explanation.startswith(f"Chosen: spatial_shape={expected[0]} x 2 data group(s)")


@pytest.mark.parametrize("world", [1, 2])
def test_auto_layout_refuses_when_no_layout_fits(model, world):
    limit = memory_of(model, (1, 1, 1), 1, 1) - 1
    with pytest.raises(ValueError, match=f"No layout of {world} ranks with a global batch of 2 fits"):
        cm.auto_layout(model, world, hardware(), limit, global_batch=2)


def test_auto_layout_without_the_limit_stays_data_parallel(model):
    choice = cm.auto_layout(model, 2, hardware(), global_batch=2)
    assert (choice.spatial_shape, choice.data_groups) == ((1, 1, 1), 2)


def test_auto_layout_rejects_misaligned_layouts(model):
    choice = cm.auto_layout(model, 8, hardware(), global_batch=2)
    # the 4^3 pooled volume cannot be split 8 ways along one axis
    assert {shape for shape, reason in choice.rejected if reason.startswith("not aligned")} == {
        (8, 1, 1), (1, 8, 1), (1, 1, 8)}




def test_in_place_pooling_sends_planes_pooled_over_the_other_axes():
    # 3^3 stride 2 'same' average pooling of 8^3 x 2 on 2x1x1: shard 0's last output reads
    # one plane of shard 1 (leading padding 0), which arrives pooled over height and
    # width: 4 x 4 outputs x 2 channels x 4 bytes = 128 bytes, not the 8 x 8 plane.
    x = ks.Input((8, 8, 8, 2), name="x")
    y = ks.layers.SpatialAveragePooling3D(3, strides=2, padding="same", name="pool")(x)
    costs = by_name(cm.model_costs(keras.Model(x, y), (2, 1, 1)))
    pool = costs["pool"]
    assert [pool.halo_bytes(i) for i in range(2)] == [128, 0]
    assert pool.exchanges[1] == (cm.AxisExchange(0, (), ((0, 128),)),)
    assert pool.forward_flops == 4 * 4 * 4 // 2 * 2 * 27  # 32 outputs per channel x 2 x 27 taps


# ---------------------------------------------------------------- summary(hardware=)


def offline_strategy(spatial_shape, rank=0):
    """A SpatialStrategy of any mesh in one process, for symbolic building only."""
    strategy = ks.SpatialStrategy.__new__(ks.SpatialStrategy)
    strategy._rank = rank
    strategy.mesh = Mesh(world_size=math.prod(spatial_shape), spatial_shape=spatial_shape)
    return strategy


def test_summary_with_hardware_prints_the_predicted_times_of_every_layer():
    strategy = offline_strategy((2, 1, 1))
    with strategy.scope():
        local_model = tiny_model()
    slow = hardware(peak_flops=1e8, memory_bandwidth=1e8)  # milliseconds per layer
    printed = []
    strategy.summary(local_model, print_fn=printed.append, hardware=slow, batch_size=2)
    text = printed[0]
    assert "Total activation memory per rank" in text and "Predicted on 'test'" in text
    expected = cm.predict_step(tiny_model, (2, 1, 1), 2, 2, slow)
    assert f"step {expected.step * 1e3:.3f} ms" in text
    predictions = text.splitlines()[next(i for i, line in enumerate(text.splitlines())
                                         if line.startswith("Predicted on")):]
    costs = cm.model_costs(tiny_model, (2, 1, 1), batch_size=2)
    for cost in costs:
        line = next(line for line in predictions if line.startswith(cost.name + " "))
        total = cm.layer_time(cost, strategy.mesh, slow).total
        assert line.split()[5] == f"{total * 1e3:.3f}"
    assert sum(cm.layer_time(c, strategy.mesh, slow).total > 1e-3 for c in costs) >= 2  # both convolutions
    # A model built with no strategy gives the same prediction.
    again = []
    strategy.summary(tiny_model(), print_fn=again.append, hardware=slow, batch_size=2)
    assert again == printed


def test_summary_accepts_profiles_dicts_and_json_files(tmp_path):
    strategy = offline_strategy((1, 1, 1))
    for description in ("lassen", cm.dataclasses.asdict(hardware())):
        printed = []
        strategy.summary(tiny_model(), print_fn=printed.append, hardware=description)
        assert "Predicted on" in printed[0]
    path = tmp_path / "machine.json"
    path.write_text(cm.json.dumps(cm.dataclasses.asdict(hardware(name="measured"))))
    printed = []
    strategy.summary(tiny_model(), print_fn=printed.append, hardware=str(path))
    assert "Predicted on 'measured'" in printed[0]


@pytest.mark.parametrize(
    "description, message",
    [
        ("no-such-machine", "neither a profile"),
        (3.5, "`hardware` must be a keras_spatial.cost_model.Hardware"),
        ({"name": "x"}, "missing fields"),
    ],
)
def test_summary_with_a_bad_hardware_description_fails_clearly(description, message):
    with pytest.raises(ValueError, match=message):
        offline_strategy((1, 1, 1)).summary(tiny_model(), print_fn=None, hardware=description)


def test_a_bad_hardware_file_fails_clearly(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="Cannot read the hardware description"):
        cm.as_hardware(str(path))
    path.write_text(cm.json.dumps({**cm.dataclasses.asdict(hardware()), "peak_flops": -1}))
    with pytest.raises(ValueError, match="`peak_flops` must be positive"):
        cm.as_hardware(path)


# ---------------------------------------------------------------- auto layout of the recipes


def cosmoflow_32(gather_before_block=None):
    from recipes.cosmoflow.model import build_model

    return build_model(32, gather_before_block=gather_before_block)


def unet_32():
    from recipes.unet3d.model import build_model

    return build_model((32, 32, 32, 1), depth=2, base_filters=4, batch_norm=True)


def cosmoflow_variants():
    """The 32^3 CosmoFlow with its split stopping before each of blocks 3-5, or never."""
    return {g: (lambda g=g: cosmoflow_32(g)) for g in (None, 5, 4, 3)}


# A global batch of 2 (1 on one worker) and a limit one byte below the memory of one
# whole sample on one rank: 1 and 2 workers cannot fit (each rank holds a whole
# sample's worth), 4, 8 and 64 workers must split every sample.
@pytest.mark.parametrize("name, build", [("cosmoflow", cosmoflow_variants), ("unet", unet_32)])
@pytest.mark.parametrize("world", [1, 2, 4, 8, 64])
def test_auto_layout_of_the_recipes_splits_under_a_memory_limit(name, build, world):
    model = build()
    machine = cm.as_hardware("lassen")
    whole = cosmoflow_32() if name == "cosmoflow" else model
    limit = cm.predict_step(whole, (1, 1, 1), 1, 1, machine).memory - 1
    batch = min(world, 2)
    if world <= 2:
        with pytest.raises(ValueError, match=f"No layout of {world} ranks .* over the memory limit"):
            cm.auto_layout(model, world, machine, limit, global_batch=batch)
        return
    choice = cm.auto_layout(model, world, machine, limit, global_batch=batch)
    assert math.prod(choice.spatial_shape) * choice.data_groups == world
    assert math.prod(choice.spatial_shape) >= 2 and choice.data_groups <= 2
    assert choice.prediction.memory <= limit
    fitting = [p.step for p in choice.candidates]
    assert choice.prediction.step == min(fitting) and fitting == sorted(fitting)
    assert all(p.memory <= limit for p in choice.candidates)


def test_auto_layout_chooses_where_the_split_stops_among_variants():
    machine = cm.as_hardware("lassen")
    variants = cosmoflow_variants()
    choice = cm.auto_layout(variants, 8, machine, global_batch=1)
    assert choice.variant in variants and math.prod(choice.spatial_shape) == 8
    # 32^3 halves five times to 1^3: an 8-way split along one axis must stop early.
    assert not (choice.variant is None and max(choice.spatial_shape) == 8)
    alone = cm.auto_layout(variants[choice.variant], 8, machine, global_batch=1)
    assert alone.prediction.step == choice.prediction.step
    assert choice.explanation.startswith(f"Chosen ({choice.variant}):")


def test_plan_layout_auto_prints_the_choice_and_its_plan(capsys):
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools", "plan_layout.py")
    spec = importlib.util.spec_from_file_location("plan_layout", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main(["--model", "unet", "--size", "32", "--auto", "--world-size", "4",
                      "--batch-size", "2", "--hardware", "lassen", "--memory-limit", "0.4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Chosen: spatial_shape=") and "Layout plan: spatial_shape=" in out
    assert "Predicted on 'Lassen-like" in out
    assert tool.main(["--model", "unet", "--size", "32", "--auto", "--world-size", "1",
                      "--hardware", "lassen", "--memory-limit", "0.001"]) == 1
    assert "No layout of 1 ranks" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tool.main(["--auto", "--world-size", "4"])
    assert "--auto needs --hardware" in capsys.readouterr().err


def test_the_trainers_choose_layout(monkeypatch, capsys):
    from recipes import training
    from recipes.cli import BadArgument

    monkeypatch.setenv("HOROVOD_SIZE", "4")
    monkeypatch.setenv("HOROVOD_RANK", "0")
    limit = cm.predict_step(unet_32(), (1, 1, 1), 1, 1, cm.as_hardware("lassen")).memory - 1
    shape, variant = training.choose_layout(unet_32, 2, "lassen", limit / 2**30)
    assert math.prod(shape) == 2 and variant is None
    assert "--spatial auto on 'Lassen-like" in capsys.readouterr().out
    with pytest.raises(BadArgument, match="--spatial auto needs --hardware"):
        training.choose_layout(unet_32, 2, None)
    with pytest.raises(BadArgument, match="--spatial auto: `hardware` 'nowhere' is neither a profile"):
        training.choose_layout(unet_32, 2, "nowhere")
    with pytest.raises(BadArgument, match="--spatial auto: No layout of 4 ranks"):
        training.choose_layout(unet_32, 2, "lassen", 1e-6)
