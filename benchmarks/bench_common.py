"""Helpers shared by benchmarks/bench_scaling.py and benchmarks/bench_memory.py (not a command).

* the benchmark models: the paper's CosmoFlow (`recipes.cosmoflow.model`, gathered before
  the first block a mesh cannot split evenly) and a small 3D U-Net with the paper's
  structure at a fraction of its width;
* one training step (forward, MSE loss, backward, optimizer update) of one sample per
  data group, as a `tf.function`;
* launching a worker on N local ranks (horovodrun with Gloo; a plain `python` process for
  one rank) with a fixed number of TensorFlow threads per rank, and collecting rank 0's
  JSON result;
* the Markdown file `docs/benchmarks.md`, in which each tool owns one section between
  `<!-- BEGIN name -->` and `<!-- END name -->` markers, so the tools never overwrite
  each other's results;
* machine, machine-use and version facts for the reports; peak RSS from /proc and getrusage.

Nothing here imports TensorFlow at module level: the thread settings must be applied
before TensorFlow starts (`configure_threads`).
"""

from __future__ import annotations

import dataclasses
import datetime
import fcntl
import functools
import importlib
import json
import math
import os
import platform
import resource
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Optional, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where `--quick` smoke runs write, so that they never touch docs/.
QUICK_DIRECTORY = os.path.join(tempfile.gettempdir(), "keras_spatial_bench_quick")
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# oneDNN's 3D convolutions are about 3x faster than TensorFlow's default (Eigen) kernels on
# CPUs without AVX-512 VNNI, where TensorFlow leaves them off (README, "Speed on CPUs").
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

BENCHMARKS_MD = os.path.join(REPO_ROOT, "docs", "benchmarks.md")
# Sections of docs/benchmarks.md, in the order they appear in the file.
SECTION_ORDER = ("bench_scaling", "bench_memory", "profile_step")
MODELS = ("cosmoflow", "unet")
CHANNELS = 4
UNET_CLASSES = 3
UNET_LEVELS = 3
UNET_PAPER_BASE_FILTERS = 32


# Command-line helpers ------------------------------------------------------------------
def shape_text(shape: Sequence[int]) -> str:
    return "x".join(str(int(s)) for s in shape)


def command_line(script: str, argv: Sequence[str]) -> str:
    """The command as a user at the repository root would type it."""
    import shlex

    python = os.path.relpath(sys.executable, REPO_ROOT)
    python = "python" if python.startswith("..") else python
    return " ".join([python, script, *(shlex.quote(a) for a in argv)])


# Machine facts ----------------------------------------------------------------------------
def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), else os.cpu_count()."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next(l.split(":", 1)[1].strip() for l in info if l.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def memory_total_gib() -> float:
    with open("/proc/meminfo") as info:
        for line in info:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    raise RuntimeError("MemTotal not found in /proc/meminfo")


def versions() -> str:
    """Python, TensorFlow, Keras, NumPy and Horovod versions (imports TensorFlow)."""
    import keras
    import numpy
    import tensorflow as tf

    try:
        import horovod

        horovod_version = horovod.__version__
    except ImportError:
        horovod_version = "not installed"
    return (
        f"Python {platform.python_version()}, TensorFlow {tf.__version__}, Keras "
        f"{keras.__version__}, NumPy {numpy.__version__}, Horovod {horovod_version} (Gloo)"
    )


def machine_line() -> str:
    return (
        f"{usable_cores()} cores ({cpu_model()}, {platform.machine()}), "
        f"{memory_total_gib():.0f} GiB RAM, {platform.system()} {platform.release()}"
    )


def today() -> str:
    return datetime.date.today().isoformat()


