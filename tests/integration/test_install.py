"""A plain (non-editable) install runs the pipeline from another directory."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, SMALL

pytestmark = pytest.mark.slow


def test_a_wheel_install_runs_the_pipeline_elsewhere(tmp_path):
    wheels, site, work = tmp_path / "wheels", tmp_path / "site", tmp_path / "work"
    work.mkdir()
    # build from a copy: setuptools writes build/ next to the sources
    src = tmp_path / "src"
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(
            ".venv", ".git", "runs", "mlruns", "build", "*.egg-info", "mlflow.db*", "__pycache__"
        ),
    )
    pip = [sys.executable, "-m", "pip", "-q"]
    build = subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = wheels.glob("grpo_pipeline-*.whl")
    inst = subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert inst.returncode == 0, inst.stderr[-2000:]
    assert (site / "grpo" / "engine" / "deepspeed.json").is_file()  # package data shipped
    # the copy in site/ must be the one that runs, not the source tree
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env.update(PYTHONPATH=str(site), HF_HUB_OFFLINE="1")
    where = subprocess.run([sys.executable, "-c", "import grpo, flows; print(grpo.__file__)"],
                           cwd=work, env=env, capture_output=True, text=True)  # fmt: skip
    assert Path(where.stdout.strip()).is_relative_to(site), where.stdout + where.stderr
    sets = [a for s in [*SMALL, "grpo.eval_every=0"] for a in ("--set", s)]
    run = subprocess.run(
        [sys.executable, "-m", "flows.cli", "pipeline", "--no-control", *sets], cwd=work, env=env,
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    assert (work / "mlflow.db").is_file()  # the default store is in the working directory
    assert list((work / "runs").glob("tiny/*/grpo/policy/model.safetensors"))
