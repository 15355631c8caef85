"""Calibrate the performance model on this machine and compare it with measured steps.

    .venv/bin/python benchmarks/validate_cost_model.py            # about 16 minutes
    .venv/bin/python benchmarks/validate_cost_model.py --measured scaling.json
    .venv/bin/python benchmarks/validate_cost_model.py --quick    # smoke test, writes nothing

1. **Communication**: a 2-rank job (`horovodrun --gloo`) times, through
   `keras_spatial.comm` inside a `tf.function`, a chain of allreduces of 8 floats (the
   latency of one collective) and allreduces of `--bandwidth-mib` MiB (bandwidth:
   an allreduce of n bytes moves 2 (p-1)/p n bytes per rank).
2. **Steps**: `benchmarks/bench_scaling.py --json` measures one training step of
   CosmoFlow 64^3 and 128^3 and the U-Net 64^3 in the layouts of `--configs` (or
   `--measured` reads such a file).
3. **Compute**: with `--kernel-table`, every convolution and transposed convolution the measured layouts run
   (each distinct per-rank shape, filters, kernel, strides: `cost_model.kernel_key`) is
   timed alone, forward plus backward, in one plain process with one thread (median of
   `--kernel-repeats` calls); that table (`Hardware.kernel_times`) replaces the roofline
   for those layers, because convolution throughput depends on the shape. The effective
   FLOP/s of the other layers and the fixed time per layer and pass of this machine are
   then fitted to the ONE-rank steps only (least relative squares over a grid); memory
   bandwidth comes from a numpy copy of 256 MiB.
   **Co-running** (`--co-running`, on by default): each one-rank step runs alone, then as
   one independent process per core at once (no communication); the median ratio over
   the models is the compute slowdown of ranks that share the machine
   (`Hardware.co_running_slowdown`, applied to every multi-rank prediction).
4. **Validation**: with that `Hardware` (`keras_spatial.cost_model`), every measured
   multi-rank layout is predicted and compared: the error is predicted / measured - 1.
   Layouts with more rank x threads than cores are marked oversubscribed (the model
   assumes a core per rank).

Writes the calibrated description to docs/hardware_this_machine.json (usable as
`--hardware docs/hardware_this_machine.json`), the table to the section between the
markers in docs/performance_model.md and the rows to docs/performance_model.json, a list
of {"model", "size", "layout", "oversubscribed", "predicted_s", "measured_s"}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as common  # noqa: E402  (benchmarks/, this script's folder; sets sys.path)
from recipes import cli  # noqa: E402  (the project's argparse types)

REPO_ROOT = common.REPO_ROOT
BEGIN, END = "<!-- validate_cost_model:begin -->", "<!-- validate_cost_model:end -->"
DEFAULT_CONFIGS = "serial,spatial2x1x1,spatial1x2x1,spatial1x1x2,data2,spatial4"
MODELS = "cosmoflow:64,cosmoflow:128,unet:64"
TARGET = 0.15


# Communication (worker) ------------------------------------------------------------------
def comm_worker(spec: dict) -> None:
    strategy, _ = common.start_worker(spec)
    import tensorflow as tf

    from keras_spatial import comm

    world = strategy.world_process_set
    chain = spec["chain"]

    @tf.function
    def small(x):
        for index in range(chain):
            x = comm.allreduce(x, world, name=f"calibrate_small{index}", op="average")
        return x

    @tf.function
    def large(x):
        for index in range(4):
            x = comm.allreduce(x, world, name=f"calibrate_large{index}", op="average")
        return x

    def median_of(fn, value, calls):
        fn(value).numpy()
        times = []
        for _ in range(calls):
            common.barrier(strategy, "calibrate")
            start = time.perf_counter()
            fn(value).numpy()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    latency = median_of(small, tf.ones([8]), spec["repeats"]) / chain
    elements = int(spec["bandwidth_mib"] * 2**20 // 4)
    per_call = median_of(large, tf.ones([elements]), spec["repeats"]) / 4
    ranks = strategy.size
    moved = 2 * (ranks - 1) / ranks * elements * 4
    result = {"latency": latency, "bandwidth": moved / max(per_call - 2 * (ranks - 1) * latency, 1e-9),
              "large_allreduce": per_call}
    results = common.gather_results(strategy, result, "calibrate_results")
    if strategy.rank == 0:
        common.write_result(spec, results)


def measure_comm(args) -> dict:
    spec = {"ranks": 2, "threads": 1, "spatial": [1, 1, 1], "chain": args.chain,
            "repeats": args.repeats, "bandwidth_mib": args.bandwidth_mib}
    per_rank = common.launch_worker(__file__, spec, 2, 1, args.timeout)
    return {"latency": max(r["latency"] for r in per_rank),  # the slowest rank sets the pace
            "bandwidth": min(r["bandwidth"] for r in per_rank),
            "large_allreduce": max(r["large_allreduce"] for r in per_rank)}


def memory_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """Bytes/s of a numpy copy (read + write) of `mib` MiB, median of `repeats`."""
    import numpy as np

    source = np.ones(mib * 2**20 // 8)
    target = np.empty_like(source)
    return 2 * source.nbytes / common.median_seconds(lambda: np.copyto(target, source), repeats, warmups=0)


def measure_co_running(serial: list[dict], args) -> dict:
    """The compute slowdown of ranks that share this machine, with no communication.

    For every model of the one-rank rows, bench_scaling's worker runs that serial step
    in one process alone, then in one independent process per core at once (plain
    Python processes, no Horovod: nothing is exchanged). The ratio of the slowest
    concurrent median to the alone median is what running next to each other costs;
    the machine's `co_running_slowdown` is the median of the models' ratios. Returns
    {"factor", "ratios": {label: ratio}, "processes"}.
    """
    import concurrent.futures

    processes = max(os.cpu_count() or 1, 1)
    script = os.path.join(REPO_ROOT, "benchmarks", "bench_scaling.py")
    ratios = {}
    for row in serial:
        spec = dict(row)  # the measured row holds its job's spec (bench_scaling.summarize)
        label = f"{row['model']} {row['size']}^3"

        def median_step(_=None):
            per_rank = common.launch_worker(script, spec, 1, 1, args.timeout)
            return statistics.median(per_rank[0]["step_times"])

        alone = median_step()
        with concurrent.futures.ThreadPoolExecutor(processes) as pool:
            together = max(pool.map(median_step, range(processes)))
        ratios[label] = together / alone
        print(f"    {label}: alone {alone:.3f} s, {processes} at once {together:.3f} s "
              f"(x{ratios[label]:.3f})", flush=True)
    return {"factor": statistics.median(ratios.values()), "ratios": ratios, "processes": processes}


# Convolution kernels (worker) --------------------------------------------------------------
def kernel_worker(spec: dict) -> None:
    """Time each kernel of spec["keys"]: forward + backward of one Keras convolution."""
    common.configure_threads(spec["threads"])
    import keras
    import tensorflow as tf

    from keras_spatial.cost_model import parse_kernel_key

    times = {}
    for index, key in enumerate(spec["keys"], start=1):
        kernel = parse_kernel_key(key)
        layer_class = keras.layers.Conv3DTranspose if kernel["class"] == "Conv3DTranspose" else keras.layers.Conv3D
        layer = layer_class(kernel["filters"], kernel["kernel_size"], strides=kernel["strides"],
                            padding=kernel["padding"], use_bias=kernel["use_bias"])
        x = tf.random.normal(kernel["input"])
        layer.build(x.shape)

        @tf.function
        def step(x, layer=layer, input_gradient=kernel["input_gradient"]):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(layer(x))
            sources = ([x] if input_gradient else []) + list(layer.trainable_weights)
            return tf.add_n([tf.reduce_sum(g) for g in tape.gradient(loss, sources)])

        times[key] = common.median_seconds(lambda: step(x).numpy(), spec["repeats"], warmups=1)
        if index % 20 == 0 or index == len(spec["keys"]):
            print(f"    {index}/{len(spec['keys'])} kernels timed", flush=True)
    common.write_result(spec, [{"kernel_times": times}])


def measure_kernels(keys: list[str], args) -> dict:
    """{kernel key: seconds of its forward + backward pass}, one process, one thread."""
    spec = {"kind": "kernels", "ranks": 1, "threads": 1, "keys": sorted(keys), "repeats": args.kernel_repeats}
    return common.launch_worker(__file__, spec, 1, 1, args.timeout)[0]["kernel_times"]


def kernel_flops(steps: list[dict], cache: dict) -> dict:
    """{kernel key: forward + backward FLOPs} of every convolution in the measured layouts."""
    flops = {}
    for row in steps:
        for cost in costs_of(row, cache):
            if cost.kernel:
                flops[cost.kernel] = cost.forward_flops + cost.backward_flops
    return flops


# Steps -----------------------------------------------------------------------------------
def measure_steps(args, path: str) -> None:
    """Run bench_scaling, its rows to `path`; a configuration that failed is left out of
    the rows (bench_scaling marks it), a run that wrote no rows raises."""
    command = [sys.executable, os.path.join(REPO_ROOT, "benchmarks", "bench_scaling.py"),
               "--models", args.models, "--configs", args.configs, "--rounds", str(args.rounds),
               "--json", path, "--out", os.path.join(tempfile.gettempdir(), "validate_cost_model_scaling.md"),
               "--plot", os.path.join(tempfile.gettempdir(), "validate_cost_model_scaling.png")]
    if args.quick:
        command.append("--quick")
    print("steps:", " ".join(command[1:]), flush=True)
    status = subprocess.run(command, cwd=REPO_ROOT).returncode
    if not os.path.exists(path):
        raise RuntimeError(f"bench_scaling.py exited with status {status} and wrote no measurements")
    print(f"measured steps in {path} (reuse them with --measured {path})", flush=True)


def builder(row: dict):
    """The model bench_scaling measured for `row`, built with no strategy."""
    return lambda: common.build_benchmark_model(row)


# Fit and predict -------------------------------------------------------------------------
def hardware_of(comm_result: dict, bandwidth: float, flops: float, overhead: float, co_running: float = 1.0,
                kernel_times: Optional[dict] = None):
    from keras_spatial.cost_model import Hardware

    return Hardware(
        name="this machine (calibrated by benchmarks/validate_cost_model.py)",
        peak_flops=flops, flop_efficiency=1.0, memory_bandwidth=bandwidth, memory_efficiency=1.0,
        memory_capacity=float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
        intra_node_latency=comm_result["latency"], intra_node_bandwidth=comm_result["bandwidth"],
        inter_node_latency=comm_result["latency"], inter_node_bandwidth=comm_result["bandwidth"],
        ranks_per_node=os.cpu_count() or 1, op_overhead=overhead, co_running_slowdown=co_running,
        kernel_times=kernel_times,
    )


def costs_of(row: dict, costs_cache: dict) -> list:
    """`cost_model.model_costs` of a measured row's model and layout (cached)."""
    from keras_spatial.cost_model import model_costs

    key = (row["model"], row["size"], tuple(row["spatial"]), row["ranks"], row.get("gather_before_block"))
    if key not in costs_cache:
        costs_cache[key] = model_costs(builder(row), tuple(row["spatial"]), world_size=row["ranks"], batch_size=1)
    return costs_cache[key]


