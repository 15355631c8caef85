"""Benchmark: how much an idle Horovod job slows training threads on the same cores.

    .venv/bin/python benchmarks/bench_comm_interference.py

Horovod's background thread wakes every cycle to coordinate with the other ranks, even
when nothing is queued. This tool measures what those wake-ups cost a computation that
has every core to itself, which is what `KERAS_SPATIAL_COMM_THREADS` is about (see the
README). It runs `--processes` independent single-thread plain-Keras processes, each
timing the training step of the paper's CosmoFlow on a W/2 x W x W volume (the shard
of a 2x1x1 split, no communication), in three situations:

1. alone;
2. next to an idle 2-rank Horovod job started through `keras_spatial` with
   `KERAS_SPATIAL_COMM_THREADS=normal` (Horovod's threads as it starts them, 1 ms cycle);
3. the same with `KERAS_SPATIAL_COMM_THREADS=idle` (the default: SCHED_IDLE, 0.2 ms cycle).

It prints a Markdown table: each process's median step time and the slowest one, and
the CPU time the idle Horovod job used meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_common as common  # noqa: E402  (benchmarks/, this script's folder)
from recipes import cli  # noqa: E402  (the project's argparse types)


def step_worker(size: int, steps: int, start_at: float) -> None:
    """One plain-Keras process: time `steps` training steps once the clock reaches
    `start_at` (so that concurrent processes measure together); print JSON."""
    common.configure_threads(1)
    import keras
    import tensorflow as tf

    import keras_spatial as ks
    from recipes.cosmoflow.model import _paper

    inputs = ks.Input((size // 2, size, size, 4))
    model = keras.Model(inputs, _paper(inputs, False, 0.2, 4, size, None))
    optimizer = keras.optimizers.Adam(1e-3)
    optimizer.build(model.trainable_variables)
    x = tf.random.stateless_normal((1,) + tuple(model.input_shape[1:]), seed=[1, 0])
    y = tf.random.stateless_uniform((1, 4), seed=[1, 1])
    variables = model.trainable_variables

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        optimizer.apply(tape.gradient(loss, variables), variables)
        return loss

    for _ in range(3):
        step().numpy()
    while time.time() < start_at:
        time.sleep(0.01)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step().numpy()
        times.append(time.perf_counter() - start)
    print(json.dumps({"median": common.median(times)}), flush=True)


def idle_horovod_worker(seconds: float) -> None:
    """One rank of an idle Horovod job: start Horovod through keras_spatial, then wait."""
    import keras_spatial as ks

    strategy = ks.SpatialStrategy((2, 1, 1))
    cpu_start = time.process_time()
    time.sleep(seconds)
    print(json.dumps({"rank": strategy.rank, "cpu": time.process_time() - cpu_start}), flush=True)


def run_steps(args, env: dict) -> list[float]:
    """Median step time of each of `args.processes` concurrent step workers."""
    start_at = time.time() + args.settle
    command = [sys.executable, os.path.abspath(__file__), "--step-worker", str(start_at),
               "--size", str(args.size), "--steps", str(args.steps)]
    workers = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
               for _ in range(args.processes)]
    medians = []
    try:
        for worker in workers:
            out, _ = worker.communicate(timeout=args.timeout)
            if worker.returncode != 0:
                raise RuntimeError(f"a step worker failed (exit {worker.returncode})")
            medians.append(json.loads(out.strip().splitlines()[-1])["median"])
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    return medians


def run_with_idle_job(args, env: dict, policy: str) -> tuple[list[float], float]:
    """Step medians measured next to an idle 2-rank Horovod job of `policy`, and the CPU
    seconds the job's ranks used per second of its idle wait (summed over its ranks)."""
    job_env = dict(env, KERAS_SPATIAL_COMM_THREADS=policy)
    job_env.pop("HOROVOD_CYCLE_TIME", None)
    # Long enough to cover the step workers' start-up, warm-up and timed steps.
    idle_seconds = args.settle + args.steps * 3.0 + 30.0
    job = subprocess.Popen(
        [common.horovodrun_path(), "--gloo", "-np", "2", "-H", "localhost:2", sys.executable,
         os.path.abspath(__file__), "--idle-worker", str(idle_seconds)],
        env=job_env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        start_new_session=True,
    )
    try:
        time.sleep(10.0)  # Horovod started
        medians = run_steps(args, env)
        out, _ = job.communicate(timeout=idle_seconds + args.timeout)
    finally:
        if job.poll() is None:
            common._terminate_group(job)  # horovodrun and its ranks
    if job.returncode != 0:
        raise RuntimeError(f"the idle Horovod job failed (exit {job.returncode})")
    cpu = sum(json.loads(line.split(">:", 1)[-1])["cpu"] for line in out.splitlines() if '"cpu"' in line)
    return medians, cpu / idle_seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=cli.positive_int("--size"), default=None, help="W (default 128; 32 with --quick)")
    parser.add_argument("--processes", type=cli.positive_int("--processes"), default=2,
                        help="concurrent step processes (default 2, one per core here)")
    parser.add_argument("--steps", type=cli.positive_int("--steps"), default=None, help="timed steps (default 10; 2 with --quick)")
    parser.add_argument("--settle", type=cli.positive_float("--settle"), default=None,
                        help="seconds given to the step workers to start and warm up (default 40; 5 with --quick)")
    parser.add_argument("--quick", action="store_true", help="smoke test: W=32, 2 timed steps, 5 s to settle, the idle policy only")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run (default 600)")
    parser.add_argument("--step-worker", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--idle-worker", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.size = args.size or (32 if args.quick else 128)
    args.steps = args.steps or (2 if args.quick else 10)
    args.settle = args.settle or (5.0 if args.quick else 40.0)
    if args.step_worker is not None:
        step_worker(args.size, args.steps, args.step_worker)
        return 0
    if args.idle_worker is not None:
        idle_horovod_worker(args.idle_worker)
        return 0

    env = dict(os.environ, PYTHONPATH=common.REPO_ROOT, TF_CPP_MIN_LOG_LEVEL="3", OMP_NUM_THREADS="1")
    rows = []
    print(f"{args.processes} processes, CosmoFlow step on {args.size // 2}x{args.size}x{args.size}; "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    print("alone ...", flush=True)
    alone = run_steps(args, env)
    rows.append(["alone", alone, None])
    for policy in ("idle",) if args.quick else ("normal", "idle"):
        print(f"next to an idle Horovod job, KERAS_SPATIAL_COMM_THREADS={policy} ...", flush=True)
        medians, cpu = run_with_idle_job(args, env, policy)
        rows.append([f"next to an idle 2-rank Horovod job, KERAS_SPATIAL_COMM_THREADS={policy}", medians, cpu])
    reference = max(alone)
    table = common.markdown_table(
        ["situation", "median step per process (s)", "slowest (s)", "slowest vs alone",
         "CPU the idle job used (cores)"],
        [[label, ", ".join(f"{m:.3f}" for m in medians), f"{max(medians):.3f}",
          f"{max(medians) / reference:.2f}", "—" if cpu is None else f"{cpu:.2f}"]
         for label, medians, cpu in rows],
    )
    print("\n".join([common.command_line("benchmarks/bench_comm_interference.py", sys.argv[1:] if argv is None else argv),
                     common.machine_line(), ""] + table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
