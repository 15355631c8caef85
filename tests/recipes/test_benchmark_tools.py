"""The benchmark scripts of benchmarks/ start and parse their arguments, and the quick
runs of those that have one finish: so that the tools behind docs/benchmarks.md and
docs/performance_model.md cannot rot unnoticed. Timings are not checked (the machines
are shared); the full runs are `make bench`, `make profile` and the others in the
Makefile."""

import glob
import os
import subprocess
import sys

import pytest

from tests.distributed.launcher import REPO_ROOT, subprocess_env

SCRIPTS = sorted(
    path for path in glob.glob(os.path.join(REPO_ROOT, "benchmarks", "*.py"))
    if os.path.basename(path) != "bench_common.py"
)


def run(path, *args, timeout=300):
    return subprocess.run([sys.executable, path, *args], cwd=REPO_ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=timeout)


def test_the_benchmark_folder_holds_the_tools():
    names = {os.path.basename(p) for p in SCRIPTS}
    assert {"bench_scaling.py", "bench_memory.py", "profile_step.py", "predict_scaling.py"} <= names


@pytest.mark.parametrize("path", SCRIPTS, ids=os.path.basename)
def test_every_benchmark_answers_help(path):
    result = run(path, "--help", timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("usage:"), result.stdout[:500]


def test_every_benchmark_refuses_an_unknown_option():
    for path in SCRIPTS:
        result = run(path, "--no-such-option", timeout=120)
        assert result.returncode == 2 and "unrecognized arguments: --no-such-option" in result.stderr, path
