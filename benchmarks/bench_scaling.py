"""Benchmark: strong scaling of one training step, spatial vs threads vs data parallel.

Full run (about 25 minutes on a quiet 2-core machine: 3 rounds of 8 minutes; writes the
`bench_scaling` section of docs/benchmarks.md and docs/bench_scaling.png):

    .venv/bin/python benchmarks/bench_scaling.py

Smoke test (32^3, 2 warm-up and 2 timed steps; writes to a temporary directory unless
--out/--plot are given):

    .venv/bin/python benchmarks/bench_scaling.py --quick

For each model -- the paper's CosmoFlow at 64^3 and 128^3 and a 3D U-Net (the paper's
structure at 1/4 of its width) at 64^3 -- it times one training step of ONE sample per
data group (forward with training=True, MSE loss, backward, Adam update with the fused
world-average of the gradients) in each configuration:

* 1 rank, 1 thread (the baseline: a plain `python` process, a world of one, no Horovod);
* 1 rank, 2 threads (the same process with 2 intra-op threads);
* 2 ranks, spatial 2x1x1 and 1x2x1 (one sample split in depth / in height);
* 2 ranks, data parallel (spatial 1x1x1, one sample per rank);
* 4 ranks, spatial 4x1x1 (--four-way), oversubscribed on a 2-core machine. The paper's
  CosmoFlow cannot split its last volumes 4 ways, so it is gathered before the first
  block that cannot be split (the config column says which).

Every rank runs ONE TensorFlow intra-op thread and one inter-op thread (set before
TensorFlow starts) with OMP_NUM_THREADS=1, except the 2-thread configuration. Each
configuration is a separate job (horovodrun --gloo for several ranks), driven by this
script. Step time = median over the timed steps of the slowest rank's step (warm-up
steps excluded). In the same job it then times, with the same shapes and the same code
paths, (a) the fused gradient allreduce alone (`keras_spatial.comm.grouped_allreduce` of
tensors shaped like the trainable variables, over the world) and (b) every halo exchange
of the model alone, forward and backward (each spatial window layer's own
`_extend` -> `keras_spatial.ops.halo_exchange.extend_to_halo` on a tensor of its local
input shape, with a random upstream gradient of the extended shape; for a convolution
that convolves its shard where it lies, the alltoall of its halo planes, `exchange_axis`;
for a pooling layer that pools its shard in place, the alltoall of the planes its
neighbours need, pooled over the other axes, `exchange_axis`). The shares in the
table are those isolated medians divided by the step time; overlap with computation is
not accounted for.

Every configuration runs --rounds times (default 3), in turn: round 1 of every
configuration, then round 2, and so on, so that a slow spell of the machine touches
several configurations instead of all the rounds of one. A row gives the round with the
median step and the range over the rounds; the target verdicts use the medians and also
say, round by round, how often the target was met. One round is not enough on a shared
2-core machine: in seven single runs of the same CosmoFlow 128^3 configurations, the
2x1x1 speedup ranged from 1.55 to 1.86 (docs/benchmarks.md, "Run-to-run variation").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as common  # noqa: E402  (sets sys.path and TF's log level first)
from recipes import cli  # noqa: E402  (the project's argparse types)

SECTION = "bench_scaling"
# Above these, the verdicts carry a caution: cores other processes used just before a
# configuration, share of CPU time the hypervisor took during it.
OTHERS_LIMIT = 0.2
STOLEN_LIMIT = 0.05
DEFAULT_MODELS = "cosmoflow:64,cosmoflow:128,unet:64"
QUICK_MODELS = "cosmoflow:32,unet:32"
DEFAULT_PLOT = os.path.join(common.REPO_ROOT, "docs", "bench_scaling.png")
QUICK_DIRECTORY = common.QUICK_DIRECTORY
# argparse type of --four-way (here and in profile_step.py).
four_way_shape = cli.extents("--four-way", 1, "three positive integers D,H,W (e.g. 4,1,1)")
# key -> (label, ranks, threads per rank, spatial shape or None for --four-way)
CONFIGS = {
    "serial": ("1 rank, 1 thread", 1, 1, (1, 1, 1)),
    "threads2": ("1 rank, 2 threads", 1, 2, (1, 1, 1)),
    "spatial2x1x1": ("spatial 2x1x1", 2, 1, (2, 1, 1)),
    "spatial1x2x1": ("spatial 1x2x1", 2, 1, (1, 2, 1)),
    "spatial1x1x2": ("spatial 1x1x2", 2, 1, (1, 1, 2)),
    "data2": ("data parallel, 2 ranks (1 sample each)", 2, 1, (1, 1, 1)),
    "spatial4": (None, 4, 1, None),
}


# Worker (one rank) -------------------------------------------------------------------------
def _timed(fn, calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _halo_exchange_fn(strategy, model, seed: int):
    """(callable running every halo exchange of `model` forward+backward once, number of
    spatial window layers, number of them that receive planes from a neighbour).

    Each layer's exchange is what the layer runs: the extension of its shard
    (`extend_to_halo` with the layer's plans, as `layer._extend`: alltoall, assembling,
    padding), or, for a convolution that convolves its shard where it lies, the alltoall
    of the planes only (`exchange_axis` on the shard), or, for a pooling layer that pools
    its shard in place, the alltoall of the planes its neighbours need, pooled over the
    other axes (`exchange_axis` on a tensor of that reduced shape).
    """
    import numpy as np
    import tensorflow as tf

    from keras_spatial.layers.convolutional import SpatialConv3D
    from keras_spatial.layers.pooling import SpatialMaxPooling3D
    from keras_spatial.ops.halo_convolution import boundary_plane_axis
    from keras_spatial.ops.halo_pooling import in_place_layout
    from keras_spatial.layers.spatial_window import SpatialWindowMixin
    from keras_spatial.ops.halo_exchange import exchange_axis, extend_to_halo, flat_exchange

    rng = np.random.default_rng(seed)
    # layers: (plans, fill value or, for an in-place pool, its exchanging axis, whether only
    # an in-place pool's planes are exchanged, whether the layer receives planes at all).
    layers, inputs, upstream = [], [], []
    for layer in model.layers:
        if not isinstance(layer, SpatialWindowMixin) or not layer.exchanges_halos:
            continue
        shape = (1,) + tuple(layer.input.shape[1:])
        plans = layer.axis_plans(strategy.spatial_shape, shape)
        is_max = isinstance(layer, SpatialMaxPooling3D)
        in_place = None
        if hasattr(layer, "pool_size"):
            in_place = in_place_layout(plans, strategy.coords, "max" if is_max else "average")
        elif isinstance(layer, SpatialConv3D):
            axis = boundary_plane_axis(plans, layer.kernel_size, layer.strides, layer.dilation_rate,
                                        layer.padding, layer.groups)
            if axis is not None:  # convolved where it lies: only the planes are exchanged
                layers.append((plans, axis, True, True))
                upstream.append(None)
                inputs.append(tf.constant(rng.standard_normal(shape).astype("float32")))
                continue
        if in_place is not None:
            axis = in_place[0]
            if axis is None:  # pooled where it lies, nothing exchanged
                continue
            coords = strategy.coords
            shape = (1,) + tuple(shape[1 + b] if b == axis else plans[b].local_output_extent(coords[b])
                                 for b in range(3)) + (shape[-1],)
            layers.append((plans, axis, True, True))
            upstream.append(None)
        else:
            fill = float("-inf") if is_max else 0.0
            extended = (1,) + tuple(p.extended_extent(c) for p, c in zip(plans, strategy.coords)) + (shape[-1],)
            layers.append((plans, fill, False, any(p.exchanges for p in plans)))
            upstream.append(tf.constant(rng.standard_normal(extended).astype("float32")))
        inputs.append(tf.constant(rng.standard_normal(shape).astype("float32")))
    if not layers:
        return None, 0, 0

    def run_one(index, plans, extra, x, planes_only):
        # Each exchange gets its own collective name: the exchanges here do not depend on
        # each other's data, so several can be in flight at once (control dependencies do
        # not order the gradient's collectives), and Horovod pairs the ranks' collectives
        # by name.
        name = f"bench_halo{index}"
        if not planes_only:
            return extend_to_halo(x, plans, strategy.mesh, strategy.coords,
                                  strategy.spatial_process_set, fill_value=extra, name=name)
        before, after = exchange_axis(x, extra, plans[extra], strategy.mesh, strategy.coords,
                                      strategy.spatial_process_set, name=name,
                                      flatten=flat_exchange(plans))
        return tf.concat(before + after, axis=extra + 1)

    def after(token, t):
        # `t`, but only once `token` (a scalar read of the previous exchange's result) is
        # computed: a data dependency without copying `t`. Control dependencies do not
        # order the collectives that automatic differentiation creates.
        return tf.cond(token > float("-inf"), lambda: tf.identity(t), lambda: t)

    def read(t):
        # A scalar computed from `t` (its corner, and its extent for an empty `t`).
        return tf.reduce_max(tf.concat([tf.reshape(t[:1, :1, :1, :1, :1], [-1]),
                                        tf.cast(tf.shape(t)[1:2], t.dtype)], axis=0))

    @tf.function(jit_compile=False)
    def exchange(xs, gs):
        # As in the model, one exchange at a time: forward in layer order, then backward
        # in reverse order, each after the previous one finished.
        # Independent exchanges in one graph would otherwise be negotiated by Horovod
        # together and hide the per-collective latency the real step pays.
        tapes, extended, inputs_used, token = [], [], [], tf.constant(0.0)
        for index, ((plans, extra, planes_only, _), x) in enumerate(zip(layers, xs)):
            with tf.GradientTape() as tape:
                x = after(token, x)
                tape.watch(x)
                extended.append(run_one(index, plans, extra, x, planes_only))
            tapes.append(tape)
            inputs_used.append(x)
            token = read(extended[-1])
        grads = [None] * len(xs)
        for index in reversed(range(len(xs))):
            g = gs[index] if gs[index] is not None else tf.ones_like(extended[index])
            grads[index] = tapes[index].gradient(extended[index], inputs_used[index],
                                                 output_gradients=after(token, g))
            token = read(grads[index])
        # Every result is an output, so that every rank runs every collective. A read of a
        # corner of each instead would let Grappler drop the collectives whose
        # corner lay outside the received planes or whose received block is statically
        # empty, differently on each rank, and a rank would then wait for ever.
        return extended + grads

    def run():
        exchange(inputs, upstream)  # returns once every exchange has finished

    return run, len(layers), sum(e for *_, e in layers)


def _allreduce_fn(optimizer, variables, seed: int):
    """A callable running the step's gradient averaging once on gradient-shaped tensors:
    `DistributedOptimizer.average_gradients`, the very code of the step (the world
    average, except for variables declared replicated, averaged over data groups only)."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    tensors = [tf.constant(rng.standard_normal(v.shape).astype("float32")) for v in variables]

    @tf.function(jit_compile=False)
    def allreduce(ts):
        averaged = optimizer.average_gradients(ts, variables)
        return tf.add_n([tf.reduce_sum(tf.reshape(t, [-1])[:1]) for t in averaged])

    return lambda: allreduce(tensors).numpy()


