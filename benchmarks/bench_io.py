"""Benchmark of the spatially sharded HDF5 input pipeline (a script, not a test).

Writes a CosmoFlow-style data set (one 128^3 x 4 int16 sample per file, stored
channels-first as `full` [4, D, H, W] with a `unitPar` [4] label) unless --data already
holds one, then, for S = 1 (1x1x1), 2 (2x1x1) and 4 (4x1x1 and 1x2x2), launches itself
on S ranks with `horovodrun` (Gloo, this machine; 4 ranks oversubscribe a 2-core box)
and measures on every rank:

- read throughput: epochs through `distribute_dataset` with no preprocessing (int16
  shards), with the files in the OS page cache ("warm", fastest of --repeats) and after
  evicting them with posix_fadvise(DONTNEED) ("cold", median); the kernel's counters
  (/proc/self/io rchar and read_bytes) show how much of each sample a rank really read
  and how much came from the disk;
- the input wait share of a short training run: a fixed compute step (Conv3D forward +
  kernel gradient + update on the local shard, in a tf.function) fed a cached tensor,
  or fed by the pipeline (float32 cast only, or np.log1p as CosmoFlow).

It prints a Markdown table and writes it to docs/bench_io.md with the command and date.

Usage:
    .venv/bin/python benchmarks/bench_io.py                 # all splits, writes docs/bench_io.md
    .venv/bin/python benchmarks/bench_io.py --data /scratch/bench --samples 32 --out ""
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as common  # noqa: E402  (benchmarks/, this script's folder; sets sys.path)
from recipes import cli  # noqa: E402  (the project's argparse types)

REPO_ROOT = common.REPO_ROOT
# (spatial_shape, ranks): S = 1, 2, 4, depth splits, and (1, 2, 2) for strided reads.
SPLITS = (((1, 1, 1), 1), ((2, 1, 1), 2), ((4, 1, 1), 4), ((1, 2, 2), 4))
CHANNELS = 4


# Data --------------------------------------------------------------------------------
def write_dataset(directory: str, samples: int, size: int) -> list[str]:
    """CosmoFlow-style files `univ_XXXX.h5`; existing files of the right shape are kept."""
    import h5py

    os.makedirs(directory, exist_ok=True)
    paths = dataset_paths(directory, samples)
    rng = np.random.default_rng(0)
    for path in paths:
        if os.path.exists(path):
            with h5py.File(path, "r") as file:
                if file["full"].shape == (CHANNELS, size, size, size):
                    continue
        counts = rng.poisson(3.0, (CHANNELS, size, size, size)).astype(np.int16)
        with h5py.File(path, "w") as file:
            file["full"] = counts
            file["unitPar"] = rng.uniform(-1, 1, 4).astype(np.float32)
    return paths


def dataset_paths(directory: str, samples: int) -> list[str]:
    """The paths `write_dataset` writes, in sample order."""
    return [os.path.join(directory, f"univ_{index:04d}.h5") for index in range(samples)]


def _evict(paths: list[str]) -> None:
    """Drop these files' pages from the OS page cache (only theirs)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # pages still dirty from writing cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _io_counters() -> tuple[int, int]:
    """(rchar, read_bytes) of this process: bytes passed to read calls, bytes from disk."""
    counters = {}
    with open("/proc/self/io") as io_stats:
        for line in io_stats:
            name, value = line.split(":")
            counters[name] = int(value)
    return counters["rchar"], counters["read_bytes"]


# Worker (one rank, under horovodrun) ---------------------------------------------------
def _timed_epoch(ds) -> tuple[float, int, int, int]:
    """(seconds, shard bytes delivered, bytes read, bytes from disk) of one pass."""
    delivered = 0
    rchar, from_disk = _io_counters()
    start = time.perf_counter()
    for x, _ in ds:
        delivered += x.numpy().nbytes
    seconds = time.perf_counter() - start
    rchar_after, from_disk_after = _io_counters()
    return seconds, delivered, rchar_after - rchar, from_disk_after - from_disk


