"""Benchmark: the latency of one small collective, as a training step meets it.

    .venv/bin/horovodrun --gloo -np 2 -H localhost:2 .venv/bin/python benchmarks/bench_collective_latency.py

A spatially split step runs its collectives one after another: each halo exchange and
each synchronized batch-norm statistic waits for the previous layer. So the time a step
spends in them is about (number of collectives) x (latency of one small collective).
This tool measures that latency through `keras_spatial.comm`, in a `tf.function` like a
training step: a chain of `--chain` allreduces of 8 floats (each input depends on the
previous result), and a chain of alltoalls of one 8x8x4 float plane per rank. It
reports the median over `--repeats` calls of the time per collective, next to the
round-trip time of a 32-byte message over loopback TCP between two processes of this
machine (what the network itself costs). Rank 0 prints the table.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_common as common  # noqa: E402  (benchmarks/, this script's folder)
from recipes import cli  # noqa: E402  (the project's argparse types)


def loopback_round_trip_seconds(messages: int = 2000) -> float:
    """Mean round trip of a 32-byte message between two local processes, in seconds."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    child = os.fork()
    if child == 0:
        peer = socket.create_connection(("127.0.0.1", port))
        peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(messages):
            peer.sendall(peer.recv(64))
        os._exit(0)
    connection, _ = server.accept()
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    start = time.perf_counter()
    for _ in range(messages):
        connection.sendall(b"x" * 32)
        connection.recv(64)
    elapsed = time.perf_counter() - start
    os.waitpid(child, 0)
    connection.close()
    server.close()
    return elapsed / messages


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chain", type=cli.positive_int("--chain"), default=None, help="collectives per call (default 50; 5 with --quick)")
    parser.add_argument("--repeats", type=cli.positive_int("--repeats"), default=None, help="timed calls (default 7; 2 with --quick)")
    parser.add_argument("--quick", action="store_true", help="smoke test: chains of 5, 2 timed calls")
    args = parser.parse_args(argv)
    args.chain = args.chain or (5 if args.quick else 50)
    args.repeats = args.repeats or (2 if args.quick else 7)

    import tensorflow as tf

    import keras_spatial as ks
    from keras_spatial import comm

    tf.config.threading.set_intra_op_parallelism_threads(1)
    strategy = ks.SpatialStrategy((1, 1, 1))
    if strategy.size < 2:
        sys.exit("Run with 2 or more ranks, e.g. horovodrun --gloo -np 2 -H localhost:2 ...")
    world = strategy.world_process_set
    size = strategy.size

    @tf.function
    def allreduces(x):
        for index in range(args.chain):
            x = comm.allreduce(x, world, name=f"latency_allreduce{index}", op="average")
        return x

    @tf.function
    def alltoalls(x):
        # Every rank sends one plane to the next rank and receives one from the previous.
        send = [1 if peer == (strategy.rank + 1) % size else 0 for peer in range(size)]
        recv = [1 if peer == (strategy.rank - 1) % size else 0 for peer in range(size)]
        for index in range(args.chain):
            x = comm.alltoall(x, send, recv, world, name=f"latency_alltoall{index}")
        return x

    small = tf.ones([8])
    plane = tf.ones([1, 8, 8, 4])
    rows = [
        ("allreduce, 8 floats", common.median_seconds(lambda: allreduces(small).numpy(), args.repeats) / args.chain),
        ("alltoall, one 8x8x4 plane", common.median_seconds(lambda: alltoalls(plane).numpy(), args.repeats) / args.chain),
    ]
    strategy.barrier()
    if strategy.rank == 0:
        rows.append(("loopback TCP round trip, 32 bytes (2 processes)", loopback_round_trip_seconds()))
        print(f"{size} ranks, chains of {args.chain}, median of {args.repeats} calls; "
              f"HOROVOD_CYCLE_TIME={os.environ.get('HOROVOD_CYCLE_TIME', 'default')}")
        print("\n".join(common.markdown_table(
            ["operation", "time each (ms)"], [[label, f"{seconds * 1e3:.3f}"] for label, seconds in rows])))


if __name__ == "__main__":
    main()