def worker(spec: dict) -> None:
    strategy, say = common.start_worker(spec)
    import numpy as np
    training = common.make_training_step(strategy, spec, spec["optimizer"], seed=strategy.rank)
    say(f"{training.model.name}: {training.model.count_params():,} parameters, local input "
        f"{common.shape_text(training.x.shape[1:])}")
    for index in range(spec["warmup"]):
        start = time.perf_counter()
        loss = training.run()
        say(f"warm-up {index + 1}/{spec['warmup']}: {time.perf_counter() - start:.3f} s (loss {loss:.4g})")
    common.barrier(strategy, "steps")
    step_times, cpu_times, losses = [], [], []
    for index in range(spec["steps"]):
        start, cpu_start = time.perf_counter(), time.process_time()
        losses.append(training.run())
        step_times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)  # all threads of this process
        say(f"step {index + 1}/{spec['steps']}: {step_times[-1]:.3f} s "
            f"(this process used {cpu_times[-1] / step_times[-1]:.2f} cores)")
    if not np.all(np.isfinite(losses)):
        raise RuntimeError(f"non-finite loss on rank {strategy.rank}: {losses}")

    repeats = spec["component_repeats"]
    allreduce_times = halo_times = None
    if strategy.size > 1:
        run_allreduce = _allreduce_fn(training.optimizer, training.model.trainable_variables, strategy.rank)
        run_allreduce(), run_allreduce()  # trace, warm up
        common.barrier(strategy, "allreduce")
        allreduce_times = _timed(run_allreduce, repeats)
        say(f"gradient allreduce alone: median {common.median(allreduce_times):.4f} s (this rank)")
    window_layers = exchanging_layers = 0
    if strategy.is_spatial:
        run_halo, window_layers, exchanging_layers = _halo_exchange_fn(strategy, training.model, strategy.rank)
        if run_halo is not None:
            run_halo(), run_halo()
            common.barrier(strategy, "halo")
            halo_times = _timed(run_halo, repeats)
            say(f"halo exchanges alone ({exchanging_layers} of {window_layers} window layers exchange): "
                f"median {common.median(halo_times):.4f} s (this rank)")
    replicated = training.optimizer._replicated_ids if strategy.data_size == 1 else frozenset()
    gradient_bytes = 4 * sum(int(np.prod(v.shape)) for v in training.model.trainable_variables
                             if id(v) not in replicated)
    result = {
        "rank": strategy.rank,
        "step_times": step_times,
        "cpu_times": cpu_times,
        "allreduce_times": allreduce_times,
        "halo_times": halo_times,
        "window_layers": window_layers,
        "exchanging_layers": exchanging_layers,
        "parameters": int(training.model.count_params()),
        "gradient_bytes": gradient_bytes,
        "local_input": list(training.x.shape[1:]),
        "losses": losses,
    }
    results = common.gather_results(strategy, result, "scaling")
    if strategy.rank == 0:
        common.write_result(spec, results)


