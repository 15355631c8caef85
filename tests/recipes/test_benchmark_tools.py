"""The benchmark scripts of benchmarks/ start and parse their arguments, and every
one's `--quick` smoke run finishes: so that the tools behind docs/benchmarks.md and
docs/performance_model.md cannot rot unnoticed. Timings are not checked (the machines
are shared); the full runs are `make bench`, `make profile` and the others in the
Makefile."""

import glob
import os
import subprocess
import sys

import pytest

from tests.distributed.launcher import REPO_ROOT, horovod_or_skip, subprocess_env

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


# Every benchmark's `--quick` smoke run, narrowed where a tool's quick mode still measures
# several models or layouts (the narrowed runs keep the configuration whose plot once
# failed, spatial1x1x2). `ranks`: run under horovodrun on that many local ranks.
QUICK_RUNS = {
    "bench_scaling.py": (["--models", "cosmoflow:32", "--configs", "serial,spatial2x1x1,spatial1x1x2",
                          "--bucket-bytes", "65536", "--shard-update"], None),
    "bench_memory.py": (["--sizes", "32"], None),
    "profile_step.py": (["--models", "cosmoflow:32", "--configs", "serial,spatial2x1x1"], None),
    "validate_cost_model.py": (["--models", "cosmoflow:32", "--configs", "serial,spatial2x1x1", "--kernel-table"],
                               None),
    "predict_scaling.py": ([], None),
    "bench_io.py": ([], None),
    "bench_comm_interference.py": ([], None),
    "bench_halo.py": ([], 2),
    "bench_collective_latency.py": ([], 2),
}


def test_every_benchmark_has_a_quick_run():
    assert sorted(QUICK_RUNS) == sorted(os.path.basename(p) for p in SCRIPTS)


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(QUICK_RUNS))
def test_quick_run_finishes(name):
    horovod_or_skip()
    arguments, ranks = QUICK_RUNS[name]
    path = os.path.join(REPO_ROOT, "benchmarks", name)
    command = [sys.executable, path, "--quick", *arguments]
    if ranks:
        horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
        command = [horovodrun, "--gloo", "-np", str(ranks), "-H", f"localhost:{ranks}", *command]
    result = subprocess.run(command, cwd=REPO_ROOT, env=subprocess_env(), capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
