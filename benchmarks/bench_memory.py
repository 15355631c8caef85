"""Benchmark: peak memory per rank of one training step, 1-, 2- and 4-way spatial splits.

Full run (about 15 minutes on a 2-core machine with about 12 GB of free memory; writes
the `bench_memory` section of docs/benchmarks.md and docs/bench_memory.png):

    .venv/bin/python benchmarks/bench_memory.py

Smoke test (32^3 and 64^3; writes to a temporary directory unless --out/--plot are given):

    .venv/bin/python benchmarks/bench_memory.py --quick

For the paper's CosmoFlow (`recipes.cosmoflow.model.build_model(W, 'paper')`) at 128^3
and 256^3 and the splits 1x1x1 (a plain `python` process, no Horovod), 2x1x1 and 4x1x1
(horovodrun --gloo; the 4-way split gathers the volume before the first block whose
volume cannot be split 4 ways), every rank measures its peak resident set size two ways,
`getrusage(RUSAGE_SELF).ru_maxrss` and `VmHWM` of /proc/self/status, in two separate jobs
that differ only in the step:

* baseline job: imports, Horovod start-up, model built, Adam built (weights broadcast,
  slots allocated), one sample's local shard and target created, one small fused
  allreduce (Horovod's fusion buffer), the training step traced but NOT run;
* step job: the same, then one training step (forward with training=True, MSE, backward,
  world-averaged gradients, Adam update) of one sample.

Fixed runtime overhead = the baseline job's peak; what scales with the split = the step
job's peak minus the baseline job's peak, same rank. Next to RSS, the step job records
TensorFlow's own CPU allocator count (`tf.config.experimental.get_memory_info`): its peak
bytes in use during the step minus those in use before it. The same difference within the
step job (peak minus the high-water mark just before the step) is reported as a check.
The part of a step's memory that does not depend on W (gradients of the 9.4 M
parameters, their world average, optimizer temporaries, first-execution allocations) is
measured by the same job pair at --reference-size (32^3, where activations are tiny) and
subtracted to estimate the activation memory. Next to it, the layout plan's estimate
(`strategy.summary(model)`: the bytes of every layer's local forward output, float32, one
sample) per rank.
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

SECTION = "bench_memory"
DEFAULT_SIZES = "128,256"
QUICK_SIZES = "32,64"
SPLITS = ((1, 1, 1), (2, 1, 1), (4, 1, 1))
DEFAULT_PLOT = os.path.join(common.REPO_ROOT, "docs", "bench_memory.png")
QUICK_DIRECTORY = common.QUICK_DIRECTORY
MIB = 2**20
TARGET_RATIO = 0.3


# Worker (one rank) -------------------------------------------------------------------------
def worker(spec: dict) -> None:
    marks = {"start": common.proc_status_kib("VmRSS")}
    common.configure_threads(1)
    import numpy as np
    import tensorflow as tf

    import keras_spatial as ks
    from keras_spatial import comm
    import recipes.cosmoflow.model  # noqa: F401  (counted with the imports)

    marks["imports"] = common.proc_status_kib("VmRSS")
    strategy = ks.SpatialStrategy(tuple(spec["spatial"]))
    if strategy.size != spec["ranks"]:
        raise RuntimeError(f"expected {spec['ranks']} ranks, the launcher started {strategy.size}")
    marks["horovod_init"] = common.proc_status_kib("VmRSS")
    training = common.make_training_step(strategy, spec, spec["optimizer"], seed=strategy.rank)
    marks["model_optimizer_data"] = common.proc_status_kib("VmRSS")
    if strategy.size > 1:
        # Horovod allocates its fusion buffer at the first fused allreduce: a fixed cost.
        comm.grouped_allreduce([tf.zeros([1]), tf.zeros([1])], strategy.world_process_set,
                               name="bench_memory_warmup", op="average")
    training.step.get_concrete_function(training.x, training.y)
    common.barrier(strategy, "traced")
    marks["traced"] = common.proc_status_kib("VmRSS")
    hwm_before_step = common.proc_status_kib("VmHWM")
    loss = None
    allocator_rise = None
    if spec["run_step"]:
        in_use_before = _allocator_bytes(tf, "current")
        if in_use_before is not None:
            tf.config.experimental.reset_memory_stats("CPU:0")
        start = time.perf_counter()
        loss = training.run()
        if in_use_before is not None:
            allocator_rise = _allocator_bytes(tf, "peak") - in_use_before
        if not np.isfinite(loss):
            raise RuntimeError(f"non-finite loss {loss} on rank {strategy.rank}")
        if strategy.rank == 0:
            print(f"    step: {time.perf_counter() - start:.1f} s", flush=True)
    result = {
        "rank": strategy.rank,
        "marks_kib": marks,
        "hwm_before_step_kib": hwm_before_step,
        "vmhwm_kib": common.proc_status_kib("VmHWM"),
        "ru_maxrss_kib": common.ru_maxrss_kib(),
        "plan_bytes": sum(row["bytes"] for row in strategy.summary(training.model, print_fn=None)),
        "input_bytes": 4 * int(np.prod(training.x.shape)),
        "allocator_rise_bytes": allocator_rise,
        "loss": loss,
    }
    common.barrier(strategy, "done")
    results = common.gather_results(strategy, result, "memory")
    if strategy.rank == 0:
        common.write_result(spec, results)


def _allocator_bytes(tf, key: str):
    """TensorFlow's CPU allocator's bytes in use ("current") or their peak since the last
    reset ("peak"), or None where the allocator keeps no statistics."""
    try:
        return tf.config.experimental.get_memory_info("CPU:0")[key]
    except ValueError:
        return None


# Driver ------------------------------------------------------------------------------------
def measure(spec: dict, timeout: float) -> dict:
    """Baseline and step jobs of one (size, split); per-rank numbers in MiB."""
    runs = {}
    for run_step in (False, True):
        job = "step" if run_step else "baseline"
        print(f"    {job} job ...", flush=True)
        runs[job] = common.launch_worker(__file__, dict(spec, run_step=run_step), spec["ranks"], 1, timeout)
    ranks = []
    for base, step in zip(runs["baseline"], runs["step"]):
        peak = step["vmhwm_kib"] / 1024
        baseline = base["vmhwm_kib"] / 1024
        ranks.append({
            "rank": step["rank"],
            "baseline": baseline,
            "baseline_ru": base["ru_maxrss_kib"] / 1024,
            "peak": peak,
            "peak_ru": step["ru_maxrss_kib"] / 1024,
            "scaling": peak - baseline,
            "in_process": peak - step["hwm_before_step_kib"] / 1024,
            "pre_step_hwm": step["hwm_before_step_kib"] / 1024,
            "marks": {k: v / 1024 for k, v in base["marks_kib"].items()},
            "plan": step["plan_bytes"] / MIB,
            "allocator": None if step["allocator_rise_bytes"] is None else step["allocator_rise_bytes"] / MIB,
            "input": step["input_bytes"] / MIB,
        })
    return dict(spec, ranks_data=ranks)


def _worst(row: dict, key: str):
    """The largest value of `key` over the row's ranks (None if a rank has none)."""
    values = [r.get(key) for r in row["ranks_data"]]
    return None if any(v is None for v in values) else max(values)


