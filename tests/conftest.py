import os
import shutil
import tempfile
from pathlib import Path

import pytest

from grpo.launch.environment import quiet_environment

# before torch is imported anywhere (grpo.launch.environment says why)
quiet_environment()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "PYTEST_XDIST_WORKER" in os.environ:
    # two test workers share the machine's cores: one thread each (and in the processes they
    # start) instead of every process spinning up one per core
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# the tests' flow runs, servers and profiles never land in the user's own Prefect home
# (~/.prefect): each test process, and every process it starts, gets its own, removed after
USER_PREFECT_HOME = Path(os.environ.get("PREFECT_HOME", "~/.prefect")).expanduser()
TEST_PREFECT_HOME = tempfile.mkdtemp(prefix="grpo-test-prefect-")
os.environ["PREFECT_HOME"] = TEST_PREFECT_HOME
os.environ.pop("PREFECT_API_URL", None)
os.environ.pop("PREFECT_PROFILES_PATH", None)


def _snapshot(home: Path) -> dict[str, int]:
    files = home.rglob("*") if home.is_dir() else []
    return {str(f): f.stat().st_mtime_ns for f in files if f.is_file()}


USER_PREFECT_BEFORE = _snapshot(USER_PREFECT_HOME)
# nor in the project's own MLflow artifacts (./mlruns, where `make run` keeps them)
PROJECT_MLRUNS = Path(__file__).resolve().parents[1] / "mlruns"
PROJECT_MLRUNS_BEFORE = _snapshot(PROJECT_MLRUNS)


def pytest_sessionfinish(session, exitstatus) -> None:  # noqa: ANN001, ARG001
    shutil.rmtree(TEST_PREFECT_HOME, ignore_errors=True)
    if _snapshot(USER_PREFECT_HOME) != USER_PREFECT_BEFORE:
        print(f"\nerror: the tests wrote into the user's Prefect home {USER_PREFECT_HOME}")
        session.exitstatus = 1
    if _snapshot(PROJECT_MLRUNS) != PROJECT_MLRUNS_BEFORE:
        print(f"\nerror: the tests wrote MLflow artifacts into the project's {PROJECT_MLRUNS}")
        session.exitstatus = 1


# the slowest modules first (their tests' --durations summed), so that two workers (-n 2 --dist
# loadfile) do not end with one of them alone on a long module. xdist would otherwise reorder
# modules by their number of tests (most first: the unit tests) and start the serve tests, two
# tests of 90-250 s, last: --no-loadscope-reorder in pyproject.toml keeps this order
SLOW_FIRST = ("test_serve", "test_serve_crash", "test_serve_tls", "test_interrupts", "test_install",
              "test_pipeline", "test_smollm2", "test_nodes", "test_cli_ranks", "test_failures",
              "test_ranks", "test_benchmark_scripts", "test_resume", "test_real_model_path",
              "test_faults")  # fmt: skip


def pytest_collection_modifyitems(session, config, items) -> None:  # noqa: ANN001, ARG001
    def rank(item) -> int:  # noqa: ANN001
        stem = Path(str(item.fspath)).stem
        return SLOW_FIRST.index(stem) if stem in SLOW_FIRST else len(SLOW_FIRST)

    items.sort(key=rank)  # stable: a module's tests stay together and in their order


@pytest.fixture(autouse=True)
def _no_process_group_variables_left() -> object:
    """A trainer built in the test process sets RANK, MASTER_PORT, ... in its environment (as a
    launcher would); removed after each test, or every process a later test starts would join
    a process group on a port that nobody serves any more. (The next in-process trainer sets
    them again.)"""
    yield
    from grpo.launch.runner import DIST_VARS

    for k in DIST_VARS:
        os.environ.pop(k, None)
