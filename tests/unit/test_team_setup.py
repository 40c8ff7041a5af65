"""A team's setup, checked before anything starts: database URLs, the extra worker, the alert
URL, and the alerts' payloads as the receiver will parse them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from grpo.launch.runner import free_port
from infra import alerts, postgres

GRPO = str(Path(sys.executable).with_name("grpo"))


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("postgresql://grpo:hunter2@db:5432", "PGPASSWORD"),  # would show in `ps`
        ("mysql://grpo@db", "expected postgresql://"),
        ("postgresql:///only-a-socket", "expected postgresql://"),
        ("postgresql://grpo@db/mlflow", "name the server, not a database"),
    ],
)
def test_a_database_url_serve_cannot_use_is_refused_naming_why(url, said):
    with pytest.raises(postgres.DatabaseError, match=said) as e:
        postgres.external(url, None)
    assert "hunter2" not in str(e.value)


def test_an_unreachable_database_is_one_line_naming_its_host():
    port = free_port()  # nothing listens there
    with pytest.raises(postgres.DatabaseError, match="PostgreSQL at 127.0.0.1: ") as e:
        postgres.external(f"postgresql://grpo@127.0.0.1:{port}", "pw")
    assert "\n" not in str(e.value)


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([GRPO, *args], env=env, capture_output=True, text=True, timeout=120)


def test_a_worker_without_the_servers_addresses_or_credentials_is_refused(tmp_path):
    base = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "GRPO_SERVE_STATE": str(tmp_path)}
    out = _cli("worker", env=base)
    assert out.returncode == 2 and "set PREFECT_API_URL" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    api = f"http://127.0.0.1:{free_port()}/api"
    out = _cli("worker", env={**base, "PREFECT_API_URL": api})
    assert out.returncode == 2 and "MLFLOW_TRACKING_URI, PREFECT_API_AUTH_STRING not set" in (
        out.stderr
    )
    full = {**base, "PREFECT_API_URL": api, "PREFECT_API_AUTH_STRING": "admin:x",
            "MLFLOW_TRACKING_URI": "http://127.0.0.1:1"}  # fmt: skip
    out = _cli("worker", env=full)
    assert out.returncode == 2 and f"{api} does not answer" in out.stderr


def test_serve_refuses_an_alert_url_that_is_not_http_before_starting_anything(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
           alerts.URL_VAR: "file:///etc/passwd"}  # fmt: skip
    out = _cli("serve", "--state-dir", str(tmp_path / "state"), env=env)
    assert out.returncode == 2 and "must be an http(s) URL" in out.stderr
    assert not (tmp_path / "state").exists()


def test_the_alert_payloads_are_json_whatever_the_state_message_holds():
    """Prefect fills the payload with its Jinja environment; a failed run's message holds
    quotes, newlines and markup, and the receiver must still get JSON."""
    from prefect.server.utilities.user_templates import render_user_template_sync

    failed, stale = alerts.payloads("grpo-pipeline/nightly-tiny", 26)

    class State:
        name, message = "Failed", 'ConfigError: "x"\n  grpo.steps: <must be> > 0'

    class Run:
        name, id, state = "brave-fox", "0b1c", State()

    # (ui_url needs a server's address: the flow run's name stands in for it here)
    template = failed.replace("flow_run | ui_url", "flow_run.name")
    body = json.loads(render_user_template_sync(template, {"flow_run": Run()}))
    assert body == {"alert": "flow run failed", "deployment": "grpo-pipeline/nightly-tiny",
                    "flow_run": "brave-fox", "flow_run_id": "0b1c", "state": "Failed",
                    "message": State.message, "url": "brave-fox"}  # fmt: skip
    assert json.loads(stale)["alert"] == "no completed run for 26 h"
    assert alerts.where("https://hooks.example.com/services/T0/B1/secret") == (
        "https://hooks.example.com/..."
    )
