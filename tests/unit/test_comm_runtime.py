"""keras_spatial.comm.runtime in one process: the policy for Horovod's threads."""

import contextlib
import os
import threading
import time

import pytest

from keras_spatial.comm import runtime

linux_only = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")


POLICIES = [
    (runtime.comm_thread_policy, runtime.COMM_THREADS_VARIABLE, None, "idle"),
    (runtime.comm_thread_policy, runtime.COMM_THREADS_VARIABLE, "", "idle"),
    (runtime.comm_thread_policy, runtime.COMM_THREADS_VARIABLE, "idle", "idle"),
    (runtime.comm_thread_policy, runtime.COMM_THREADS_VARIABLE, "Normal", "normal"),
    (runtime.comm_thread_policy, runtime.COMM_THREADS_VARIABLE, " normal ", "normal"),
    (runtime.bind_policy, runtime.BIND_VARIABLE, None, "auto"),
    (runtime.bind_policy, runtime.BIND_VARIABLE, "", "auto"),
    (runtime.bind_policy, runtime.BIND_VARIABLE, "AUTO", "auto"),
    (runtime.bind_policy, runtime.BIND_VARIABLE, " none ", "none"),
]


@pytest.mark.parametrize("read,variable,value,policy", POLICIES)
def test_policies_read_the_environment(monkeypatch, read, variable, value, policy):
    if value is None:
        monkeypatch.delenv(variable, raising=False)
    else:
        monkeypatch.setenv(variable, value)
    assert read() == policy


@pytest.mark.parametrize("read,variable,value,message", [
    (runtime.comm_thread_policy, runtime.COMM_THREADS_VARIABLE, "low",
     r"KERAS_SPATIAL_COMM_THREADS must be one of idle, normal\. Received: 'low'"),
    (runtime.bind_policy, runtime.BIND_VARIABLE, "cores",
     r"KERAS_SPATIAL_BIND must be one of auto, none\. Received: 'cores'"),
])
def test_policies_reject_unknown_values(monkeypatch, read, variable, value, message):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=message):
        read()


@contextlib.contextmanager
def waiting_thread():
    """A started thread that waits until the block ends (then joined, and gone from the
    kernel's task list: `join` returns when Python is done with the thread, which can be
    a moment before the kernel has removed it, most of all on a loaded machine)."""
    started, release = threading.Event(), threading.Event()

    def wait():
        started.set()
        release.wait()

    thread = threading.Thread(target=wait)
    thread.start()
    try:
        started.wait()
        yield thread
    finally:
        release.set()
        thread.join()
        task = f"/proc/self/task/{thread.native_id}"
        deadline = time.monotonic() + 30.0
        while os.path.exists(task) and time.monotonic() < deadline:
            time.sleep(0.001)


@linux_only
def test_schedule_when_idle_moves_only_the_given_threads():
    with waiting_thread() as thread:
        assert thread.native_id in runtime._thread_ids()
        runtime._schedule_when_idle({thread.native_id})
        assert os.sched_getscheduler(thread.native_id) == os.SCHED_IDLE
        assert os.sched_getscheduler(threading.get_native_id()) != os.SCHED_IDLE
    runtime._schedule_when_idle({thread.native_id})  # ended meanwhile: skipped, no error


@linux_only
def test_for_each_thread_skips_threads_that_have_ended_and_nothing_else():
    main = threading.get_native_id()
    assert main in runtime._for_each_thread(lambda thread_id: thread_id)
    with waiting_thread() as thread:
        ended = thread.native_id
        assert runtime._for_each_thread(lambda thread_id: thread_id, {main, ended}) in ([main, ended], [ended, main])

    def ended_or_fail(thread_id):
        if thread_id == ended:
            raise ProcessLookupError(thread_id)
        raise PermissionError(thread_id)

    assert runtime._for_each_thread(lambda thread_id: os.sched_getaffinity(thread_id), {ended}) == []
    assert runtime._for_each_thread(ended_or_fail, {ended}) == []
    with pytest.raises(PermissionError):
        runtime._for_each_thread(ended_or_fail, {main})


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
    with waiting_thread() as thread:
        try:
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
