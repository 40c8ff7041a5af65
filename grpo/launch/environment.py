"""The environment every process of the project runs with, set in one place.

Set before torch is imported: OpenMP threads that spin-wait crawl on a shared 2-core machine
(PASSIVE makes idle threads sleep), tokenizers' own threads fight the ranks', and the
libraries' telemetry has no network to reach. On x86-64 the CPU kernels are pinned to AVX2
(REPRODUCIBLE_CPU), so that a seed gives the same numbers on machines of one CPU vendor whatever
their vector width; across vendors (Intel and AMD) MKL's AVX2 path still rounds differently, and
the numbers differ (benchmarks/NUMERICS.md).
Values a user set win.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import MutableMapping

QUIET_ENV = {
    "OMP_WAIT_POLICY": "PASSIVE",
    "TOKENIZERS_PARALLELISM": "false",
    "DO_NOT_TRACK": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "HF_HUB_DISABLE_TELEMETRY": "1",
}

# torch picks its vectorised kernels (softmax, reductions, element-wise ops) by the CPU's
# instruction set, and MKL its matmul code path: AVX-512 and AVX2 machines then round
# differently and the same seed trains other weights (benchmarks/NUMERICS.md). Both pinned to
# AVX2: torch's same kernels on every x86-64 CPU since 2013, at no measured cost on this
# machine. MKL's AVX2 branch is not the same code on Intel and AMD, so the pin does not make
# the two vendors agree.
# ATEN_CPU_CAPABILITY=avx512 and MKL_CBWR=AUTO give the native kernels back.
REPRODUCIBLE_CPU = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2"}


def extensions_dir() -> str:
    """Where DeepSpeed's compiled C++ ops live: inside this Python environment (`make install`
    builds them there), so that two environments on one machine never rebuild each other's
    ops (the default, ~/.cache/torch_extensions, is shared) in the middle of a run."""
    return os.path.join(sys.prefix, "torch_extensions")


def quiet_environment(environ: MutableMapping[str, str] | None = None) -> None:
    """Give `environ` (this process's by default) every QUIET_ENV value it does not set, the
    environment's own extensions directory, and on x86-64 the REPRODUCIBLE_CPU pins."""
    env = os.environ if environ is None else environ
    pins = REPRODUCIBLE_CPU if platform.machine().lower() in ("x86_64", "amd64") else {}
    for k, v in {**QUIET_ENV, "TORCH_EXTENSIONS_DIR": extensions_dir(), **pins}.items():
        env.setdefault(k, v)


def import_deepspeed_without_mlflow() -> None:
    """Import DeepSpeed with mlflow hidden from it, in a process that has not loaded mlflow: a
    rank, or `grpo sft`/`grpo train` building the reference in their own process. None of them
    talks to MLflow (a stage's Prefect task logs what its ranks wrote), but `import deepspeed`
    imports its autotuner, which imports mlflow when it is installed, and pandas, pyarrow and
    FastAPI with it: 1-3 s of CPU in every rank on a 2-core machine (docs/TESTING.md). A None in
    sys.modules makes that import fail (the autotuner, never used here, then runs without
    MLflow); removed after, so a reward function that imports mlflow still gets it."""
    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        return
    sys.modules["mlflow"] = None  # type: ignore[assignment]
    try:
        import deepspeed  # noqa: F401
    finally:
        del sys.modules["mlflow"]
