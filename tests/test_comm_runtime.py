"""keras_spatial.comm.runtime in one process: the policy for Horovod's threads."""

import os
import threading

import pytest

from keras_spatial.comm import runtime

linux_only = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")


@pytest.mark.parametrize("value,policy", [(None, "idle"), ("", "idle"), ("idle", "idle"),
                                          ("Normal", "normal"), (" normal ", "normal")])
def test_comm_thread_policy_reads_the_environment(monkeypatch, value, policy):
    if value is None:
        monkeypatch.delenv(runtime.COMM_THREADS_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(runtime.COMM_THREADS_VARIABLE, value)
    assert runtime.comm_thread_policy() == policy


def test_comm_thread_policy_rejects_unknown_values(monkeypatch):
    monkeypatch.setenv(runtime.COMM_THREADS_VARIABLE, "low")
    with pytest.raises(ValueError, match=r"KERAS_SPATIAL_COMM_THREADS must be one of idle, normal\. Received: 'low'"):
        runtime.comm_thread_policy()


@linux_only
def test_schedule_when_idle_moves_only_the_given_threads():
    started, release = threading.Event(), threading.Event()

    def wait():
        started.set()
        release.wait()

    thread = threading.Thread(target=wait)
    thread.start()
    try:
        started.wait()
        assert thread.native_id in runtime._thread_ids()
        runtime._schedule_when_idle({thread.native_id})
        assert os.sched_getscheduler(thread.native_id) == os.SCHED_IDLE
        assert os.sched_getscheduler(threading.get_native_id()) != os.SCHED_IDLE
    finally:
        release.set()
        thread.join()
    runtime._schedule_when_idle({thread.native_id})  # ended meanwhile: skipped, no error


@pytest.mark.parametrize("value,policy", [(None, "auto"), ("", "auto"), ("AUTO", "auto"), (" none ", "none")])
def test_bind_policy_reads_the_environment(monkeypatch, value, policy):
    if value is None:
        monkeypatch.delenv(runtime.BIND_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(runtime.BIND_VARIABLE, value)
    assert runtime.bind_policy() == policy


def test_bind_policy_rejects_unknown_values(monkeypatch):
    monkeypatch.setenv(runtime.BIND_VARIABLE, "cores")
    with pytest.raises(ValueError, match=r"KERAS_SPATIAL_BIND must be one of auto, none\. Received: 'cores'"):
        runtime.bind_policy()


@pytest.mark.parametrize("cpus,size,shares", [
    ([0, 1], 2, [{0}, {1}]),
    ([0, 1], 4, [{0}, {1}, {0}, {1}]),
    (range(8), 2, [{0, 1, 2, 3}, {4, 5, 6, 7}]),
    ([7, 2, 5, 3, 4], 2, [{2, 3}, {4, 5, 7}]),
    ([3], 3, [{3}, {3}, {3}]),
])
def test_local_cpu_share_gives_contiguous_blocks(cpus, size, shares):
    assert [runtime.local_cpu_share(cpus, rank, size) for rank in range(size)] == shares


@pytest.mark.parametrize("cpus,rank,size", [([], 0, 1), ([0, 1], 2, 2), ([0, 1], -1, 2)])
def test_local_cpu_share_rejects_bad_arguments(cpus, rank, size):
    with pytest.raises(ValueError, match="local_cpu_share needs some CPUs"):
        runtime.local_cpu_share(cpus, rank, size)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="thread binding is Linux's")
def test_bind_to_local_share_binds_every_thread_only_when_the_launcher_did_not():
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("needs 2 CPUs")
    started, release = threading.Event(), threading.Event()

    def wait():
        started.set()
        release.wait()

    thread = threading.Thread(target=wait)
    thread.start()
    try:
        started.wait()
        # Ranks with different CPU sets were bound by their launcher: kept as they are.
        assert runtime.bind_to_local_share(0, 2, [sorted(allowed), [min(allowed)]]) is None
        assert os.sched_getaffinity(0) == allowed
        assert runtime.bind_to_local_share(0, 1, [sorted(allowed)]) is None
        share = runtime.bind_to_local_share(1, 2, [sorted(allowed), sorted(allowed)])
        assert share == runtime.local_cpu_share(allowed, 1, 2) and share < allowed
        assert os.sched_getaffinity(0) == share
        assert os.sched_getaffinity(thread.native_id) == share
    finally:
        for thread_id in runtime._thread_ids():
            try:
                os.sched_setaffinity(thread_id, allowed)
            except ProcessLookupError:
                pass
        release.set()
        thread.join()
