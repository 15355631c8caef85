"""Run a Python function on N Horovod ranks (Gloo, this machine) from inside pytest.

The function must live in an importable module (e.g. `tests.distributed.workers`) so
that workers import it by reference. Each worker returns a small, picklable result;
tests compare results in the pytest process, so an assertion never leaves a rank waiting
in a collective. A rank that raises ends the whole job (Horovod terminates the others),
and the error surfaces here as a RuntimeError.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def subprocess_env() -> dict:
    """The environment for a recipe or tool run as a subprocess of a test: this one, with
    the repository on PYTHONPATH, TensorFlow's logging quiet and one OpenMP thread."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def horovod_or_skip():
    """Import horovod, or skip the calling test where it is not installed."""
    return pytest.importorskip("horovod.tensorflow")


def worker_setup() -> None:
    """Call first inside every worker: quiet logs, one TF thread per rank."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)


def run_on_ranks(fn: Callable, np: int, *args: Any, **kwargs: Any) -> list:
    """`fn(*args, **kwargs)` on `np` local ranks; returns each rank's result, by rank."""
    horovod_or_skip()
    import horovod

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env.setdefault("OMP_NUM_THREADS", "1")
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        return horovod.run(
            fn,
            args=args,
            kwargs=kwargs,
            num_proc=np,
            hosts=f"localhost:{np}",
            use_gloo=True,
            start_timeout=120,
        )
    finally:
        os.environ.clear()
        os.environ.update(saved)
