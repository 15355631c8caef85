"""Benchmark: where the time of one training step goes, per rank (TensorFlow profiler).

Full run (writes the `profile_step` section of docs/benchmarks.md):

    .venv/bin/python benchmarks/profile_step.py

Smoke test (CosmoFlow and the U-Net at 32^3, 1 warm-up, 3 timed and 1 profiled step;
writes to a temporary directory unless --out is given):

    .venv/bin/python benchmarks/profile_step.py --quick

For each model and configuration (the keys and labels of benchmarks/bench_scaling.py: 1 rank
x 1 thread, spatial 2x1x1, spatial 1x2x1 by default) it runs, in one job per
configuration (a plain `python` process for one rank, horovodrun --gloo for several),
the training step of bench_scaling.py (one sample per data group: forward with
training=True, MSE, backward, the --optimizer's update after the fused world-average of
the gradients). Every rank runs --warmup steps, then --steps timed steps (wall time of each),
then --profiled-steps steps under `tf.profiler.experimental` and reads the trace
(XSpace protobuf) it wrote. On the host plane's `tf_Compute` lines (the threads that run
the graph's kernels) every kernel event -- metadata name `op_name:OpType`; executor
wrappers and markers such as `ExecutorState::Process`, `ThreadpoolListener::*`,
`MemoryAllocation` are not kernels -- is sorted into a category by op type and name:

* convolution (Conv3D forward, BackpropInput, BackpropFilter; also reported apart);
* pooling, activation (LeakyRelu/Relu and their gradients, FusedBatchNorm*);
* halo assembly copies (Slice, StridedSlice, Pad, PadV2, ConcatV2, AddN, Transpose,
  Split, SplitV outside the optimizer);
* optimizer (ops under the `adam` or `fused_adam` name scope, and XLA clusters: in these
  steps only FusedAdam's updates are compiled), dense (MatMul), other kernels.

Category times are kernel self times (nested kernel events subtracted) per step. The
rank was busy during the union of all kernel intervals; idle = the profiled steps' wall
time (perf_counter around each step) minus that union: waiting for collectives (Horovod
runs them asynchronously, outside the kernels) and for the other rank, Python and
executor overhead, and time the OS gave the core to another process between kernels
(a kernel descheduled by the OS counts that time as its own: kernel times are wall-clock).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as common  # noqa: E402  (sets sys.path and TF's log level first)
from recipes import cli  # noqa: E402  (the project's argparse types)
from bench_scaling import CONFIGS, QUICK_DIRECTORY, check_jobs, four_way_shape, plan_specs  # noqa: E402

SECTION = "profile_step"
DEFAULT_MODELS = "cosmoflow:128"
QUICK_MODELS = "cosmoflow:32,unet:32"
DEFAULT_CONFIGS = "serial,spatial2x1x1,spatial1x2x1,data2"
TOP_OPS = 60
# Per-step categories in table order; the three convolution parts are summed into
# "convolution" for the table and kept apart in the JSON.
XLA_RUN_EVENT = "CpuExecutable::ExecuteAsyncOnStream"  # one XLA cluster's run on the CPU
CATEGORIES = ("convolution", "pooling", "activation", "halo", "optimizer", "dense", "other")
CONVOLUTION_PARTS = ("conv_forward", "conv_backprop_input", "conv_backprop_filter")
COMPUTE = ("convolution", "pooling", "activation")
ACTIVATION_TYPES = {"LeakyRelu", "LeakyReluGrad", "Relu", "ReluGrad"}
HALO_TYPES = {"Slice", "StridedSlice", "Pad", "PadV2", "ConcatV2", "AddN", "Transpose", "Split", "SplitV"}


# Trace analysis ---------------------------------------------------------------------------
def base_type(op_type: str) -> str:
    """The op type without oneDNN's rename prefix (_MklNativeConv3D -> Conv3D)."""
    for prefix in ("_MklNative", "_Mkl"):
        if op_type.startswith(prefix):
            return op_type[len(prefix):]
    return op_type


