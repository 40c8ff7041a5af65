"""The credentials of `grpo serve`: private from the first byte, stable, given only to their
own server, never over a user's own settings."""

from __future__ import annotations

import os
import stat

import pytest

from infra import auth as sa
from infra.serve import locked_job_template


def test_credentials_are_private_random_and_stable(tmp_path):
    a = sa.create_or_load(tmp_path, "http://127.0.0.1:5000", "http://127.0.0.1:4200/api")
    path = sa.credentials_path(tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert len(set(a.secrets())) == 4 and min(map(len, a.secrets())) >= 32
    # a restart on other ports keeps the secrets (MLflow's admin password is set only once)
    b = sa.create_or_load(tmp_path, "http://127.0.0.1:5001", "http://127.0.0.1:4201/api")
    assert b.secrets() == a.secrets() and b.mlflow_uri == "http://127.0.0.1:5001"
    other = sa.create_or_load(tmp_path / "other", "x", "y")
    assert not set(other.secrets()) & set(a.secrets())


def test_a_file_others_can_read_is_refused_by_name(tmp_path):
    sa.create_or_load(tmp_path, "http://h:1", "http://h:2/api")
    os.chmod(sa.credentials_path(tmp_path), 0o644)
    with pytest.raises(sa.CredentialsError, match="readable by other accounts.*chmod 600"):
        sa.load(tmp_path)


def test_clients_get_credentials_only_for_the_recorded_servers(tmp_path):
    creds = sa.create_or_load(tmp_path, "http://127.0.0.1:5000", "http://127.0.0.1:4200/api")
    env = {"GRPO_SERVE_STATE": str(tmp_path), "MLFLOW_TRACKING_URI": "http://127.0.0.1:5000/"}
    assert sa.apply_to_environment(env) == ["MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"]
    assert env["MLFLOW_TRACKING_PASSWORD"] == creds.mlflow_password
    assert "PREFECT_API_AUTH_STRING" not in env
    # another server gets nothing; a value the user set is kept
    elsewhere = {
        "GRPO_SERVE_STATE": str(tmp_path),
        "MLFLOW_TRACKING_URI": "http://evil:5000",
        "PREFECT_API_URL": "http://127.0.0.1:4200/api",
        "PREFECT_API_AUTH_STRING": "me:x",
    }
    assert sa.apply_to_environment(elsewhere) == []
    assert elsewhere["PREFECT_API_AUTH_STRING"] == "me:x"
    assert "MLFLOW_TRACKING_PASSWORD" not in elsewhere
    # a local store needs nothing and reads no file
    assert sa.apply_to_environment({"GRPO_SERVE_STATE": "/nonexistent"}) == []


def test_the_pool_template_fixes_command_env_and_directory():
    t = locked_job_template()
    job, variables = t["job_configuration"], t["variables"]
    assert job["command"] is None and job["env"] == {} and job["working_dir"] is None
    assert variables["additionalProperties"] is False
    assert not {"command", "env", "working_dir"} & set(variables["properties"])
    # every template placeholder left refers to a declared variable
    placeholders = {v.strip("{} ") for v in job.values() if isinstance(v, str)}
    assert placeholders <= set(variables["properties"])