# Driver ----------------------------------------------------------------------------------
def _slowest_rank_median(per_rank: list[list[float]]) -> float:
    """Median over calls of the slowest rank's time of each call."""
    return common.median([max(times) for times in zip(*per_rank)])


def summarize(spec: dict, per_rank: list[dict]) -> dict:
    step = _slowest_rank_median([r["step_times"] for r in per_rank])
    row = dict(spec, step=step, samples_per_step=spec["ranks"] // spec["spatial_size"],
               parameters=per_rank[0]["parameters"], gradient_bytes=per_rank[0]["gradient_bytes"],
               window_layers=per_rank[0]["window_layers"], exchanging_layers=per_rank[0]["exchanging_layers"],
               local_input=per_rank[0]["local_input"])
    row["allreduce"] = (_slowest_rank_median([r["allreduce_times"] for r in per_rank])
                        if per_rank[0]["allreduce_times"] else None)
    row["halo"] = (_slowest_rank_median([r["halo_times"] for r in per_rank])
                   if per_rank[0]["halo_times"] else None)
    # Cores each rank kept busy during its steps (all its threads), averaged over ranks.
    row["cpu_use"] = common.median([
        sum(cpu / wall for cpu, wall in zip(cpus, walls)) / len(per_rank)
        for cpus, walls in zip(zip(*(r["cpu_times"] for r in per_rank)), zip(*(r["step_times"] for r in per_rank)))
    ])
    return row