def _serial(rows: list[dict], size: int):
    for row in rows:
        if row["size"] == size and row["spatial_size"] == 1 and "ranks_data" in row:
            return row
    return None


def _ratio(value, reference) -> str:
    """value / reference to 2 decimals, or "—" where either is missing (or reference <= 0)."""
    return "—" if value is None or reference is None or reference <= 0 else f"{value / reference:.2f}"


def _split_label(row: dict) -> str:
    label = common.shape_text(row["spatial"])
    if row.get("gather_before_block"):
        label += f" (gathered before block {row['gather_before_block']})"
    return label


MAIN_HEADER = [
    "size", "split", "ranks", "fixed overhead: baseline peak (MiB)", "peak with step (MiB)",
    "scales: peak − baseline (MiB)", "scales vs serial",
    "activations: scales − W-independent step cost (MiB)", "activations vs serial",
    "allocator: step peak − in use before (MiB)", "allocator activations (MiB)",
    "allocator activations vs serial",
    "plan: activations per rank (MiB)", "plan vs serial",
    "check: peak − pre-step HWM, same job (MiB)", "input shard (MiB)",
]
FIXED_HEADER = [
    "size", "split", "after imports", "after Horovod init", "after model + Adam + data",
    "after tracing the step", "baseline peak (VmHWM)", "baseline peak (ru_maxrss)",
]


