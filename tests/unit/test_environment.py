"""The environment every process gets: quiet, offline, and the same CPU kernels everywhere."""

import json
import os
import platform
import subprocess
import sys

import pytest

from grpo.launch.environment import REPRODUCIBLE_CPU, quiet_environment

# what a fresh process sees after the steps a `grpo` command and a rank take before their work
FRESH = """
import json, sys
from grpo.launch.environment import quiet_environment
quiet_environment()
import torch
from grpo.launch.environment import import_deepspeed_without_mlflow
import_deepspeed_without_mlflow()
from deepspeed.autotuning import autotuner
seen = {"cpu": torch.backends.cpu.get_cpu_capability(), "mlflow_loaded": "mlflow" in sys.modules,
        "autotuner_mlflow": autotuner.has_mlflow}
import mlflow
seen["mlflow_after"] = mlflow.__name__
print(json.dumps(seen))
"""


@pytest.fixture(scope="module")
def fresh() -> dict:
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", FRESH], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_cpu_kernels_are_pinned_unless_the_user_chose():
    env: dict[str, str] = {"MKL_CBWR": "AUTO"}
    quiet_environment(env)
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert env["MKL_CBWR"] == "AUTO"  # the user's choice wins
    # DeepSpeed's ops are built into and loaded from this environment's own folder
    assert env["TORCH_EXTENSIONS_DIR"] == os.path.join(sys.prefix, "torch_extensions")
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert env["ATEN_CPU_CAPABILITY"] == REPRODUCIBLE_CPU["ATEN_CPU_CAPABILITY"] == "avx2"


def test_a_cli_process_runs_torch_on_the_pinned_kernels(fresh):
    """What `grpo` does before importing torch reaches torch's kernel choice (and the tests
    run under the same pin: conftest)."""
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert fresh["cpu"] == "AVX2"


def test_a_rank_imports_deepspeed_without_mlflow_and_can_still_import_it(fresh):
    """DeepSpeed's autotuner would import mlflow (and pandas, pyarrow, FastAPI) into every
    rank; it is hidden during that import only, so code run later in the rank still has it."""
    assert fresh["mlflow_loaded"] is False and fresh["autotuner_mlflow"] is False
    assert fresh["mlflow_after"] == "mlflow"