def _config_label(spec: dict, cores: int) -> str:
    label = spec["label"]
    if spec.get("gather_before_block"):
        label += f" (gathered before block {spec['gather_before_block']})"
    if spec["ranks"] * spec["threads"] > cores:
        label += f", oversubscribed ({spec['ranks']} ranks on {cores} cores)"
    return label


def _model_key(spec: dict) -> tuple[str, int]:
    return spec["model"], spec["size"]


def _baseline(rows: list[dict], spec: dict):
    for row in rows:
        if row["key"] == "serial" and _model_key(row) == _model_key(spec) and "step" in row:
            return row
    return None


def _percent(part, whole) -> str:
    return "—" if part is None else f"{100 * part / whole:.1f}%"


def add_speedups(rows: list[dict]) -> None:
    for row in rows:
        base = _baseline(rows, row)
        if "step" not in row or base is None:
            continue
        row["samples_per_s"] = row["samples_per_step"] / row["step"]
        row["speedup"] = row["samples_per_s"] / (base["samples_per_step"] / base["step"])
        row["efficiency"] = row["speedup"] / (row["ranks"] * row["threads"])


def table_rows(rows: list[dict], cores: int) -> list[list[str]]:
    out = []
    for row in rows:
        head = [common.model_label(row), f"{row['size']}^3", _config_label(row, cores),
                f"{row['ranks']} x {row['threads']}"]
        if "step" not in row:
            out.append(head + [f"FAILED: {row['error']}"] + ["—"] * 6 + _machine_use(row))
            continue
        relative = [f"{row[key]:.2f}" if key in row else "—" for key in ("speedup", "efficiency", "samples_per_s")]
        out.append(head + [
            _step_text(row), *relative, _percent(row["halo"], row["step"]),
            _percent(row["allreduce"], row["step"]), f"{row['cpu_use']:.2f}", *_machine_use(row),
        ])
    return out


def _step_text(row: dict) -> str:
    """The median round's step, and the range over the rounds when there were several."""
    steps = row.get("round_steps") or [row["step"]]
    if len(steps) == 1:
        return f"{row['step']:.3f}"
    return f"{row['step']:.3f} ({min(steps):.3f}-{max(steps):.3f})"


def _per_round(row: dict, base: dict) -> list[float]:
    """base's step over row's, round by round (rounds run in turn, so round i of both
    configurations ran close in time); [] for a single round."""
    steps, base_steps = row.get("round_steps") or [], base.get("round_steps") or []
    if len(steps) < 2 or len(steps) != len(base_steps):
        return []
    return [b / s for s, b in zip(steps, base_steps)]


def _machine_use(row: dict) -> list[str]:
    """The table's last two cells: other processes' cores before, the stolen share."""
    stolen = row.get("stolen")
    return [common.cores_text(row.get("others_before")), "?" if stolen is None else f"{100 * stolen:.1f}%"]


HEADER = [
    "model", "size", "config", "ranks x threads", "step time (s)", "speedup vs 1 rank 1 thread",
    "efficiency", "samples/s", "halo exchange share", "gradient allreduce share",
    "cores busy per rank", "cores used by other processes before", "CPU time stolen by the host",
]


def _model_name(rows: list[dict], model: str, size: int) -> str:
    row = next(r for r in rows if _model_key(r) == (model, size))
    return f"{common.model_label(row)} {size}^3"


def _find(rows, model, size, key):
    for row in rows:
        if row["model"] == model and row["size"] == size and row["key"] == key and "step" in row:
            return row
    return None


def evaluate_targets(rows: list[dict]) -> list[str]:
    lines = []
    busy = [r for r in rows if (r.get("others_before") or 0) > OTHERS_LIMIT]
    stolen = [r for r in rows if (r.get("stolen") or 0) > STOLEN_LIMIT]
    if busy or stolen:
        causes = []
        if busy:
            worst = max(busy, key=lambda r: r["others_before"])
            causes.append(f"other processes used up to {worst['others_before']:.2f} of "
                          f"{common.usable_cores()} cores before {len(busy)} configuration(s)")
        if stolen:
            worst = max(stolen, key=lambda r: r["stolen"])
            causes.append(f"the host took up to {100 * worst['stolen']:.1f}% of the CPU time "
                          f"during {len(stolen)} configuration(s)")
        lines.append(
            f"- **Caution: {' and '.join(causes)}: the machine was shared, and multi-rank "
            "steps suffer most (every collective waits for the rank that was descheduled). "
            "Rerun on a quiet machine before trusting these verdicts.**"
        )
    sizes = sorted({r["size"] for r in rows if r["model"] == "cosmoflow"})
    if 128 in sizes:
        for key in ("spatial2x1x1", "spatial1x2x1"):
            row = _find(rows, "cosmoflow", 128, key)
            if row is None or "efficiency" not in row:
                lines.append(f"- CosmoFlow 128^3, {key}: not measured (see the table).")
                continue
            verdict = "MET" if row["efficiency"] >= 0.85 else "NOT MET"
            rounds = _per_round(row, _baseline(rows, row))
            spread = (f" Round by round: speedup {', '.join(f'{v:.2f}' for v in rounds)}; met in "
                      f"{sum(v / (row['ranks'] * row['threads']) >= 0.85 for v in rounds)} of {len(rounds)}." if rounds else "")
            lines.append(
                f"- 2-way efficiency >= 0.85 at 128^3 (speedup >= 1.7), CosmoFlow {row['label']}: "
                f"speedup {row['speedup']:.2f}, efficiency {row['efficiency']:.2f} (median rounds) -> "
                f"**{verdict}**.{spread}"
            )
    else:
        lines.append("- 2-way efficiency >= 0.85 at 128^3: **not evaluated** (no 128^3 model in this run).")
    for model, size in sorted({_model_key(r) for r in rows}):
        split, threads = _find(rows, model, size, "spatial2x1x1"), _find(rows, model, size, "threads2")
        name = _model_name(rows, model, size)
        if split is None or threads is None:
            lines.append(f"- 2x1x1 no slower than 1 rank x 2 threads, {name}: not measured.")
            continue
        verdict = "MET" if split["step"] <= threads["step"] else "NOT MET"
        rounds = [1 / v for v in _per_round(split, threads)]
        spread = (f" Round by round: ratio {', '.join(f'{v:.2f}' for v in rounds)}; met in "
                  f"{sum(v <= 1 for v in rounds)} of {len(rounds)}." if rounds else "")
        lines.append(
            f"- 2x1x1 step no slower than 1 rank x 2 threads, {name}: {split['step']:.3f} s vs "
            f"{threads['step']:.3f} s (ratio {split['step'] / threads['step']:.2f}, median rounds) -> "
            f"**{verdict}**.{spread}"
        )
    return lines