def category(op_name: str, op_type: str) -> str:
    """The category of one kernel (a CONVOLUTION_PARTS entry for convolutions)."""
    kind = base_type(op_type)
    if kind == "XlaCluster" or any(op_name.startswith(scope) or f"/{scope}/" in op_name
                                   for scope in ("adam", "fused_adam")):
        return "optimizer"
    if "Conv3D" in kind:
        if "BackpropInput" in kind:
            return "conv_backprop_input"
        return "conv_backprop_filter" if "BackpropFilter" in kind else "conv_forward"
    if "Pool" in kind:
        return "pooling"
    if kind in ACTIVATION_TYPES or kind.startswith("FusedBatchNorm"):
        return "activation"
    if kind in HALO_TYPES:
        return "halo"
    if "MatMul" in kind:
        return "dense"
    return "other"


def kernel_events(xspace) -> tuple[list[list[tuple[int, int, str]]], int]:
    """Per `tf_Compute` line of the '/host:CPU' plane, its kernel events as (start ps, end
    ps, 'op_name:OpType'), sorted by start; and the number of asynchronous (collective)
    kernels started, which the executor traces as `ExecutorState::ProcessAsync::Start`.
    An XLA cluster (FusedAdam's update) is launched asynchronously too, but it runs
    there and then, on the same line, as one `CpuExecutable::ExecuteAsyncOnStream` event:
    that event is kept as a kernel named 'xla_cluster:XlaCluster', and its launch is
    not counted as a collective.

    A kernel's metadata name is 'op_name:OpType'; the executor's wrappers and markers
    ('ExecutorState::Process', 'ThreadpoolListener::Record', 'MemoryAllocation',
    'ExecutorDoneCallback', ...) have no ':' or a '::' and are left out.
    """
    plane = next((p for p in xspace.planes if p.name == "/host:CPU"), None)
    if plane is None:
        raise RuntimeError(f"no '/host:CPU' plane in the trace (planes: {[p.name for p in xspace.planes]})")
    lines, async_starts = [], 0
    for line in plane.lines:
        if not line.name.startswith("tf_Compute"):
            continue
        base_ps, events = line.timestamp_ns * 1000, []
        for event in line.events:
            name = plane.event_metadata[event.metadata_id].name
            if name == "ExecutorState::ProcessAsync::Start":
                async_starts += 1
            elif name == XLA_RUN_EVENT:
                async_starts -= 1
                start = base_ps + event.offset_ps
                events.append((start, start + event.duration_ps, "xla_cluster:XlaCluster"))
            elif ":" in name and "::" not in name:
                start = base_ps + event.offset_ps
                events.append((start, start + event.duration_ps, name))
        lines.append(sorted(events, key=lambda e: (e[0], -e[1])))
    if not any(lines):
        raise RuntimeError("the trace has no kernel events on the tf_Compute lines")
    return lines, async_starts


def self_times(events: list[tuple[int, int, str]]) -> list[tuple[str, int]]:
    """(name, duration minus the durations of kernels nested directly inside it) for the
    events of ONE thread, sorted by start (a thread's events nest, never straddle)."""
    result, stack = [], []  # stack of [end, name, self time]
    for start, end, name in events:
        while stack and stack[-1][0] <= start:
            result.append(tuple(stack.pop()[1:]))
        if stack:
            stack[-1][2] -= end - start
        stack.append([end, name, end - start])
    result += [tuple(entry[1:]) for entry in stack]
    return result


def union_ps(lines: list[list[tuple[int, int, str]]]) -> int:
    """Length of the union of all kernel intervals of all lines."""
    total, reach = 0, None
    for start, end, _ in sorted(e for line in lines for e in line):
        if reach is None or start > reach:
            total, reach = total + end - start, end
        elif end > reach:
            total, reach = total + end - reach, end
    return total