def _activations(rows: list[dict], row: dict, reference_size: int, key: str = "scaling"):
    """The worst rank's `key` ("scaling": RSS, or "allocator") minus that of the reference
    size on the same split (the part of a step's memory that does not depend on W), or
    None without a reference or a value."""
    for other in rows:
        if (other["size"] == reference_size and other["spatial"] == row["spatial"]
                and "ranks_data" in other and other is not row):
            value, reference = _worst(row, key), _worst(other, key)
            return None if value is None or reference is None else value - reference
    return None


def _optional(value, digits: int = 0) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def main_rows(rows: list[dict], reference_size: int) -> list[list[str]]:
    out = []
    for row in rows:
        size = f"{row['size']}^3" + (" (reference)" if row["size"] == reference_size else "")
        head = [size, _split_label(row), str(row["ranks"])]
        if "ranks_data" not in row:
            out.append(head + [f"FAILED: {row['error']}"] + ["—"] * (len(MAIN_HEADER) - 4))
            continue
        serial = _serial(rows, row["size"])
        scaling, plan = _worst(row, "scaling"), _worst(row, "plan")
        activations = _activations(rows, row, reference_size)
        serial_activations = serial and _activations(rows, serial, reference_size)
        allocator = _activations(rows, row, reference_size, "allocator")
        serial_allocator = serial and _activations(rows, serial, reference_size, "allocator")
        out.append(head + [
            f"{_worst(row, 'baseline'):.0f}", f"{_worst(row, 'peak'):.0f}", f"{scaling:.0f}",
            _ratio(scaling, serial and _worst(serial, "scaling")),
            _optional(activations), _ratio(activations, serial_activations),
            _optional(_worst(row, "allocator")), _optional(allocator), _ratio(allocator, serial_allocator),
            f"{plan:.0f}", _ratio(plan, serial and _worst(serial, "plan")),
            f"{_worst(row, 'in_process'):.0f}", f"{_worst(row, 'input'):.1f}",
        ])
    return out


def fixed_rows(rows: list[dict]) -> list[list[str]]:
    out = []
    for row in rows:
        if "ranks_data" not in row:
            continue
        marks = [max(r["marks"][k] for r in row["ranks_data"])
                 for k in ("imports", "horovod_init", "model_optimizer_data", "traced")]
        out.append([f"{row['size']}^3", _split_label(row), *(f"{m:.0f}" for m in marks),
                    f"{_worst(row, 'baseline'):.0f}", f"{_worst(row, 'baseline_ru'):.0f}"])
    return out