def render(rows: list[dict], args: argparse.Namespace, command: str) -> str:
    cores = common.usable_cores()
    unet = [r for r in rows if r["model"] == "unet" and "parameters" in r]
    lines = [
        "## Strong scaling of one training step (`benchmarks/bench_scaling.py`)",
        "",
    ]
    if args.quick:
        lines += ["**QUICK MODE (smoke test at 32^3 with 2 timed steps): these numbers check that the "
                  "tool works; they are not benchmark results.**", ""]
    lines += [
        *common.run_header(command),
        "",
        f"One training step of ONE sample per data group: forward (training=True), MSE loss, "
        f"backward, {common.optimizer_label(args.optimizer)} update after the "
        + ("fused world-average of the gradients " if args.bucket_bytes is None else
           f"world-average of the gradients in buckets of {args.bucket_bytes} bytes ")
        + ("(each rank of a spatial group updating its share of the variables, then one allgather) "
           if args.shard_update else "")
        + f"(`strategy.distribute_optimizer`), in a `tf.function`. Step time = median over {args.steps} "
        f"timed steps of the slowest rank's step ({args.warmup} warm-up steps excluded). "
        + (f"Every configuration ran {args.rounds} times, in turn (round 1 of all configurations, then "
           "round 2, ...): a row is the round with the median step time, with the range over the "
           "rounds in parentheses, and the speedups compare medians. Round by round, the targets "
           "below compare configurations of the same round. " if args.rounds > 1 else "")
        + "Each rank "
        "uses one TensorFlow intra-op thread and one inter-op thread (OMP_NUM_THREADS=1) except "
        "\"1 rank, 2 threads\" (2 intra-op threads); Horovod's background thread comes on top. "
        "One-rank configurations are plain `python` processes (no Horovod); the others run under "
        "`horovodrun --gloo` on this machine.",
        "",
        *common.markdown_table(HEADER, table_rows(rows, cores)),
        "",
        "- *speedup*: samples/s over the samples/s of 1 rank with 1 thread for the same model and "
        "size (for one sample per step this is the step-time ratio; the data-parallel run processes "
        "2 samples per step). *efficiency* = speedup / (ranks x threads), i.e. per core used.",
        "- *halo exchange share*, *gradient allreduce share*: the median time of the component run "
        f"ALONE ({args.component_repeats} calls, slowest rank per call), divided by the step time. The "
        "components are timed in the same job with exactly the step's shapes: the gradient "
        "allreduce is `keras_spatial.comm.grouped_allreduce` of tensors shaped like the trainable "
        "variables over the world (as `DistributedOptimizer` does); the halo exchanges are every "
        "spatial window layer's own exchange (`layer._extend`, i.e. `extend_to_halo`: alltoall of "
        "the halo planes, assembling the extended shard, global zero padding; for a convolution "
        "that convolves its shard where it lies (`convolve_with_boundary_planes`), only the "
        "alltoall of its halo planes, `exchange_axis`; for a pooling layer "
        "that pools its shard in place, only the alltoall of the planes its neighbours need, pooled "
        "over the other axes, `exchange_axis`) forward AND backward "
        "(the adjoint alltoall), on tensors of the layer's local input shape, one exchange after "
        "the other as in the model (forward in layer order, backward in reverse). Shares are "
        "these isolated times divided by the step time; overlap with computation is not "
        "accounted for, so a share says how long the component takes on its own, not how much "
        "of the step it really occupies. Not isolated: the gather before the dense head "
        "(`SpatialFlatten`/`SpatialGather`), the U-Net's batch-norm statistics allreduces, and "
        "waiting for the slowest rank. '—': the configuration has no such communication.",
        "- Models: CosmoFlow is `recipes.cosmoflow.model.build_model(W, 'paper')` (9.4 M "
        "parameters, no batch norm, dropout 0.2 in the head). On 4 ranks split 4x1x1 its last "
        "volumes (2^3 or 4^3) cannot be split 4 ways, so the volume is gathered before the "
        "first block that cannot (`gather_before_block`, chosen by the layout plan; the "
        "remaining blocks then run replicated on every rank).",
    ]
    if unet:
        row = unet[0]
        lines.append(
            f"- The U-Net is `recipes.unet3d.model.build_model(depth=3, base_filters="
            f"{row['unet_filters']}, batch_norm=True)`: the paper's structure (3 levels of two "
            f"[conv 3^3 -> synchronized SpatialBatchNormalization -> ReLU] and a 2^3 max pool, "
            f"transposed conv 2^3/2 up, skip concatenation, 1^3 conv to 3 classes, softmax) with "
            f"base width {row['unet_filters']} instead of 32 ({row['parameters']:,} parameters); "
            "MSE against a random per-voxel target (the timing, not the task, matters here)."
        )
    lines += [
        "- *cores busy per rank*: CPU time of the rank's process (all its threads) during a "
        "step over the step's wall time, median over steps, mean over ranks. About the thread "
        "count on a quiet machine; clearly below it, the rank waited (for a collective, for "
        "the other rank) or was starved of a core by other processes.",
        f"- The machine has {cores} cores: runs with more ranks x threads than cores are "
        "oversubscribed and show core sharing, not scaling.",
        "- *cores used by other processes before*: the cores the machine kept busy in the "
        "second before the configuration started, while this driver slept and no benchmark "
        "job ran (/proc/stat); well above 0, other jobs shared the machine. *CPU time stolen "
        "by the host*: the share of the CPUs' time during the configuration's job that the "
        "hypervisor gave to other guests (/proc/stat's steal; 0 on bare metal): a host that "
        "is shared slows every configuration, and multi-rank ones most. Both are "
        "'?' where /proc/stat is missing. The verdicts below carry a caution when the first "
        f"exceeds {OTHERS_LIMIT} cores or the second {100 * STOLEN_LIMIT:.0f}% in any "
        "configuration.",
        "",
        "### Targets",
        "",
        *(["(Quick mode: the verdicts below only show the evaluation works; 32^3 numbers do not "
           "count for targets set at 64^3 and 128^3.)", ""] if args.quick else []),
        *evaluate_targets(rows),
        "",
        f"Plot: `{os.path.relpath(args.plot, os.path.dirname(os.path.abspath(args.out)))}` (step time per "
        "configuration; speedup vs cores used).",
    ]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str, quick: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in rows if "step" in r]
    models = sorted({_model_key(r) for r in measured}, key=lambda k: (k[0], k[1]))
    keys = [k for k in CONFIGS if any(r["key"] == k for r in measured)]
    fig, (ax_time, ax_speed) = plt.subplots(1, 2, figsize=(13, 6))
    width = 0.8 / max(len(keys), 1)
    for index, key in enumerate(keys):
        heights = [(_find(measured, m, s, key) or {}).get("step", 0.0) for m, s in models]
        label = next(r["label"] for r in measured if r["key"] == key)
        ax_time.bar([i + index * width for i in range(len(models))], heights, width, label=label)
    ax_time.set_xticks([i + width * (len(keys) - 1) / 2 for i in range(len(models))])
    ax_time.set_xticklabels([_model_name(measured, m, s).replace(") ", ")\n") for m, s in models], fontsize=8)
    ax_time.set_yscale("log")
    ax_time.set_ylabel("step time (s), log scale")
    ax_time.set_title("One training step of one sample per data group")
    ax_time.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    markers = {"serial": "o", "threads2": "s", "spatial2x1x1": "^", "spatial1x2x1": "v", "spatial1x1x2": "<",
               "data2": "D", "spatial4": "*"}
    top = 1
    for model, size in models:
        points = [r for r in measured if _model_key(r) == (model, size) and "speedup" in r]
        line = None
        for r in sorted(points, key=lambda r: r["ranks"] * r["threads"]):
            workers = r["ranks"] * r["threads"]
            top = max(top, workers)
            line = ax_speed.plot(workers, r["speedup"], markers.get(r["key"], "x"), markersize=8,
                                 color=line[0].get_color() if line else None,
                                 fillstyle="none" if workers > common.usable_cores() else "full")
        if line:
            spatial = sorted((r for r in points if r["key"] in ("serial", "spatial2x1x1", "spatial4")),
                             key=lambda r: r["ranks"])
            ax_speed.plot([r["ranks"] for r in spatial], [r["speedup"] for r in spatial], "-",
                          color=line[0].get_color(), label=f"{common.model_label(points[0])} {size}^3")
    ax_speed.plot([1, top], [1, top], "k--", linewidth=0.8, label="ideal")
    for key, marker in markers.items():
        if key in keys:
            ax_speed.plot([], [], marker, color="gray", label=next(r["label"] for r in measured if r["key"] == key))
    ax_speed.set_xlabel("cores used (ranks x threads); hollow = oversubscribed")
    ax_speed.set_ylabel("speedup vs 1 rank, 1 thread (samples/s)")
    ax_speed.set_title("Speedup (lines: 1 -> 2x1x1 -> 4-rank spatial)")
    ax_speed.legend(fontsize=7, loc="upper left")
    if quick:
        fig.suptitle("QUICK MODE smoke test (32^3, 2 steps): not benchmark numbers", color="red")
    common.save_figure(fig, path)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="full run:    .venv/bin/python benchmarks/bench_scaling.py\n"
               "smoke test:  .venv/bin/python benchmarks/bench_scaling.py --quick",
    )
    parser.add_argument("--models", default=None,
                        help=f"comma-separated model:size pairs (models: {', '.join(common.MODELS)}); "
                             f"default {DEFAULT_MODELS} ({QUICK_MODELS} with --quick)")
    parser.add_argument("--configs", default=",".join(k for k in CONFIGS if k != "spatial1x1x2"),
                        help=f"comma-separated configurations out of {', '.join(CONFIGS)} (default: all but spatial1x1x2)")
    parser.add_argument("--four-way", type=four_way_shape, default=(4, 1, 1),
                        help="spatial shape of the 4-rank configuration (default 4,1,1; e.g. 2,2,1)")
    parser.add_argument("--warmup", type=cli.positive_int("--warmup"), default=None, help="warm-up steps (default 3; 2 with --quick)")
    parser.add_argument("--steps", type=cli.positive_int("--steps"), default=None, help="timed steps (default 10; 2 with --quick)")
    parser.add_argument("--component-repeats", type=cli.positive_int("--component-repeats"), default=None,
                        help="timed calls of each isolated component (default 10; 3 with --quick)")
    common.add_optimizer_argument(parser)
    parser.add_argument("--unet-filters", type=cli.positive_int("--unet-filters"), default=8,
                        help="U-Net base width (the paper's is 32; default 8)")
    parser.add_argument("--cosmoflow-layout", choices=common.COSMOFLOW_LAYOUTS, default="recipe",
                        help="recipe: gather before block 5 as recipes.cosmoflow.train does (default); "
                             "split-all: split up to the flatten where possible (the layout before "
                             "that change, for before/after numbers)")
    parser.add_argument("--no-replicated-skip", action="store_true",
                        help="average the replicated layers' gradients over the world too (the "
                             "optimizer before that change, for before/after numbers)")
    parser.add_argument("--bucket-bytes", type=cli.positive_int("--bucket-bytes"), default=None,
                        help="average the gradients in buckets of about this many bytes, from the "
                             "last layers back, so the allreduce can overlap the backward pass "
                             "(DistributedOptimizer bucket_bytes; default: one fused allreduce)")
    parser.add_argument("--shard-update", action="store_true",
                        help="each rank of a spatial group updates only its share of the variables, "
                             "then one allgather (DistributedOptimizer shard_update)")
    parser.add_argument("--rounds", type=cli.positive_int("--rounds"), default=None,
                        help="times every configuration is run, in turn (round 1 of all of them, then "
                             "round 2, ...); the tables give the round with the median step and the "
                             "range (default 3; 1 with --quick)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per configuration (default 3600)")
    parser.add_argument("--quick", action="store_true", help="smoke test: 32^3 models, 2 warm-up, 2 timed steps")
    parser.add_argument("--out", default=None,
                        help="Markdown file whose bench_scaling section is (re)written "
                             f"(default docs/benchmarks.md; {QUICK_DIRECTORY}/benchmarks.md with --quick)")
    parser.add_argument("--plot", default=None,
                        help="PNG to write (default docs/bench_scaling.png; in the quick directory with --quick)")
    parser.add_argument("--json", default=None, help="also write the raw results here")
    parser.add_argument("--horovod-timeline", default=None, metavar="DIR",
                        help="write a Horovod timeline (chrome://tracing JSON) of every multi-rank "
                             "configuration into DIR, to see where a step waits; adds overhead")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        return args
    quick = args.quick
    args.models = args.models or (QUICK_MODELS if quick else DEFAULT_MODELS)
    args.warmup = args.warmup or (2 if quick else 3)
    args.steps = args.steps or (2 if quick else 10)
    args.component_repeats = args.component_repeats or (3 if quick else 10)
    args.rounds = args.rounds or (1 if quick else 3)
    args.out = os.path.abspath(args.out or (os.path.join(QUICK_DIRECTORY, "benchmarks.md") if quick else common.BENCHMARKS_MD))
    args.plot = os.path.abspath(args.plot or (os.path.join(QUICK_DIRECTORY, "bench_scaling.png") if quick else DEFAULT_PLOT))
    check_jobs(parser, args, "speedups are relative to 1 rank, 1 thread")
    args.parser = parser
    return args


