"""Synthetic universes written by the CLI train a spatial model through distribute_dataset."""

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.distributed.end_to_end_workers import fit_from_files
from tests.distributed.launcher import REPO_ROOT, run_on_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


def test_universes_to_model_fit_on_two_ranks(tmp_path):
    out = tmp_path / "universes"
    subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "tools", "write_universes.py"), "--out", str(out),
         "--count", "8", "--size", "16", "--seed", "1", "--workers", "1", "--quiet"],
        check=True,
    )
    results = run_on_ranks(fit_from_files, 2, str(out / "univ_*.h5"), (2, 1, 1))
    for r in results:
        assert r["spread"] == 0.0, "weights differ between ranks"
        assert r["history"] == results[0]["history"], "ranks report different (non-global) logs"
    losses = results[0]["history"]["loss"]
    assert len(losses) == 2 and all(np.isfinite(losses))
