"""Every config and deployment the project ships loads as a user would load it."""

import importlib
from pathlib import Path

import pytest
import yaml

from grpo.config import load_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOYMENTS = yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_each_shipped_config_loads(path):
    cfg = load_config(path, [])
    written = yaml.safe_load(path.read_text()) or {}
    # what the file sets is what the config holds (no key silently dropped or renamed)
    flat = cfg.flat()
    for section, values in written.items():
        if not isinstance(values, dict):
            assert getattr(cfg, section) == values, section
            continue
        for k, v in values.items():
            if not isinstance(v, dict):
                assert flat[f"{section}.{k}"] == v, f"{section}.{k}"


@pytest.mark.parametrize("dep", DEPLOYMENTS, ids=[d["name"] for d in DEPLOYMENTS])
def test_each_deployment_names_a_flow_and_a_config_that_load(dep):
    from prefect.client.schemas.schedules import CronSchedule

    from flows.pipeline import PipelineParams

    path, name = dep["entrypoint"].split(":")
    flow = getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), name)
    assert flow.name == "grpo-pipeline"
    params = PipelineParams(**dep["parameters"]["params"])
    cfg = load_config(ROOT / params.config, params.overrides)
    assert cfg.run_name
    for s in dep.get("schedules", []):
        CronSchedule(cron=s["cron"], timezone=s["timezone"])  # raises on a malformed line
    assert dep["concurrency_limit"] == 1  # two runs would race on @champion