def predict(row: dict, costs_cache: dict, hardware) -> float:
    from keras_spatial.cost_model import predict_step

    batch = row["ranks"] // row["spatial_size"]  # one sample per data group
    return predict_step(costs_of(row, costs_cache), tuple(row["spatial"]), row["ranks"], batch, hardware).step


FIT_GFLOPS = (2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256)
FIT_OVERHEADS = (0.0, 2e-5, 5e-5, 1e-4, 1.5e-4, 2e-4, 3e-4, 4e-4, 5e-4, 7e-4, 1e-3, 1.5e-3)


def fit_compute(serial: list[dict], comm_result: dict, bandwidth: float, cache: dict,
                kernel_times: Optional[dict] = None) -> tuple:
    """(FLOP/s, overhead) minimising the squared relative error of the one-rank steps
    (the layers of `kernel_times` keep their measured times)."""
    best = None
    for flops in [g * 1e9 for g in FIT_GFLOPS]:
        for overhead in FIT_OVERHEADS:
            hardware = hardware_of(comm_result, bandwidth, flops, overhead, kernel_times=kernel_times)
            error = sum((predict(r, cache, hardware) / r["step"] - 1) ** 2 for r in serial)
            if best is None or error < best[0]:
                best = (error, flops, overhead)
    return best[1], best[2]