# Machine use: other processes and the hypervisor --------------------------------------
# Fields of /proc/stat's "cpu" line (jiffies over all CPUs); guest time is already in user.
_CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_counters() -> Optional[dict]:
    """The machine's CPU time counters (/proc/stat's "cpu" line, in jiffies summed over
    all CPUs: `_CPU_FIELDS`), or None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as stat:
            values = stat.readline().split()[1:1 + len(_CPU_FIELDS)]
    except OSError:
        return None
    return dict(zip(_CPU_FIELDS, map(int, values + ["0"] * (len(_CPU_FIELDS) - len(values)))))


def cpu_use_between(before: Optional[dict], after: Optional[dict]) -> Optional[dict]:
    """Between two `cpu_counters` readings: "busy", the cores kept busy on average (all
    but idle, iowait and steal), and "stolen", the share of the CPUs' time that the
    hypervisor gave to other guests (steal: the VM wanted to run and could not). None if
    either reading is missing or no time passed."""
    if before is None or after is None:
        return None
    delta = {field: after[field] - before[field] for field in _CPU_FIELDS}
    total = sum(delta.values())
    if total <= 0:
        return None
    busy = total - delta["idle"] - delta["iowait"] - delta["steal"]
    return {"busy": (os.cpu_count() or 1) * busy / total, "stolen": delta["steal"] / total}


def cores_busy_by_others(seconds: float = 1.0) -> Optional[float]:
    """Cores the machine kept busy over `seconds` while this process slept: what other
    processes used just before a measurement (unlike the load average, not inflated by
    the benchmark's own jobs that just ended). None where there is no /proc/stat."""
    before = cpu_counters()
    time.sleep(seconds)
    use = cpu_use_between(before, cpu_counters())
    return None if use is None else use["busy"]


def cores_text(cores: Optional[float]) -> str:
    """How reports print a number of cores from `cores_busy_by_others`: '?' for None."""
    return "?" if cores is None else f"{cores:.2f}"


# Memory -----------------------------------------------------------------------------------
def proc_status_kib(field: str) -> int:
    """A `kB` field of /proc/self/status (VmRSS, VmHWM, ...), in KiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


def ru_maxrss_kib() -> int:
    """getrusage(RUSAGE_SELF).ru_maxrss: peak RSS in KiB (Linux reports KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


# Models -----------------------------------------------------------------------------------
# CosmoFlow layouts: "recipe" gathers before block 5 (recipes.cosmoflow.train's default,
# where LBANN stops the split) when that is valid; "split-all" splits up to the flatten
# whenever it can (the layout before that optimisation).
COSMOFLOW_LAYOUTS = ("recipe", "split-all")
RECIPE_GATHER_BEFORE_BLOCK = 5


def cosmoflow_gather_block(size: int, spatial_shape: Sequence[int], layout: str = "recipe") -> Optional[int]:
    """With layout "recipe", 5 when gathering before block 5 is valid; otherwise None if
    the paper's CosmoFlow at `size`^3 splits evenly on `spatial_shape` up to its flatten,
    else the LATEST block (7 .. 2) before which gathering the volume makes the layout
    valid (LBANN likewise stops the split before the last pools).

    Pure arithmetic (`keras_spatial.plan.plan_for_mesh`), no Horovod: call it before a
    `SpatialStrategy` exists (models built afterwards, even outside its scope, use it).

    Raises:
        ValueError: if no gather position makes the layout valid.
    """
    from keras_spatial.plan import plan_for_mesh
    from recipes.cosmoflow.model import build_model

    if layout not in COSMOFLOW_LAYOUTS:
        raise ValueError(f"`layout` must be one of {COSMOFLOW_LAYOUTS}. Received: {layout!r}")
    errors = []
    order = (None, 7, 6, 5, 4, 3, 2)
    if layout == "recipe" and math.prod(spatial_shape) > 1:
        order = (RECIPE_GATHER_BEFORE_BLOCK,) + order
    for block in order:
        try:
            plan_for_mesh(lambda: build_model(size, "paper", gather_before_block=block), spatial_shape)
            return block
        except ValueError as error:
            errors.append(f"gather_before_block={block}: {error}")
    raise ValueError(
        f"The paper's CosmoFlow at {size}^3 cannot be split {shape_text(spatial_shape)} "
        "with any gather position:\n" + "\n".join(errors)
    )


def _check_layout(item: dict) -> Optional[int]:
    if item["model"] == "cosmoflow":
        return cosmoflow_gather_block(item["size"], item["spatial"], item.get("cosmoflow_layout", "recipe"))
    from keras_spatial.plan import plan_for_mesh

    plan_for_mesh(lambda: build_benchmark_model(item), item["spatial"])
    return None


def check_layouts(items: Sequence[dict]) -> list[dict]:
    """For each {model, size, spatial, unet_filters}: {"gather_before_block": block or
    None} if the layout is valid (see `cosmoflow_gather_block`), else {"error": message}.

    Runs in a separate `python` process, so that a driver never imports TensorFlow
    before it launches its workers: on Linux a process's ru_maxrss keeps the high-water
    mark of whatever exec'ed it (the kernel carries it across execve), so a worker started
    by a driver holding TensorFlow and built models would report the driver's peak.

    Raises:
        RuntimeError: if the checking process fails.
    """
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--check-layouts", json.dumps(list(items))],
                          capture_output=True, text=True, env=env, cwd=REPO_ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"the layout check failed (status {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _check_layouts_main(items: list[dict]) -> None:
    results = []
    for item in items:
        try:
            results.append({"gather_before_block": _check_layout(item)})
        except ValueError as error:
            results.append({"error": str(error)})
    print(json.dumps(results))


def build_benchmark_model(spec: dict):
    """The model of `spec` (keys model, size, gather_before_block, unet_filters), built
    in the current scope: CosmoFlow is `recipes.cosmoflow.model.build_model(size,
    'paper')`, the U-Net `recipes.unet3d.model.build_model` with the paper's structure
    (depth 3, 3 classes, batch norm) at base width `unet_filters`.
    """
    if spec["model"] == "cosmoflow":
        from recipes.cosmoflow.model import build_model

        return build_model(spec["size"], "paper", gather_before_block=spec.get("gather_before_block"))
    if spec["model"] == "unet":
        from recipes.unet3d.model import build_model

        return build_model((spec["size"],) * 3 + (CHANNELS,), classes=UNET_CLASSES,
                           depth=UNET_LEVELS, base_filters=spec["unet_filters"])
    raise ValueError(f"Unknown model {spec['model']!r}; expected one of {MODELS}.")


def model_label(spec: dict) -> str:
    if spec["model"] == "cosmoflow":
        return "CosmoFlow (paper)"
    factor = UNET_PAPER_BASE_FILTERS // spec["unet_filters"] if UNET_PAPER_BASE_FILTERS % spec["unet_filters"] == 0 else None
    width = f"1/{factor} width" if factor and factor > 1 else f"base {spec['unet_filters']} filters"
    return f"3D U-Net ({width})"


# Training step ----------------------------------------------------------------------------
def configure_threads(threads: int) -> None:
    """One TensorFlow intra-op pool of `threads` threads and ONE inter-op thread.

    Must run before TensorFlow executes anything (TensorFlow raises a RuntimeError
    otherwise, which is left to propagate).
    """
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)


@dataclasses.dataclass
class TrainingStep:
    """A built model, its (distributed) optimizer, one sample per rank and the step."""

    model: Any
    optimizer: Any
    x: Any
    y: Any
    step: Callable  # tf.function(x, y) -> loss

    def run(self) -> float:
        """One step; returns the loss (the `.numpy()` waits for the step to finish)."""
        return float(self.step(self.x, self.y).numpy())


# --optimizer of the step tools: name -> (how the tables name it, module, attribute path of
# the optimizer class).
OPTIMIZERS = {
    "fused_adam": ("Adam (keras_spatial.FusedAdam)", "keras_spatial", "FusedAdam"),
    "adam": ("Adam (keras.optimizers.Adam)", "keras", "optimizers.Adam"),
    "sgd": ("SGD (keras.optimizers.SGD)", "keras", "optimizers.SGD"),
}


def optimizer_label(name: str) -> str:
    """How the tables name the --optimizer `name`."""
    return OPTIMIZERS[name][0]


def add_optimizer_argument(parser) -> None:
    """--optimizer, the same in every tool that times or measures the training step."""
    parser.add_argument(
        "--optimizer", choices=tuple(OPTIMIZERS), default="fused_adam",
        help="the update after the gradient average, in every configuration of the run: "
             "fused_adam (default: Keras's Adam with each variable's update compiled by XLA), adam "
             "(keras.optimizers.Adam, updates not compiled) or sgd",
    )


def make_training_step(strategy, spec: dict, optimizer_name: str, seed: int) -> TrainingStep:
    """Build the model of `spec` under `strategy`, a world-averaging optimizer (built, so
    weights are broadcast and Adam's slots exist) and random local data of one sample.

    The step: forward with training=True, MSE against a random target (CosmoFlow: 4
    parameters, replicated; U-Net: per voxel of the local shard, mean over local voxels,
    which the gradient rule of docs/design.md makes the global mean), gradients of the
    trainable variables, `optimizer.apply` (one fused world allreduce of the gradients
    when the world has several ranks, then the update).
    """
    import tensorflow as tf

    with strategy.scope():
        model = build_benchmark_model(spec)
    if optimizer_name not in OPTIMIZERS:
        raise ValueError(f"`optimizer` must be one of {sorted(OPTIMIZERS)}. Received: {optimizer_name!r}")
    _, module, path = OPTIMIZERS[optimizer_name]
    optimizer_class = functools.reduce(getattr, path.split("."), importlib.import_module(module))
    optimizer = strategy.distribute_optimizer(optimizer_class(1e-3), bucket_bytes=spec.get("bucket_bytes"),
                                              shard_update=spec.get("shard_update", False))
    optimizer.build(model.trainable_variables)
    if spec.get("replicated_skip", True) and strategy.spatial_size > 1:
        # What ReplicatedLayerSync does in model.fit: gradients of layers that run on
        # gathered volumes are identical in a spatial group, averaged over data groups only.
        from keras_spatial.plan import replicated_layers

        optimizer.set_replicated_variables(
            v for layer in replicated_layers(model, strategy) for v in layer.trainable_variables
        )

    # Generated in place by TensorFlow: no NumPy temporaries to inflate peak-memory readings.
    x = tf.random.stateless_normal((1,) + tuple(model.input_shape[1:]), seed=[seed, 0])
    y = tf.random.stateless_uniform((1,) + tuple(model.output_shape[1:]), seed=[seed, 1], minval=-1.0, maxval=1.0)
    variables = model.trainable_variables

    @tf.function(jit_compile=False)
    def step(x_local, y_target):
        with tf.GradientTape() as tape:
            prediction = model(x_local, training=True)
            loss = tf.reduce_mean(tf.square(prediction - y_target))
        gradients = tape.gradient(loss, variables)
        optimizer.apply(gradients, variables)
        return loss

    return TrainingStep(model, optimizer, x, y, step)


def start_worker(spec: dict):
    """A benchmark worker's first steps: TensorFlow threads, the strategy of `spec`
    (checked against the number of ranks launched) and a `say` that prints on rank 0.

    Returns (strategy, say).
    """
    configure_threads(spec["threads"])
    import keras_spatial as ks

    strategy = ks.SpatialStrategy(tuple(spec["spatial"]))
    if strategy.size != spec["ranks"]:
        raise RuntimeError(f"expected {spec['ranks']} ranks, the launcher started {strategy.size}")

    def say(text: str) -> None:
        if strategy.rank == 0:
            print(f"    {text}", flush=True)

    return strategy, say


def barrier(strategy, name: str) -> None:
    """All ranks of the world reach this point (no-op for one rank)."""
    if strategy.size > 1:
        from keras_spatial import comm

        comm.allgather_object(None, name=f"bench.{name}")


def gather_results(strategy, result: dict, name: str) -> list[dict]:
    """Every rank's `result`, in rank order (on every rank)."""
    if strategy.size == 1:
        return [result]
    from keras_spatial import comm

    return comm.allgather_object(result, name=f"bench.{name}")


# Launching --------------------------------------------------------------------------------
def horovodrun_path() -> str:
    path = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"horovodrun not found next to {sys.executable}. Build Horovod with "
            "`bash tools/install_horovod.sh .venv/bin/python` (see the README)."
        )
    return path