def check_jobs(parser: argparse.ArgumentParser, args: argparse.Namespace, why_serial: str) -> None:
    """Parse and check the job options shared with benchmarks/profile_step.py, in place:
    --models ('model:size,...' -> [(model, size)]), --configs (-> keys of CONFIGS; must
    include 'serial', for `why_serial`) and --four-way (4 shards). Errors go to `parser`."""
    models = []
    for item in args.models.split(","):
        name, _, size = item.partition(":")
        if name not in common.MODELS or not size.isdigit():
            parser.error(f"--models takes model:size pairs with model in {common.MODELS}. Received: {item!r}")
        models.append((name, int(size)))
    args.models = models
    args.configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown or not args.configs:
        parser.error(f"--configs must be a comma-separated subset of {', '.join(CONFIGS)}. Received: {unknown or '(none)'}")
    if "serial" not in args.configs:
        parser.error(f"--configs must include 'serial': {why_serial}")
    if args.four_way[0] * args.four_way[1] * args.four_way[2] != 4:
        parser.error(f"--four-way must split into 4 shards. Received: {common.shape_text(args.four_way)}")


def plan_specs(args: argparse.Namespace, **per_job) -> list[dict]:
    """Every (model, configuration) job of `args` (checked by `check_jobs`), each with the
    fields every tool needs plus `per_job`, and its layout checked before anything runs."""
    specs = []
    for model, size in args.models:
        for key in args.configs:
            label, ranks, threads, spatial = CONFIGS[key]
            spatial = spatial or tuple(args.four_way)
            specs.append({
                "key": key, "label": label or f"spatial {common.shape_text(spatial)}", "model": model,
                "size": size, "ranks": ranks, "threads": threads, "spatial": list(spatial),
                "spatial_size": spatial[0] * spatial[1] * spatial[2],
                "warmup": args.warmup, "steps": args.steps, "unet_filters": args.unet_filters,
                "cosmoflow_layout": args.cosmoflow_layout, **per_job,
            })
    for spec, layout in zip(specs, common.check_layouts(specs)):
        if "error" in layout:
            args.parser.error(f"{spec['model']} at {spec['size']}^3 cannot run {spec['label']}: {layout['error']}")
        spec["gather_before_block"] = layout["gather_before_block"]
    return specs


