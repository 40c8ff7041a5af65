"""A plain (non-editable) install runs the pipeline from another directory, at the same time as
a pipeline from the source tree, both on a store and a Prefect home that do not exist yet."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, SMALL, by_stage

pytestmark = pytest.mark.slow


def _wheel_site(tmp_path: Path) -> Path:
    """The project built as a wheel and installed (no dependencies) into a directory of its
    own, which PYTHONPATH then puts first."""
    wheels, site = tmp_path / "wheels", tmp_path / "site"
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
    return site


def test_wheel_and_source_pipelines_share_a_fresh_store(tmp_path):
    """Two pipelines started at once in one directory, with no MLflow store, Prefect home or
    SFT cache there yet (both create them): the installed wheel's without the control
    (--no-control), the source tree's with the sequential control."""
    site, work = _wheel_site(tmp_path), tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")  # fresh: both migrate it at once
    wheel_env = {**env, "PYTHONPATH": str(site)}
    # the copy in site/ must be the one that runs, not the source tree
    where = subprocess.run([sys.executable, "-c", "import grpo, flows; print(grpo.__file__)"],
                           cwd=work, env=wheel_env, capture_output=True, text=True)  # fmt: skip
    assert Path(where.stdout.strip()).is_relative_to(site), where.stdout + where.stderr
    sets = ["grpo.eval_every=0", "tracking.registered_model=concurrent"]
    args = [sys.executable, "-m", "cli.main", "pipeline",
            *[a for s in [*SMALL, *sets] for a in ("--set", s)]]  # fmt: skip
    variants = [(["--no-control"], wheel_env), (["--set", "sft.control=sequential"], env)]
    procs = [
        subprocess.Popen(
            args + extra,
            cwd=work,
            env=e,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for extra, e in variants
    ]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    (tmp_path / "outs.txt").write_text("\n=====\n".join(outs))
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    # one progress bar for the validation, ours: none of Great Expectations' per batch
    assert all("validate:" in o for o in outs)
    assert not [o for o in outs if "Calculating Metrics" in o]
    # nor MLflow's schema hints on the logged datasets (five a run, before)
    assert not [o for o in outs if "Inferred schema" in o]
    assert (work / "mlflow.db").is_file()  # the default store is in the working directory
    assert len(list((work / "runs").glob("tiny/*/grpo/policy/model.safetensors"))) == 2
    from mlflow import MlflowClient

    uri = f"sqlite:///{work / 'mlflow.db'}"
    c = MlflowClient(uri, uri)
    versions = c.search_model_versions("name='concurrent'")
    assert sorted(int(v.version) for v in versions) == [1, 2]
    challenger = c.get_model_version_by_alias("concurrent", "challenger")
    assert challenger.version in {v.version for v in versions}
    # one reference for both: how the control runs is not part of its cache key, and the
    # wheel's code is the source tree's
    assert len(list((work / "runs" / "sft").glob("*/model.safetensors"))) == 1
    exp = c.get_experiment_by_name("grpo-tiny")
    runs = c.search_runs([exp.experiment_id])
    parents = {
        r.data.params["sft.control"]: r for r in runs if "mlflow.parentRunId" not in r.data.tags
    }
    kids = {mode: by_stage([r for r in runs
                            if r.data.tags.get("mlflow.parentRunId") == p.info.run_id])
            for mode, p in parents.items()}  # fmt: skip
    assert "sft_continued" not in kids["auto"]  # --no-control
    assert "sft_continued/eval/synthetic/accuracy" not in parents["auto"].data.metrics
    ctl = kids["sequential"]["sft_continued"]
    assert ctl.data.tags["control_mode"] == "sequential"
    # after GRPO, for GRPO's training seconds (its summary's), not cut short, and stopping at
    # the first step past them (each step and validation well under 10 s here)
    g = kids["sequential"]["grpo"].info
    pid = parents["sequential"].info.run_id
    (summary,) = (work / "runs").glob(f"tiny/{pid}/grpo/train_summary.json")
    grpo_s = json.loads(summary.read_text())["seconds"]
    assert grpo_s <= ctl.data.metrics["sft_continued/seconds"] <= grpo_s + 10
    assert ctl.info.start_time >= g.end_time
    assert "grpo/eval/synthetic/diff_vs_sft_continued" in parents["sequential"].data.metrics