def evaluate_target(rows: list[dict], reference_size: int) -> list[str]:
    if not any(r["size"] == 256 for r in rows):
        return [f"- Per-rank activation memory at 4-way <= {TARGET_RATIO} of serial at 256^3: **not "
                "evaluated** (no 256^3 in this run)."]
    serial = _serial(rows, 256)
    four = next((r for r in rows if r["size"] == 256 and r["spatial_size"] == 4 and "ranks_data" in r), None)
    if serial is None or four is None:
        return ["- 4-way vs serial at 256^3: not measured (see the table)."]
    measured = _worst(four, "scaling") / _worst(serial, "scaling")
    planned = _worst(four, "plan") / _worst(serial, "plan")
    verdict = "MET" if measured <= TARGET_RATIO else "NOT MET"
    lines = [
        f"- Per-rank memory that scales, 4x1x1 vs serial at 256^3 (measured: step-job peak − "
        f"baseline-job peak, worst rank; includes the W-independent step cost): "
        f"{_worst(four, 'scaling'):.0f} / {_worst(serial, 'scaling'):.0f} MiB = **{measured:.2f}** "
        f"(target <= {TARGET_RATIO}) -> **{verdict}**.",
    ]
    for key, measure_text in (
        ("scaling", "Activation memory measured (the same minus the W-independent step cost, i.e. "
                    f"minus the {reference_size}^3 job's on the same split)"),
        ("allocator", "Activation memory in TensorFlow's allocator (its peak bytes in use during the "
                      f"step minus those before it, minus the same of the {reference_size}^3 job on "
                      "the same split)"),
    ):
        four_act = _activations(rows, four, reference_size, key)
        serial_act = _activations(rows, serial, reference_size, key)
        if four_act is not None and serial_act:
            ratio = four_act / serial_act
            lines.append(
                f"- {measure_text}: {four_act:.0f} / {serial_act:.0f} MiB = **{ratio:.2f}** -> "
                f"**{'MET' if ratio <= TARGET_RATIO else 'NOT MET'}**."
            )
    return lines + [
        f"- Plan estimate of forward activations per rank, same comparison: {_worst(four, 'plan'):.0f} / "
        f"{_worst(serial, 'plan'):.0f} MiB = {planned:.2f} "
        f"({'within' if planned <= TARGET_RATIO else 'above'} the target).",
    ]


