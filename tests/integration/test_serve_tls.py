"""`grpo serve --tls-self-signed`: both servers on https only; a client without the CA is
refused, one with it (the standard variables) works, and so do the worker and its flow runs.
A non-loopback address without TLS is refused before anything starts."""

from __future__ import annotations

import http.client
import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.serve_harness import WAITING, Served

pytestmark = [pytest.mark.slow, pytest.mark.serve]
GRPO = str(Path(sys.executable).with_name("grpo"))


def test_serve_on_https_refuses_clients_without_the_ca_and_speaks_no_plain_http(tmp_path):
    s = Served(tmp_path, "serve-tls", extra=("--tls-self-signed",))
    try:
        s.wait_ready()
        out = s.out.read_text()
        assert f"Prefect UI: https://127.0.0.1:{s.prefect}" in out
        assert f"MLflow UI:  https://127.0.0.1:{s.mlflow}" in out
        key = s.state / ".grpo-serve" / "tls" / "key.pem"
        assert key.stat().st_mode & 0o077 == 0
        for url in (f"{s.api}/health", f"{s.tracking}/health"):
            # no CA: the public CAs do not vouch for serve's certificate
            with pytest.raises(urllib.error.URLError) as err:
                urllib.request.urlopen(url, timeout=10, context=ssl.create_default_context())
            assert isinstance(err.value.reason, ssl.SSLCertVerificationError), err.value
            with urllib.request.urlopen(url, timeout=10, context=s.ssl_context()) as r:
                assert r.status == 200
            # and no plain-HTTP listener answers on the port
            with pytest.raises((OSError, http.client.HTTPException)):
                urllib.request.urlopen(url.replace("https://", "http://"), timeout=10)
        # MLflow's client (requests) with REQUESTS_CA_BUNDLE; refused without it
        env = {**os.environ, **s.client_env()}
        code = ("from mlflow import MlflowClient; c = MlflowClient(); "
                "print(c.create_experiment('tls-check'))")  # fmt: skip
        ok = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=120)  # fmt: skip
        assert ok.returncode == 0, ok.stderr[-2000:]
        bare = {k: v for k, v in env.items() if k not in ("REQUESTS_CA_BUNDLE", "SSL_CERT_FILE")}
        bare["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"  # a refusal is final: no backoff
        code = "from mlflow import MlflowClient; MlflowClient().search_experiments()"
        refused = subprocess.run([sys.executable, "-c", code], env=bare, capture_output=True,
                                 text=True, timeout=120)  # fmt: skip
        assert refused.returncode != 0 and "CERTIFICATE_VERIFY_FAILED" in refused.stderr
        # Prefect's client (the trigger), serve's worker and the flow run it starts, on https
        bad = s.trigger(timeout=0, overrides=["grpo.steps=0"])
        assert s.wait_state(bad["id"], (*WAITING, "RUNNING"), 180, "the run ended") == "FAILED"
        assert "grpo.steps" in s.api_get(f"/flow_runs/{bad['id']}")["state"]["message"]
    finally:
        rc = s.stop()
    assert rc == 0, s.out.read_text()[-2000:]

    # a non-loopback address without TLS: refused in one line, nothing started
    env = {**os.environ, "GRPO_SERVE_HOST": "0.0.0.0"}
    plain = subprocess.run([GRPO, "serve", "--state-dir", str(tmp_path / "open")], env=env,
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert plain.returncode == 2
    assert plain.stderr.count("\n") == 1 and "GRPO_SERVE_HOST=0.0.0.0 is not loopback" in (
        plain.stderr)  # fmt: skip
    assert not (tmp_path / "open" / "runs").exists()
