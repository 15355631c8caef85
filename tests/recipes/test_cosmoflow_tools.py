"""The CosmoFlow tools behind `make demo` and `make claim` run end to end on a tiny data
set and write what they promise (the full runs are `make demo` and `make claim`)."""

import json
import os
import subprocess
import sys

import pytest

from tests.distributed.launcher import REPO_ROOT, horovod_or_skip, subprocess_env

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

PARAMETERS = ("omega_m", "sigma_8", "n_s", "h")


def run_tool(*arguments):
    horovod_or_skip()
    result = subprocess.run([sys.executable, *arguments], cwd=REPO_ROOT, env=subprocess_env(),
                            capture_output=True, text=True, timeout=840)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def test_demo_trains_on_two_ranks_and_prints_the_per_parameter_table(tmp_path):
    out = run_tool("tools/demo_cosmoflow.py", "--dir", str(tmp_path), "--count", "12",
                   "--size", "32", "--epochs", "1")
    assert "power-spectrum fit" in out and "summary-stats fit" in out, out[-3000:]
    assert os.path.exists(tmp_path / "run" / "model.keras")


def test_claim_writes_its_report_and_json(tmp_path):
    doc, record = tmp_path / "claim.md", tmp_path / "claim.json"
    out = run_tool("tools/cosmoflow_volume_claim.py", "--dir", str(tmp_path), "--count", "8",
                   "--crops", "32", "--epochs", "1", "--doc", str(doc), "--json", str(record))
    # 6 training universes: one batch of 4 for the recomputed batch-norm statistics.
    assert "32^3: batch-norm statistics recomputed from 1 batches of 4" in out, out[-3000:]
    sizes = json.loads(record.read_text())["sizes"]
    assert list(sizes) == ["32"]
    for estimator in ("cnn", "cnn_moving_statistics", "cnn_readout", "summary_fit", "power_spectrum_fit"):
        assert sorted(sizes["32"][estimator]) == sorted(PARAMETERS)
    assert sizes["32"]["cnn"] != sizes["32"]["cnn_moving_statistics"]
    text = doc.read_text()
    assert "| 32^3 | **CNN, recomputed BN statistics** |" in text
    assert "| 32^3 | CNN, moving BN statistics |" in text
    assert "| 32^3 | CNN trunk + ridge readout |" in text
    assert (tmp_path / "claim.png").exists()


def test_claim_refuses_recomputing_statistics_without_batch_norm(tmp_path):
    result = subprocess.run(
        [sys.executable, "tools/cosmoflow_volume_claim.py", "--dir", str(tmp_path),
         "--no-batch-norm", "--recompute-bn-statistics"],
        cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--recompute-bn-statistics needs --batch-norm" in result.stderr, result.stderr