def launch_worker(
    script: str, spec: dict, ranks: int, threads: int, timeout: float, extra_env: Optional[dict] = None
) -> list[dict]:
    """Run `script --worker SPEC` on `ranks` local ranks, `threads` TF threads each.

    One rank: a plain `python` process (a world of one, no Horovod, as a user's serial
    run). Several: `horovodrun --gloo -np N -H localhost:N`. Output streams to this
    process's stdout; `extra_env` is added to the job's environment. Returns the list
    rank 0 wrote as JSON (one dict per rank).

    Raises:
        RuntimeError: if the job fails or times out (it is then terminated: SIGTERM to
            its process group, SIGKILL after 30 s).
    """
    with tempfile.NamedTemporaryFile(prefix="bench_", suffix=".json", delete=False) as handle:
        result_path = handle.name
    spec = dict(spec, result=result_path)
    worker = [sys.executable, os.path.abspath(script), "--worker", json.dumps(spec)]
    if ranks == 1:
        command = worker
    else:
        command = [horovodrun_path(), "--gloo", "-np", str(ranks), "-H", f"localhost:{ranks}", *worker]
    env = dict(
        os.environ,
        TF_CPP_MIN_LOG_LEVEL="3",
        KERAS_BACKEND="tensorflow",
        OMP_NUM_THREADS=str(threads),
        PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])),
        **(extra_env or {}),
    )
    process = subprocess.Popen(command, env=env, cwd=REPO_ROOT, start_new_session=True)
    try:
        returncode = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _terminate_group(process)
        os.remove(result_path)
        raise RuntimeError(f"timed out after {timeout:.0f} s: {' '.join(command[:8])} ...") from None
    except BaseException:  # Ctrl-C: leave nothing running
        _terminate_group(process)
        raise
    try:
        if returncode != 0:
            raise RuntimeError(f"exited with status {returncode}: {' '.join(command[:8])} ...")
        with open(result_path) as handle:
            text = handle.read()
        if not text:
            raise RuntimeError("the job ended without writing its result (rank 0 failed?)")
        return json.loads(text)
    finally:
        if os.path.exists(result_path):
            os.remove(result_path)


