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