def render(rows: list[dict], args: argparse.Namespace, command: str) -> str:
    lines = ["## Peak memory per rank of one training step (`benchmarks/bench_memory.py`)", ""]
    if args.quick:
        lines += ["**QUICK MODE (smoke test at 32^3 and 64^3): these numbers check that the tool "
                  "works; they are not benchmark results.**", ""]
    lines += [
        *common.run_header(command),
        "",
        "Model: the paper's CosmoFlow (`recipes.cosmoflow.model.build_model(W, 'paper')`, 9.4 M "
        f"parameters, no batch norm), one sample of W^3 x 4 float32, {common.optimizer_label(args.optimizer)}, "
        "MSE, one TensorFlow thread per rank. MiB = 2^20 bytes. Per-rank values are the WORST rank's.",
        "",
        *common.markdown_table(MAIN_HEADER, main_rows(rows, args.reference_size)),
        "",
        "- *fixed overhead: baseline peak*: peak RSS (VmHWM) of a job that does everything the "
        "step job does except running the step: imports, Horovod start-up, model and Adam built "
        "(weights broadcast, slots allocated), the local input shard and target created, one "
        "small fused allreduce (Horovod allocates its fusion buffer; its pages count in RSS only "
        "once the step's gradient allreduce touches them), the step traced into a graph.",
        "- *peak with step*: VmHWM after one training step (getrusage's ru_maxrss agreed within "
        f"{_max_peak_disagreement(rows):.0f} MiB in this run). *scales* = peak with step − "
        "baseline peak of the same rank in the separate baseline job: activations kept for the "
        "backward pass and temporaries (which shrink with the split), plus a part that does not "
        "depend on W: gradients (38 MB), the world-averaged copies of them (split runs), Adam's "
        "update temporaries, what TensorFlow allocates on first execution (kernels, oneDNN "
        "scratch). *check*: the same difference inside the step job (peak minus its high-water "
        "mark just before the step).",
        f"- *activations*: *scales* minus *scales* of the {args.reference_size}^3 job on the same "
        "split. The paper's CosmoFlow has the same 9.4 M parameters at every W, so that job has the "
        "same W-independent step cost with almost no activations (the plan column shows how "
        "little); the difference estimates the activation memory. Approximate: a peak is not "
        "exactly a sum of parts (gradients grow while activations are freed during the backward "
        "pass). Repeated quick runs differed by up to about 10 MiB per job, so this difference "
        "means little below a few hundred MiB (as at 64^3). *scales vs serial* is the "
        "conservative ratio, *activations vs serial* the one the target is about."
        if args.reference_size else
        "- *activations*: not computed (run with --reference-size).",
        "- *allocator*: TensorFlow's own count of the bytes its CPU allocator has handed out "
        "(`tf.config.experimental.get_memory_info('CPU:0')`): the peak during the step minus the "
        "bytes in use just before it, worst rank; *allocator activations*: the same minus that of "
        f"the {args.reference_size}^3 job on the same split. With oneDNN (TF_ENABLE_ONEDNN_OPTS=1, which the Makefile and the benchmark tools set), "
        "that allocator is a best-fit pool (`MklCPUAllocator`, BFC) that never gives memory back "
        "to the system: RSS counts every page of the pool a step has touched, so RSS peaks also "
        "hold free chunks left between live ones by the order of allocation, and that order "
        "varies between runs (docs/benchmarks.md, \"Why RSS and the allocator count differ\"). "
        "The allocator count is what "
        "the tensors hold, in whole pool chunks.",
        "- *plan*: `strategy.summary(model)`'s total, the bytes of every layer's local forward "
        "output for one sample (float32), of the worst rank; it counts no gradients, halo buffers "
        "or temporaries, and TensorFlow frees some outputs early and keeps others for the backward "
        "pass, so it is an estimate of the scale, not of the measured difference.",
        "- The 4x1x1 rows gather the volume before the first block whose volume cannot be split 4 "
        "ways; the blocks after that run on the whole (small) volume on every rank.",
        "",
        "Fixed overhead, VmRSS (MiB) at each point of the baseline job, worst rank (the "
        "ru_maxrss column should equal VmHWM: Linux carries a process's ru_maxrss across execve, "
        "so a worker exec'ed by a large parent would report the parent's peak; the driver "
        "therefore imports no TensorFlow before its launches):",
        "",
        *common.markdown_table(FIXED_HEADER, fixed_rows(rows)),
        "",
        "### Target",
        "",
        *evaluate_target(rows, args.reference_size),
        "",
        f"Plot: `{os.path.relpath(args.plot, os.path.dirname(os.path.abspath(args.out)))}` "
        "(per rank: fixed overhead + what scales, and the plan's estimate).",
    ]
    return "\n".join(lines) + "\n"


def _max_peak_disagreement(rows: list[dict]) -> float:
    values = [abs(r["peak"] - r["peak_ru"]) for row in rows if "ranks_data" in row for r in row["ranks_data"]]
    return max(values, default=0.0)