def _terminate_group(process: subprocess.Popen) -> None:
    """SIGTERM the job's process group (horovodrun stops its ranks), SIGKILL if needed."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def write_result(spec: dict, results: list[dict]) -> None:
    """Rank 0 of a worker: hand all ranks' results to the driver."""
    with open(spec["result"], "w") as handle:
        json.dump(results, handle)


# docs/benchmarks.md ------------------------------------------------------------------------
FILE_HEADER = (
    "# Benchmarks: strong scaling, memory and where a step's time goes\n\n"
    "Written by `benchmarks/bench_scaling.py`, `benchmarks/bench_memory.py` and `benchmarks/profile_step.py`; "
    "each tool replaces "
    "only its own section (between its `BEGIN`/`END` markers). See also "
    "`docs/bench_halo.md` (halo exchange vs local convolution) and `docs/bench_io.md` "
    "(input pipeline).\n"
)


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"


def write_section(path: str, name: str, body: str) -> None:
    """Replace section `name` of the Markdown file `path` by `body` (or add it, in
    SECTION_ORDER), under an exclusive lock so two tools writing at once both land."""
    if name not in SECTION_ORDER:
        raise ValueError(f"Unknown section {name!r}; expected one of {SECTION_ORDER}.")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    begin, end = _markers(name)
    block = f"{begin}\n{body.rstrip()}\n{end}"
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        text = handle.read() or FILE_HEADER
        if begin in text:
            start, stop = text.index(begin), text.index(end, text.index(begin)) + len(end)
            text = text[:start] + block + text[stop:]
        else:
            later = [text.index(_markers(n)[0]) for n in SECTION_ORDER[SECTION_ORDER.index(name) + 1:]
                     if _markers(n)[0] in text]
            if later:
                text = text[: min(later)] + block + "\n\n" + text[min(later):]
            else:
                text = text.rstrip("\n") + "\n\n" + block + "\n"
        handle.seek(0)
        handle.truncate()
        handle.write(text if text.endswith("\n") else text + "\n")
        fcntl.flock(handle, fcntl.LOCK_UN)


