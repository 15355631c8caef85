"""A failing or killed rank ends the whole job, non-zero, within 60 s, with its error shown;
a healthy job prints its progress bar on rank 0 only."""

import os
import re
import subprocess
import sys
import time

import pytest

from tests.distributed.launcher import REPO_ROOT, horovod_or_skip

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def _launch(mode):
    horovod_or_skip()
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, TF_CPP_MIN_LOG_LEVEL="3")
    command = [horovodrun, "--gloo", "-np", "2", "-H", "localhost:2", sys.executable,
               os.path.join(REPO_ROOT, "tests", "distributed", "fault_script.py"), "--mode", mode]
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    return completed, time.time()


def _run_job(mode):
    completed, ended = _launch(mode)
    output = completed.stdout + completed.stderr
    fault = re.search(r"FAULT_AT (\d+\.\d+)", output)
    assert fault, f"the fault was never injected:\n{output[-3000:]}"
    return completed.returncode, ended - float(fault.group(1)), output


def test_a_rank_that_raises_ends_the_job_with_its_error():
    code, seconds, output = _run_job("raise")
    assert code != 0
    assert seconds < 60, f"the job took {seconds:.0f} s to end after the failure"
    assert "injected failure on rank 1" in output


def test_a_killed_rank_ends_the_job():
    code, seconds, output = _run_job("kill")
    assert code != 0
    assert seconds < 60, f"the job took {seconds:.0f} s to end after the kill"
    assert re.search(r"Process 1 exit with status code|exited with non-zero", output)


def test_progress_bar_on_rank_zero_only():
    completed, _ = _launch("ok")
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-3000:]
    rank0 = [line for line in output.splitlines() if line.startswith("[0]<stdout>")]
    rank1 = [line for line in output.splitlines() if line.startswith("[1]<stdout>")]
    assert any("Epoch 2/2" in line for line in rank0), output[-3000:]
    assert not any("Epoch" in line or "loss" in line for line in rank1), rank1