def plot(rows: list[dict], path: str, quick: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["size"] for r in rows if "ranks_data" in r})
    fig, axes = plt.subplots(1, max(len(sizes), 1), figsize=(6 * max(len(sizes), 1), 5.5), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        measured = [r for r in rows if r["size"] == size and "ranks_data" in r]
        positions = range(len(measured))
        baseline = [_worst(r, "baseline") for r in measured]
        scaling = [_worst(r, "scaling") for r in measured]
        ax.bar([p - 0.2 for p in positions], baseline, 0.4, color="lightgray", label="fixed overhead (baseline peak)")
        ax.bar([p - 0.2 for p in positions], scaling, 0.4, bottom=baseline, color="tab:blue",
               label="scales (peak − baseline)")
        ax.bar([p + 0.2 for p in positions], [_worst(r, "plan") for r in measured], 0.4, color="tab:orange",
               hatch="//", label="plan: forward activations")
        ax.set_xticks(list(positions))
        ax.set_xticklabels([_split_label(r).replace(" (", "\n(") for r in measured], fontsize=8)
        ax.set_ylabel("MiB per rank (worst rank)")
        ax.set_title(f"CosmoFlow (paper) {size}^3, one training step")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    if quick:
        fig.suptitle("QUICK MODE smoke test: not benchmark numbers", color="red")
    common.save_figure(fig, path)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="full run:    .venv/bin/python benchmarks/bench_memory.py\n"
               "smoke test:  .venv/bin/python benchmarks/bench_memory.py --quick",
    )
    parser.add_argument("--sizes", type=cli.int_list("--sizes", 32), default=None,
                        help=f"comma-separated cubic sizes W (default {DEFAULT_SIZES}; {QUICK_SIZES} with --quick)")
    parser.add_argument("--reference-size", type=cli.non_negative_int("--reference-size"), default=32,
                        help="W of the extra jobs that measure the W-independent part of a step's "
                             "memory (default 32, the smallest the model takes; 0 to skip)")
    common.add_optimizer_argument(parser)
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per job (default 3600)")
    parser.add_argument("--quick", action="store_true", help=f"smoke test at {QUICK_SIZES}")
    parser.add_argument("--out", default=None,
                        help="Markdown file whose bench_memory section is (re)written "
                             f"(default docs/benchmarks.md; {QUICK_DIRECTORY}/benchmarks.md with --quick)")
    parser.add_argument("--plot", default=None,
                        help="PNG to write (default docs/bench_memory.png; in the quick directory with --quick)")
    parser.add_argument("--json", default=None, help="also write the raw results here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        return args
    args.sizes = args.sizes or [int(s) for s in (QUICK_SIZES if args.quick else DEFAULT_SIZES).split(",")]
    args.out = os.path.abspath(args.out or (os.path.join(QUICK_DIRECTORY, "benchmarks.md") if args.quick else common.BENCHMARKS_MD))
    args.plot = os.path.abspath(args.plot or (os.path.join(QUICK_DIRECTORY, "bench_memory.png") if args.quick else DEFAULT_PLOT))
    args.parser = parser
    return args


def plan_specs(args: argparse.Namespace) -> list[dict]:
    """Every (size, split) job pair, the reference size included, layouts checked first."""
    specs = []
    for size in sorted(set(args.sizes) | ({args.reference_size} if args.reference_size else set())):
        for spatial in SPLITS:
            spatial_size = spatial[0] * spatial[1] * spatial[2]
            specs.append({"model": "cosmoflow", "size": size, "spatial": list(spatial),
                          "spatial_size": spatial_size, "ranks": spatial_size, "unet_filters": None,
                          "optimizer": args.optimizer,
                          "reference": size == args.reference_size and size not in args.sizes})
    for spec, layout in zip(specs, common.check_layouts(specs)):
        if "error" in layout:
            args.parser.error(layout["error"])
        spec["gather_before_block"] = layout["gather_before_block"]
    return specs


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        worker(json.loads(args.worker))
        return 0
    command = common.command_line("benchmarks/bench_memory.py", sys.argv[1:] if argv is None else argv)
    common.horovodrun_path()
    specs = plan_specs(args)
    rows, failures = [], 0
    for index, spec in enumerate(specs, start=1):
        print(f"[{index}/{len(specs)}] CosmoFlow {spec['size']}^3, split {_split_label(spec)} on "
              f"{spec['ranks']} rank(s) ...", flush=True)
        try:
            row = measure(spec, args.timeout)
            print(f"    -> worst rank: baseline {_worst(row, 'baseline'):.0f} MiB, peak "
                  f"{_worst(row, 'peak'):.0f} MiB, scales {_worst(row, 'scaling'):.0f} MiB, plan "
                  f"{_worst(row, 'plan'):.0f} MiB, allocator {_optional(_worst(row, 'allocator'))} MiB",
                  flush=True)
        except RuntimeError as error:
            print(f"    -> FAILED: {error}", flush=True)
            row, failures = dict(spec, error=str(error)), failures + 1
        rows.append(row)
    plot(rows, args.plot, args.quick)
    return common.publish(SECTION, render(rows, args, command), args.out, rows, args.json, failures,
                          also_written=args.plot)


if __name__ == "__main__":
    sys.exit(main())