def analyse(xspace, steps: int, wall: float) -> dict:
    """Per-step seconds of every category, busy (union of kernels) and idle time, the
    kernel self-time sum, collectives started per step and the top ops."""
    lines, async_starts = kernel_events(xspace)
    per_category = dict.fromkeys(CONVOLUTION_PARTS + CATEGORIES[1:], 0)
    per_op = {}
    for line in lines:
        for name, self_ps in self_times(line):
            op_name, _, op_type = name.rpartition(":")
            per_category[category(op_name, op_type)] += self_ps
            key = (op_name, op_type)
            per_op[key] = per_op.get(key, 0) + self_ps
    seconds = {key: ps * 1e-12 / steps for key, ps in per_category.items()}
    seconds["convolution"] = sum(seconds[key] for key in CONVOLUTION_PARTS)
    busy = union_ps(lines) * 1e-12 / steps
    top = sorted(per_op.items(), key=lambda item: -item[1])[:TOP_OPS]
    return {
        "categories": seconds,
        "kernel_sum": sum(seconds[key] for key in CATEGORIES),
        "busy": busy,
        "idle": wall / steps - busy,
        "collectives_per_step": async_starts / steps,
        "top_ops": [{"name": n, "type": t, "ms_per_step": ps * 1e-9 / steps} for (n, t), ps in top],
    }


# Worker (one rank) -------------------------------------------------------------------------
def worker(spec: dict) -> None:
    strategy, say = common.start_worker(spec)
    import tensorflow as tf
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    def timed_steps(count: int) -> tuple[list[float], list[float]]:
        walls, losses = [], []
        for _ in range(count):
            start = time.perf_counter()
            losses.append(training.run())
            walls.append(time.perf_counter() - start)
        return walls, losses

    training = common.make_training_step(strategy, spec, spec["optimizer"], seed=strategy.rank)
    say(f"{training.model.name}: {training.model.count_params():,} parameters, local input "
        f"{common.shape_text(training.x.shape[1:])}")
    warmup, _ = timed_steps(spec["warmup"])
    say("warm-up steps: " + ", ".join(f"{t:.3f}" for t in warmup) + " s")
    common.barrier(strategy, "steps")
    step_times, losses = timed_steps(spec["steps"])
    say(f"{spec['steps']} timed steps: median {common.median(step_times):.3f} s (rank 0)")
    common.barrier(strategy, "profile")
    keep = spec.get("trace_dir")
    if keep:
        logdir = os.path.join(keep, f"{spec['model']}{spec['size']}_{spec['key']}", f"rank{strategy.rank}")
        shutil.rmtree(logdir, ignore_errors=True)
        os.makedirs(logdir)
    else:
        logdir = tempfile.mkdtemp(prefix=f"profile_step_rank{strategy.rank}_")
    try:
        tf.profiler.experimental.start(logdir)
        try:
            profiled_times, profiled_losses = timed_steps(spec["profiled_steps"])
        finally:
            tf.profiler.experimental.stop()
        traces = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
        if len(traces) != 1:
            raise RuntimeError(f"expected one *.xplane.pb under {logdir}, found {traces}")
        xspace = xplane_pb2.XSpace()
        with open(traces[0], "rb") as handle:
            xspace.ParseFromString(handle.read())
    finally:
        if not keep:
            shutil.rmtree(logdir, ignore_errors=True)
    losses += profiled_losses
    if not all(math.isfinite(loss) for loss in losses):
        raise RuntimeError(f"non-finite loss on rank {strategy.rank}: {losses}")
    profile = analyse(xspace, spec["profiled_steps"], sum(profiled_times))
    say(f"{spec['profiled_steps']} profiled steps: mean {sum(profiled_times) / len(profiled_times):.3f} s, "
        f"kernels busy {profile['busy']:.3f} s per step (rank 0)")
    result = dict(profile, rank=strategy.rank, step_times=step_times, profiled_times=profiled_times,
                  parameters=int(training.model.count_params()), local_input=list(training.x.shape[1:]))
    results = common.gather_results(strategy, result, "profile")
    if strategy.rank == 0:
        common.write_result(spec, results)