def layout_text(row: dict) -> str:
    spatial = "x".join(map(str, row["spatial"]))
    groups = row["ranks"] // row["spatial_size"]
    return f"{spatial} x {groups} data group(s)" if groups > 1 else spatial


def kernel_summary(kernel_times: dict, kernel_flops: dict) -> str:
    """The range of the kernels' achieved GFLOP/s (the cost model's FLOPs), as text."""
    rates = sorted(kernel_flops[key] / seconds / 1e9 for key, seconds in kernel_times.items())
    return f"{rates[0]:.0f} to {rates[-1]:.0f} GFLOP/s, median {statistics.median(rates):.0f}"


def render(rows: list[dict], hardware, command: str, co_running: Optional[dict] = None,
           flops_of_kernels: Optional[dict] = None) -> str:
    lines = [
        f"Command: `{command}`  ",
        f"Machine: {common.machine_line()}  ",
        "",
        "Calibrated (`docs/hardware_this_machine.json`): "
        + (f"{len(hardware.kernel_times)} convolution kernels timed alone (forward + backward, one "
           f"thread: {kernel_summary(hardware.kernel_times, flops_of_kernels)}), "
           if hardware.kernel_times else "")
        + f"{hardware.peak_flops / 1e9:.0f} GFLOP/s effective for the other layers, "
        f"{hardware.op_overhead * 1e6:.0f} us per layer and pass (both fitted to the one-rank steps), "
        f"memory {hardware.memory_bandwidth / 1e9:.1f} GB/s (numpy copy), collective latency "
        f"{hardware.intra_node_latency * 1e3:.2f} ms and bandwidth {hardware.intra_node_bandwidth / 1e9:.2f} GB/s "
        "(Gloo allreduce on 2 ranks)"
        + ("" if not co_running else
           f"; compute x{hardware.co_running_slowdown:.3f} when ranks share the machine (median over the "
           f"models of {co_running['processes']} independent one-rank steps at once against one alone: "
           + ", ".join(f"{label} x{ratio:.3f}" for label, ratio in co_running["ratios"].items()) + ")")
        + ".",
        "",
        "| model | size | layout | ranks | oversubscribed | measured (s) | predicted (s) | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['model']} | {r['size']}^3 | {r['layout']} | {r['ranks']} | "
                     f"{'yes' if r['oversubscribed'] else 'no'} | {r['measured_s']:.3f} | "
                     f"{r['predicted_s']:.3f} | {r['error']:+.0%} |")
    checked = [r for r in rows if not r["oversubscribed"] and r["ranks"] > 1]
    within = sum(abs(r["error"]) <= TARGET for r in checked)
    worst = max(checked, key=lambda r: abs(r["error"])) if checked else None
    lines += ["", f"Target: every multi-rank layout that is not oversubscribed within {TARGET:.0%} of its "
                  f"measured median: {within} of {len(checked)}"
              + (f"; the worst, {worst['model']} {worst['size']}^3 {worst['layout']}, {worst['error']:+.0%}."
                 if worst else ".")]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measured", default=None, help="a bench_scaling.py --json file (default: measure now)")
    parser.add_argument("--models", default=MODELS, help=f"for bench_scaling (default {MODELS})")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"for bench_scaling (default {DEFAULT_CONFIGS})")
    parser.add_argument("--rounds", type=cli.positive_int("--rounds"), default=1, help="bench_scaling rounds (default 1)")
    parser.add_argument("--chain", type=cli.positive_int("--chain"), default=50, help="small allreduces per call (default 50)")
    parser.add_argument("--repeats", type=cli.positive_int("--repeats"), default=7, help="timed calls (default 7)")
    parser.add_argument("--kernel-repeats", type=cli.positive_int("--kernel-repeats"), default=5,
                        help="timed calls per convolution kernel (default 5)")
    parser.add_argument("--kernel-table", action=argparse.BooleanOptionalAction, default=False,
                        help="time every convolution of the measured layouts and use those times "
                             "instead of the roofline (Hardware.kernel_times; default off: one "
                             "measured run with it came out 5 of 12 within 15%%, not better than without)")
    parser.add_argument("--bandwidth-mib", type=cli.positive_int("--bandwidth-mib"), default=32,
                        help="MiB per large allreduce (default 32)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per job (default 1800)")
    parser.add_argument("--co-running", action=argparse.BooleanOptionalAction, default=True,
                        help="measure the compute slowdown of ranks sharing the machine (one-rank "
                             "steps run side by side, no communication) and put it in the model "
                             "(default on; --no-co-running predicts as if every rank had the "
                             "machine to itself)")
    parser.add_argument("--quick", action="store_true", help="smoke test: 32^3 steps, small transfers, writes nothing")
    parser.add_argument("--docs", default=os.path.join(REPO_ROOT, "docs"), help="where the outputs go (default docs/)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.configs, args.repeats, args.chain, args.bandwidth_mib = "cosmoflow:32", "serial,spatial2x1x1", 2, 5, 1
        args.kernel_repeats = 2
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        spec = json.loads(args.worker)
        (kernel_worker if spec.get("kind") == "kernels" else comm_worker)(spec)
        return 0
    command = common.command_line("benchmarks/validate_cost_model.py", sys.argv[1:] if argv is None else argv)
    print("communication: 2 ranks ...", flush=True)
    comm_result = measure_comm(args)
    bandwidth = memory_bandwidth(16 if args.quick else 256)
    print(f"    latency {comm_result['latency'] * 1e3:.3f} ms, bandwidth {comm_result['bandwidth'] / 1e9:.2f} GB/s, "
          f"memory {bandwidth / 1e9:.1f} GB/s", flush=True)
    measured = args.measured
    if measured is None:
        # Not deleted afterwards: the measured rows can be reused with --measured.
        measured = os.path.join(tempfile.mkdtemp(prefix="validate_cost_model_"), "scaling.json")
        measure_steps(args, measured)
    with open(measured) as handle:
        steps = [r for r in json.load(handle) if "step" in r and r.get("threads", 1) == 1]
    serial = [r for r in steps if r["ranks"] == 1]
    if not serial:
        print("error: the measurements hold no one-rank step to calibrate on", file=sys.stderr)
        return 1
    cache: dict = {}
    kernel_times = flops_of_kernels = None
    if args.kernel_table:
        flops_of_kernels = kernel_flops(steps, cache)
        print(f"kernels: timing {len(flops_of_kernels)} convolutions, one thread ...", flush=True)
        kernel_times = measure_kernels(sorted(flops_of_kernels), args)
    flops, overhead = fit_compute(serial, comm_result, bandwidth, cache, kernel_times)
    co_running = None
    if args.co_running:
        print(f"co-running: the {len(serial)} one-rank step(s) alone, then side by side ...", flush=True)
        co_running = measure_co_running(serial, args)
    hardware = hardware_of(comm_result, bandwidth, flops, overhead, co_running["factor"] if co_running else 1.0,
                           kernel_times)
    cores = os.cpu_count() or 1
    rows = []
    for r in steps:
        predicted = predict(r, cache, hardware)
        rows.append({"model": r["model"], "size": r["size"], "layout": layout_text(r), "ranks": r["ranks"],
                     "oversubscribed": r["ranks"] * r.get("threads", 1) > cores,
                     "predicted_s": predicted, "measured_s": r["step"], "error": predicted / r["step"] - 1})
    report = render(rows, hardware, command, co_running, flops_of_kernels)
    print(report)
    if args.quick:
        return 0
    import dataclasses

    with open(os.path.join(args.docs, "hardware_this_machine.json"), "w") as handle:
        json.dump(dataclasses.asdict(hardware), handle, indent=1)
    with open(os.path.join(args.docs, "performance_model.json"), "w") as handle:
        json.dump([{k: r[k] for k in ("model", "size", "layout", "oversubscribed", "predicted_s", "measured_s")}
                   for r in rows], handle, indent=1)
    path = os.path.join(args.docs, "performance_model.md")
    with open(path) as handle:
        text = handle.read()
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN) + len(BEGIN)] + "\n" + report + "\n" + text[text.index(END):]
        with open(path, "w") as handle:
            handle.write(text)
    print(f"wrote {args.docs}/hardware_this_machine.json, performance_model.json and the section of performance_model.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