def _train_phase(strategy, paths: list[str], steps: int) -> dict[str, float]:
    """Step times with input from a cached tensor, and from the pipeline with and
    without np.log1p preprocessing."""
    import tensorflow as tf

    from keras_spatial import data as ks_data

    kernel = tf.Variable(tf.random.normal((3, 3, 3, CHANNELS, 8), stddev=0.05, seed=0))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            y = tf.nn.conv3d(x, kernel, strides=(1, 1, 1, 1, 1), padding="SAME")
            loss = tf.reduce_mean(tf.square(y))
        kernel.assign_sub(1e-3 * tape.gradient(loss, kernel))
        return loss

    def run(ds) -> tuple[float, float]:
        """(seconds per step, share of time blocked in next()) over `steps` steps."""
        iterator = iter(ds)
        step(next(iterator)[0]).numpy()  # first batch: pipeline start-up, tracing
        _barrier("train")
        waited, start = 0.0, time.perf_counter()
        for _ in range(steps):
            before = time.perf_counter()
            try:
                x, _ = next(iterator)
            except StopIteration:
                iterator = iter(ds)
                x, _ = next(iterator)
            waited += time.perf_counter() - before
            step(x).numpy()
        seconds = time.perf_counter() - start
        return seconds / steps, waited / seconds

    result = {}
    for name, preprocess in (("log1p", np.log1p), ("raw", None)):
        dataset = ks_data.HDF5Dataset(paths, x="full", y="unitPar", channels_first=True,
                                      preprocess=preprocess)
        ds = strategy.distribute_dataset(dataset, strategy.data_size, seed=1)
        if name == "log1p":
            cached = tf.constant(next(iter(ds))[0])
            result["cached_step_ms"] = 1e3 * run(
                tf.data.Dataset.from_tensors((cached, 0)).repeat())[0]
        seconds, wait = run(ds)
        result[f"{name}_step_ms"] = 1e3 * seconds
        result[f"{name}_wait_share"] = wait
    return result


def _barrier(name: str) -> None:
    from keras_spatial import comm

    if int(os.environ.get("HOROVOD_SIZE", "1")) > 1:
        comm.allgather_object(None, name=f"bench_io.{name}")


def worker(args: argparse.Namespace) -> None:
    """Measure on this rank; rank 0 writes every rank's results to `args.result`."""
    import tensorflow as tf

    ranks = int(os.environ.get("HOROVOD_SIZE", "1"))
    tf.config.threading.set_intra_op_parallelism_threads(max(1, os.cpu_count() // ranks))
    tf.config.threading.set_inter_op_parallelism_threads(2)
    import keras_spatial as ks
    from keras_spatial import comm
    from keras_spatial import data as ks_data

    strategy = ks.SpatialStrategy(tuple(args.spatial_shape))
    paths = dataset_paths(args.data, args.samples)  # written by the driver
    raw = ks_data.HDF5Dataset(paths, x="full", y="unitPar", channels_first=True,
                              dtype="int16")
    ds = strategy.distribute_dataset(raw, strategy.data_size, seed=0)
    sample_bytes = int(np.prod(raw.sample_shape)) * raw.file_dtype.itemsize

    _timed_epoch(ds)  # warm-up pass: page cache, tf.data threads
    warm, cold = [], []
    for repeat in range(args.repeats):
        _barrier(f"warm{repeat}")
        warm.append(_timed_epoch(ds))
    for repeat in range(args.repeats):
        _barrier(f"evict{repeat}")
        _evict(paths)
        _barrier(f"cold{repeat}")
        cold.append(_timed_epoch(ds))
    # Warm: the fastest pass, least disturbed by other jobs. Cold: the median pass (the
    # fastest could be one where eviction missed pages).
    warm, cold = min(warm), sorted(cold)[len(cold) // 2]
    result: dict[str, Any] = {
        "rank": strategy.rank,
        "samples": len(raw),
        "sample_bytes": sample_bytes,
        "warm_seconds": warm[0],
        "cold_seconds": cold[0],
        "delivered_bytes": warm[1],
        "rchar_bytes": warm[2],
        "cold_disk_bytes": cold[3],
    }
    result.update(_train_phase(strategy, paths, args.train_steps))
    results = comm.allgather_object(result, name="bench_io.results") if ranks > 1 else [result]
    if strategy.rank == 0:
        with open(args.result, "w") as out:
            json.dump(results, out)


# Driver --------------------------------------------------------------------------------
def launch(spatial_shape: tuple, ranks: int, args: argparse.Namespace) -> list[dict]:
    """Run `worker` on `ranks` local Gloo ranks with horovodrun; every rank's results."""
    horovodrun = shutil.which("horovodrun") or os.path.join(
        os.path.dirname(sys.executable), "horovodrun")
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        result_path = handle.name
    command = [
        horovodrun, "--gloo", "-np", str(ranks), "-H", f"localhost:{ranks}",
        sys.executable, os.path.abspath(__file__), "--worker",
        "--spatial-shape", *map(str, spatial_shape), "--data", args.data,
        "--samples", str(args.samples), "--size", str(args.size),
        "--train-steps", str(args.train_steps), "--repeats", str(args.repeats),
        "--result", result_path,
    ]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])))
    load = os.getloadavg()[0]
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    with open(result_path) as handle:
        results = json.load(handle)
    os.remove(result_path)
    for result in results:
        result["load_before"] = load
    return results