# Driver ----------------------------------------------------------------------------------
def summarize(per_rank: list[dict]) -> list[dict]:
    """Add each rank's unprofiled median and profiled mean step time."""
    for result in per_rank:
        result["step"] = common.median(result["step_times"])
        result["profiled_step"] = sum(result["profiled_times"]) / len(result["profiled_times"])
    return per_rank


def _config_label(spec: dict) -> str:
    label = spec["label"]
    if spec.get("gather_before_block"):
        label += f" (gathered before block {spec['gather_before_block']})"
    if spec["ranks"] * spec["threads"] > common.usable_cores():
        label += f", oversubscribed ({spec['ranks']} ranks on {common.usable_cores()} cores)"
    return label


def _share(seconds: float, whole: float) -> str:
    return f"{seconds:.3f} ({100 * seconds / whole:.0f}%)"


HEADER = [
    "model", "size", "config", "rank", "step (s, median unprofiled)", "profiled step (s)",
    "convolution", "pooling", "activation", "halo assembly copies", "optimizer", "dense",
    "other kernels", "idle",
]


def table_rows(rows: list[dict]) -> list[list[str]]:
    out = []
    for row in rows:
        head = [common.model_label(row), f"{row['size']}^3", _config_label(row)]
        if "per_rank" not in row:
            out.append(head + ["—", f"FAILED: {row['error']}"] + ["—"] * (len(HEADER) - 5))
            continue
        for result in row["per_rank"]:
            whole = result["profiled_step"]
            out.append(head + [
                str(result["rank"]), f"{result['step']:.3f}", f"{whole:.3f}",
                *(_share(result["categories"][key], whole) for key in CATEGORIES),
                _share(result["idle"], whole),
            ])
    return out


def _compute(result: dict) -> float:
    return sum(result["categories"][key] for key in COMPUTE)


def _beyond_even_split(result: dict, serial: dict, parts: int) -> str:
    """What a rank's kernels took beyond 1/`parts` of the serial run's, per category."""
    excess = {key: result["categories"][key] - serial["categories"][key] / parts for key in CATEGORIES}
    cells = ", ".join(f"{label} {excess[key]:+.3f} s" for key, label in zip(CATEGORIES, HEADER[6:]))
    return (f"Rank {result['rank']}'s kernel time beyond 1/{parts} of serial's: {cells} "
            f"(sum {sum(excess.values()):+.3f} s)")


