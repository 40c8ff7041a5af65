"""The prepared benchmark scripts still run (on the CPU, with tiny shapes)."""

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow


def test_gpu_check_runs_on_the_cpu(tmp_path):
    out = tmp_path / "gpu.md"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout[proc.stdout.index("{") :])
    for engine in ("fast", "hf"):
        e = result["engines"][engine]
        assert e["tokens_per_s"] > 0
        assert e["logp_gap_max"] < 1e-4  # fp32 on the CPU: both engines agree with the forward
    assert result["update"]["grad_norm"] > 0
    assert "| fast |" in out.read_text() and "| hf |" in out.read_text()