def table_row(spatial_shape: tuple, ranks: int, results: list[dict]) -> list[str]:
    mb = 1e6
    spatial = int(np.prod(spatial_shape))
    sample_bytes = results[0]["sample_bytes"]
    samples = results[0]["samples"]
    per_rank_warm = [r["delivered_bytes"] / r["warm_seconds"] / mb for r in results]
    warm_aggregate = sum(r["delivered_bytes"] for r in results) / max(
        r["warm_seconds"] for r in results) / mb
    cold_aggregate = sum(r["delivered_bytes"] for r in results) / max(
        r["cold_seconds"] for r in results) / mb
    read_share = np.mean([r["rchar_bytes"] / (samples * sample_bytes) for r in results])
    disk_share = sum(r["cold_disk_bytes"] for r in results) / (samples * sample_bytes)
    oversubscribed = " (oversubscribed)" if ranks > (os.cpu_count() or 1) else ""
    return [
        f"{spatial}", "×".join(map(str, spatial_shape)), f"{ranks}{oversubscribed}",
        f"{sample_bytes / spatial / mb:.1f}",
        f"{read_share:.3f} (1/S = {1 / spatial:.3f})", f"{disk_share:.2f}",
        f"{np.mean(per_rank_warm):.0f}", f"{warm_aggregate:.0f}", f"{cold_aggregate:.0f}",
        f"{np.mean([r['cached_step_ms'] for r in results]):.0f}",
        f"{np.mean([r['raw_step_ms'] for r in results]):.0f}",
        f"{np.mean([r['log1p_step_ms'] for r in results]):.0f}",
        f"{100 * max(r['raw_wait_share'] for r in results):.1f}",
        f"{100 * max(r['log1p_wait_share'] for r in results):.1f}",
        f"{results[0]['load_before']:.1f}",
    ]


HEADER = [
    "S", "split", "ranks", "shard MB/sample", "bytes read per rank / sample bytes",
    "disk bytes, all ranks / sample bytes (cold)",
    "per-rank MB/s (warm)", "aggregate MB/s (warm)", "aggregate MB/s (cold)",
    "step ms: cached input", "step ms: pipeline, cast only", "step ms: pipeline, log1p",
    "input wait %: cast only", "input wait %: log1p", "load before",
]