def compare_with_serial(rows: list[dict]) -> list[str]:
    """One line per multi-rank configuration: each rank's compute kernels (convolution +
    pooling + activation) over the serial run's, same model and size; the speedup the
    configuration would reach if no rank ever waited (samples per step times the serial
    profiled step, over the busiest rank's kernel time: every kernel, copies and
    optimizer included); and where that rank's kernel time beyond an even split of the
    serial run's went, per category."""
    lines = []
    for row in rows:
        if row["ranks"] == 1:
            continue
        name = f"{common.model_label(row)} {row['size']}^3, {_config_label(row)}"
        serial = next((r for r in rows if r["key"] == "serial" and (r["model"], r["size"]) == (row["model"], row["size"])
                       and "per_rank" in r), None)
        if "per_rank" not in row or serial is None:
            lines.append(f"- {name}: compute kernels per rank vs serial: not measured (see the table).")
            continue
        base = _compute(serial["per_rank"][0])
        ratios = ", ".join(f"rank {r['rank']} {_compute(r) / base:.2f}" for r in row["per_rank"])
        busiest = max(row["per_rank"], key=lambda r: r["busy"])
        # Samples per step over serial's one: a data-parallel run's ceiling counts them all.
        serial_step = serial["per_rank"][0]["profiled_step"] * (row["ranks"] // row["spatial_size"])
        lines.append(f"- {name}: compute kernels per rank vs serial: {ratios} "
                     f"(1/{row['spatial_size']} = {1 / row['spatial_size']:.2f} would be a perfect split); "
                     f"busiest rank's kernels {busiest['busy']:.3f} s a step against the serial profiled step "
                     f"{serial['per_rank'][0]['profiled_step']:.3f} s: speedup (samples per second) at most "
                     f"{serial_step / busiest['busy']:.2f} if no rank ever waited. "
                     f"{_beyond_even_split(busiest, serial['per_rank'][0], row['spatial_size'])}")
    return lines


def render(rows: list[dict], args: argparse.Namespace, command: str) -> str:
    lines = ["## Where the time of a step goes (`benchmarks/profile_step.py`)", ""]
    if args.quick:
        lines += ["**QUICK MODE (smoke test at 32^3 with 3 timed steps and 1 profiled step): these "
                  "numbers check that the tool works; they are not benchmark results.**", ""]
    lines += [
        *common.run_header(command),
        "",
        "The training step of `benchmarks/bench_scaling.py` (one sample per data group: forward with "
        f"training=True, MSE, backward, {common.optimizer_label(args.optimizer)} update after the fused "
        "world-average of the gradients), "
        "one TensorFlow intra-op thread and one inter-op thread per rank (OMP_NUM_THREADS=1; 2 "
        "intra-op threads in \"1 rank, 2 threads\"), one job per configuration (horovodrun --gloo for several ranks). Each rank runs "
        f"{args.warmup} warm-up steps, {args.steps} timed steps (*step*: their median on that rank), "
        f"then {args.profiled_steps} steps under the TensorFlow profiler (`tf.profiler.experimental`; "
        "*profiled step*: their mean). Profiled steps are slower than unprofiled ones by the "
        "profiler's overhead; the category columns are seconds per profiled step and, in "
        "parentheses, their share of it.",
        "",
        "The categories sum the self time (nested kernel events subtracted) of the kernels on the "
        "trace's `tf_Compute` threads, by op type and name: *convolution* Conv3D forward, "
        "BackpropInput and BackpropFilter; *pooling* the pooling ops and their gradients; "
        "*activation* LeakyRelu, Relu, their gradients and FusedBatchNorm* (the spatial batch "
        "norm's statistics are plain Mean/Sub/Mul ops, counted in *other*); *halo assembly "
        "copies* Slice, StridedSlice, Pad, PadV2, ConcatV2, AddN, Transpose, Split, SplitV outside "
        "the optimizer (the shard and halo slicing, padding and concatenation around each "
        "exchange, and their gradients; the same ops elsewhere in the model land here too); "
        "*optimizer* the ops of the optimizer's update (FusedAdam's compiled XLA clusters included); *dense* MatMul; *other kernels* the rest. "
        "*idle* = the profiled step's wall time minus the union of all kernel intervals: "
        "waiting for collectives (Horovod runs them asynchronously, outside the kernels) and "
        "for the other rank, Python and executor overhead, and time the OS gave the core to "
        "another process between kernels. Kernel times are wall-clock intervals too: a kernel "
        "descheduled by the OS (other ranks or jobs on the same cores) counts that time as its own.",
        "",
        *common.markdown_table(HEADER, table_rows(rows)),
        "",
        "How well the split divides the work:",
        "",
        *compare_with_serial(rows),
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="full run:    .venv/bin/python benchmarks/profile_step.py\n"
               "smoke test:  .venv/bin/python benchmarks/profile_step.py --quick",
    )
    parser.add_argument("--models", default=None,
                        help=f"comma-separated model:size pairs (models: {', '.join(common.MODELS)}); "
                             f"default {DEFAULT_MODELS} ({QUICK_MODELS} with --quick)")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help=f"comma-separated configurations out of {', '.join(CONFIGS)}, as in "
                             f"benchmarks/bench_scaling.py; must include serial (default {DEFAULT_CONFIGS})")
    parser.add_argument("--four-way", type=four_way_shape, default=(4, 1, 1),
                        help="spatial shape of the 4-rank configuration spatial4 (default 4,1,1)")
    parser.add_argument("--warmup", type=cli.positive_int("--warmup"), default=None, help="warm-up steps (default 3; 1 with --quick)")
    parser.add_argument("--steps", type=cli.positive_int("--steps"), default=None,
                        help="timed unprofiled steps (default 10; 3 with --quick)")
    parser.add_argument("--profiled-steps", type=cli.positive_int("--profiled-steps"), default=None,
                        help="steps run under the profiler (default 3; 1 with --quick)")
    parser.add_argument("--unet-filters", type=cli.positive_int("--unet-filters"), default=8,
                        help="U-Net base width (the paper's is 32; default 8)")
    parser.add_argument("--cosmoflow-layout", choices=common.COSMOFLOW_LAYOUTS, default="recipe",
                        help="recipe: gather before block 5 as recipes.cosmoflow.train does (default); "
                             "split-all: split up to the flatten where possible")
    common.add_optimizer_argument(parser)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per configuration (default 1800)")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke test: {QUICK_MODELS}, 1 warm-up, 3 timed steps, 1 profiled step")
    parser.add_argument("--out", default=None,
                        help=f"Markdown file whose {SECTION} section is (re)written "
                             f"(default docs/benchmarks.md; {QUICK_DIRECTORY}/benchmarks.md with --quick)")
    parser.add_argument("--json", default=None,
                        help="also write the raw results here (per rank: categories, convolution parts, "
                             "busy/idle, step times, top ops)")
    parser.add_argument("--trace-dir", default=None,
                        help="keep each rank's profiler trace under DIR/<model><size>_<config>/rank<r> "
                             "(TensorBoard's profile plugin reads it; by default traces are deleted)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        return args
    quick = args.quick
    args.trace_dir = os.path.abspath(args.trace_dir) if args.trace_dir else None
    args.models = args.models or (QUICK_MODELS if quick else DEFAULT_MODELS)
    args.warmup = args.warmup or (1 if quick else 3)
    args.steps = args.steps or (3 if quick else 10)
    args.profiled_steps = args.profiled_steps or (1 if quick else 3)
    args.out = os.path.abspath(args.out or (os.path.join(QUICK_DIRECTORY, "benchmarks.md") if quick else common.BENCHMARKS_MD))
    check_jobs(parser, args, "the split's compute is compared with it")
    args.parser = parser
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        worker(json.loads(args.worker))
        return 0
    command = common.command_line("benchmarks/profile_step.py", sys.argv[1:] if argv is None else argv)
    if any(CONFIGS[key][1] > 1 for key in args.configs):
        common.horovodrun_path()  # fail now, not after the one-rank runs
    specs = plan_specs(args, profiled_steps=args.profiled_steps, optimizer=args.optimizer,
                       trace_dir=args.trace_dir)
    rows, failures = [], 0
    for index, spec in enumerate(specs, start=1):
        others = common.cores_busy_by_others()
        print(f"[{index}/{len(specs)}] {spec['model']} {spec['size']}^3, {spec['label']} "
              f"({spec['ranks']} ranks x {spec['threads']} threads; other processes used "
              f"{common.cores_text(others)} cores just before) ...", flush=True)
        start = time.perf_counter()
        try:
            per_rank = summarize(common.launch_worker(__file__, spec, spec["ranks"], spec["threads"], args.timeout))
            row = dict(spec, per_rank=per_rank)
            for result in per_rank:
                print(f"    -> rank {result['rank']}: step {result['step']:.3f} s, profiled "
                      f"{result['profiled_step']:.3f} s, kernels busy {result['busy']:.3f} s, idle "
                      f"{result['idle']:.3f} s", flush=True)
            print(f"    ({time.perf_counter() - start:.0f} s wall)", flush=True)
        except RuntimeError as error:
            print(f"    -> FAILED: {error}", flush=True)
            row, failures = dict(spec, error=str(error)), failures + 1
        rows.append(row)
    return common.publish(SECTION, render(rows, args, command), args.out, rows, args.json, failures)


if __name__ == "__main__":
    sys.exit(main())
