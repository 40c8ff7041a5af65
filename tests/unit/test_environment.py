"""The environment every process gets: quiet, offline, and the same CPU kernels everywhere."""

import os
import platform
import subprocess
import sys

from grpo.launch.environment import REPRODUCIBLE_CPU, quiet_environment


def test_the_cpu_kernels_are_pinned_unless_the_user_chose():
    env: dict[str, str] = {"MKL_CBWR": "AUTO"}
    quiet_environment(env)
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert env["MKL_CBWR"] == "AUTO"  # the user's choice wins
    # DeepSpeed's ops are built into and loaded from this environment's own folder
    assert env["TORCH_EXTENSIONS_DIR"] == os.path.join(sys.prefix, "torch_extensions")
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert env["ATEN_CPU_CAPABILITY"] == REPRODUCIBLE_CPU["ATEN_CPU_CAPABILITY"] == "avx2"


def test_a_cli_process_runs_torch_on_the_pinned_kernels():
    """What `grpo` does before importing torch reaches torch's kernel choice (and the tests
    run under the same pin: conftest)."""
    code = ("from grpo.launch.environment import quiet_environment; quiet_environment(); "
            "import torch; print(torch.backends.cpu.get_cpu_capability())")  # fmt: skip
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert out.stdout.strip() == "AVX2", out.stderr[-1000:]