def publish(section: str, report: str, out: str, rows: list, json_path: Optional[str],
            failures: int, also_written: Optional[str] = None) -> int:
    """A driver's last steps: print the report, write its section of `out` (and the raw
    rows to `json_path`, if given), report failures. Returns the exit status (1 if any
    configuration failed)."""
    print(report)
    write_section(out, section, report)
    print(f"Wrote the {section} section of {out}" + (f" and {also_written}" if also_written else ""))
    if json_path:
        with open(json_path, "w") as handle:
            json.dump(rows, handle, indent=1)
    if failures:
        print(f"{failures} configuration(s) FAILED (marked in the table)", file=sys.stderr)
        return 1
    return 0


def run_header(command: str) -> list[str]:
    """The lines every generated section starts with: command, date, machine, versions."""
    return [
        f"Command: `{command}`  ",
        f"Date: {today()}  ",
        f"Machine: {machine_line()}  ",
        f"Versions: {versions()}",
    ]


def save_figure(fig, path: str) -> None:
    """Lay out `fig`, write it to `path` as PNG (creating the directory) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in rows]
    return lines


def median_seconds(fn: Callable[[], Any], repeats: int, warmups: int = 2) -> float:
    """Median wall time of `repeats` calls of `fn` after `warmups` untimed ones (tracing)."""
    for _ in range(warmups):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return median(times)


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        raise ValueError("median of no values")
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else 0.5 * (ordered[middle - 1] + ordered[middle])


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--check-layouts":
        sys.exit("bench_common.py is a helper module; its only command is the internal --check-layouts JSON")
    _check_layouts_main(json.loads(sys.argv[2]))