def run_configuration(spec: dict, args: argparse.Namespace, position: str) -> dict:
    """One job of `spec`: its summary row (or its error), with the machine's use around it."""
    others = common.cores_busy_by_others()
    print(f"[{position}] {spec['model']} {spec['size']}^3, {spec['label']} "
          f"({spec['ranks']} ranks x {spec['threads']} threads; other processes used "
          f"{common.cores_text(others)} cores just before) ...", flush=True)
    start, counters = time.perf_counter(), common.cpu_counters()
    try:
        extra_env = None
        if args.horovod_timeline and spec["ranks"] > 1:
            os.makedirs(args.horovod_timeline, exist_ok=True)
            extra_env = {"HOROVOD_TIMELINE": os.path.abspath(os.path.join(
                args.horovod_timeline, f"{spec['model']}{spec['size']}_{spec['key']}.json"))}
        per_rank = common.launch_worker(__file__, spec, spec["ranks"], spec["threads"], args.timeout, extra_env)
        row = summarize(spec, per_rank)
        print(f"    -> step {row['step']:.3f} s, halo {row['halo'] or 0:.4f} s, allreduce "
              f"{row['allreduce'] or 0:.4f} s, {row['cpu_use']:.2f} cores busy per rank "
              f"({time.perf_counter() - start:.0f} s wall)", flush=True)
    except RuntimeError as error:
        print(f"    -> FAILED: {error}", flush=True)
        row = dict(spec, error=str(error))
    use = common.cpu_use_between(counters, common.cpu_counters())
    row["others_before"], row["stolen"] = others, None if use is None else use["stolen"]
    return row