def render(rows: list[list[str]], args: argparse.Namespace, command: str) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    import h5py
    import tensorflow as tf

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(l.split(":", 1)[1].strip() for l in info if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return "\n".join([
        "# Input pipeline benchmark (`benchmarks/bench_io.py`)",
        "",
        f"Command: `{command}`  ",
        f"Date: {datetime.date.today().isoformat()}  ",
        f"Machine: {os.cpu_count()} cores ({cpu}), TensorFlow {tf.__version__}, "
        f"h5py {h5py.__version__} (HDF5 {h5py.version.hdf5_version}), Horovod Gloo.",
        "",
        f"Data: {args.samples} CosmoFlow-style files, one {args.size}³×{CHANNELS} int16 "
        "sample each (`full` stored channels-first, contiguous, uncompressed, "
        f"{args.size ** 3 * CHANNELS * 2 / 1e6:.1f} MB), global batch = one sample per "
        f"data group. Read rates: warm, the fastest of {args.repeats} epochs; cold, the "
        "median of as many.",
        "",
        *lines,
        "",
        "- *bytes read per rank*: bytes the kernel counted for the rank's read calls "
        "(/proc/self/io `rchar`) during a warm epoch, divided by samples x sample bytes: "
        "each rank reads its hyperslab only (plus a few KB of HDF5 metadata per file). "
        "*disk bytes*: bytes fetched from the disk (/proc/self/io `read_bytes`) by all "
        "ranks during the cold epoch, over samples x sample bytes. The disk works in "
        "pages (4 KiB) with readahead, so a width split of this contiguous "
        "channels-first layout (pieces of 128 bytes) pages in whole files even though "
        "each rank reads 1/S of the bytes (ranks on one machine share the page cache). "
        "Eviction is best effort: values below 1 mean pages stayed cached, values above "
        "1 come from readahead past a shard's end; treat this column as rough.",
        "- *per-rank / aggregate MB/s*: shard bytes delivered by `distribute_dataset` "
        "(int16, no preprocessing) per second; aggregate = all ranks' bytes / slowest "
        "rank's time. *warm*: files in the OS page cache (so this measures h5py, "
        "tf.data and memory copies, not the disk); *cold*: after evicting the files with "
        "posix_fadvise(DONTNEED), read from the virtual disk.",
        f"- *step ms*: mean of {args.train_steps} steps of a fixed compute step (Conv3D "
        "3³, 4→8 filters, forward + kernel gradient + update on the local shard, in a "
        "tf.function) fed a cached tensor, or fed by `distribute_dataset` with a float32 "
        "cast only, or with `preprocess=np.log1p` (as CosmoFlow). *input wait %*: time "
        "blocked in `next()` / total time of the run, worst rank. A step slower than "
        "with cached input while the wait is small means the reading threads compete "
        "with the compute for the cores (reading, transposing and log1p take CPU).",
        f"- The machine has {os.cpu_count()} cores: runs with more ranks than cores are "
        "oversubscribed (each rank 1 TensorFlow thread), so their per-rank rates and step "
        "times show sharing of the cores, not scaling. *load before*: the machine's "
        "1-minute load average when the run started; other jobs shared the machine "
        "when it is well above 0, and the numbers are then indicative only.",
        "",
    ])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default=None,
                        help="directory of the data set (written if missing); "
                             "default: a temporary directory, removed afterwards")
    parser.add_argument("--samples", type=cli.positive_int("--samples"), default=None, help="samples (default 16; 4 with --quick)")
    parser.add_argument("--size", type=cli.positive_int("--size"), default=None, help="D = H = W of a sample (default 128; 16 with --quick)")
    parser.add_argument("--train-steps", type=cli.positive_int("--train-steps"), default=None, help="(default 8; 2 with --quick)")
    parser.add_argument("--repeats", type=cli.positive_int("--repeats"), default=None,
                        help="timed read epochs, warm and cold (fastest warm and median "
                             "cold count; default 5, 1 with --quick)")
    parser.add_argument("--out", default=None,
                        help="Markdown file to write ('' to only print; default docs/bench_io.md, "
                             "nothing with --quick)")
    parser.add_argument("--quick", action="store_true", help="smoke test: 4 samples of 16^3, one read epoch, S = 1 and 2 only, prints only")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--spatial-shape", type=int, nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = args.quick
    args.samples = args.samples or (4 if quick else 16)
    args.size = args.size or (16 if quick else 128)
    args.train_steps = args.train_steps or (2 if quick else 8)
    args.repeats = args.repeats or (1 if quick else 5)
    if args.out is None:
        args.out = "" if quick else os.path.join(REPO_ROOT, "docs", "bench_io.md")
    if args.worker:
        worker(args)
        return
    python = os.path.relpath(sys.executable, REPO_ROOT)
    python = "python" if python.startswith("..") else python
    arguments = [shlex.quote(a) for a in (argv or sys.argv[1:])]
    command = " ".join([python, "benchmarks/bench_io.py", *arguments])
    temporary = args.data is None
    args.data = args.data or tempfile.mkdtemp(prefix="bench_io_")
    try:
        write_dataset(args.data, args.samples, args.size)
        rows = []
        for spatial_shape, ranks in (SPLITS[:2] if args.quick else SPLITS):
            print(f"S={int(np.prod(spatial_shape))} {spatial_shape} on {ranks} ranks ...",
                  flush=True)
            rows.append(table_row(spatial_shape, ranks, launch(spatial_shape, ranks, args)))
    finally:
        if temporary:
            shutil.rmtree(args.data, ignore_errors=True)
    report = render(rows, args, command)
    print(report)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as out:
            out.write(report)
        print(f"Wrote {args.out}")


if __name__ == "__main__":
    main()