def combine_rounds(rounds: list[dict]) -> dict:
    """One configuration's row over its rounds: the round with the median step (the
    lower of the two middle ones for an even count), with every round's step in
    "round_steps" and the most other processes and stolen time of any round. A
    configuration that failed in any round is reported as failed, with that error."""
    failed = [row for row in rounds if "step" not in row]
    if failed:
        row = dict(failed[0])
    else:
        row = dict(sorted(rounds, key=lambda r: r["step"])[(len(rounds) - 1) // 2])
        row["round_steps"] = [r["step"] for r in rounds]
    for key in ("others_before", "stolen"):
        values = [r[key] for r in rounds if r.get(key) is not None]
        row[key] = max(values) if values else None
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        worker(json.loads(args.worker))
        return 0
    command = common.command_line("benchmarks/bench_scaling.py", sys.argv[1:] if argv is None else argv)
    common.horovodrun_path()  # fail now, not after the one-rank runs
    specs = plan_specs(
        args, component_repeats=args.component_repeats, optimizer=args.optimizer,
        replicated_skip=not args.no_replicated_skip, bucket_bytes=args.bucket_bytes,
        shard_update=args.shard_update,
    )
    per_spec = [[] for _ in specs]  # one row per round
    for round_index in range(args.rounds):
        for index, spec in enumerate(specs, start=1):
            per_spec[index - 1].append(run_configuration(spec, args, f"round {round_index + 1}/{args.rounds}, "
                                                                     f"{index}/{len(specs)}"))
    rows = [combine_rounds(rounds) for rounds in per_spec]
    failures = sum("step" not in row for row in rows)
    add_speedups(rows)
    # The table and the JSON rows first: a failing plot must not lose the measurements.
    status = common.publish(SECTION, render(rows, args, command), args.out, rows, args.json, failures)
    plot(rows, args.plot, args.quick)
    print(f"Wrote {args.plot}")
    return status


if __name__ == "__main__":
    sys.exit(main())
