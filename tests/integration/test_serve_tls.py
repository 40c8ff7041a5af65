"""`grpo serve --tls-self-signed`: both servers on https only; a client without the CA is
refused, one with it (the standard variables) works, and so do the worker and its flow runs.
A worker that shares only the network with serve (another checkout at another path, its own
HOME and Prefect home, no state directory) runs a whole pipeline whose model is registered and
downloadable from the server alone. A non-loopback address without TLS is refused before
anything starts."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import ROOT
from tests.serve_harness import WAITING, Served

pytestmark = [pytest.mark.slow, pytest.mark.serve]
GRPO = str(Path(sys.executable).with_name("grpo"))


def test_serve_on_https_refuses_clients_without_the_ca_and_speaks_no_plain_http(
    tmp_path, monkeypatch
):
    s = Served(tmp_path, "serve-tls", extra=("--tls-self-signed",))
    remote = None
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
        for k, v in s.client_env().items():
            monkeypatch.setenv(k, v)
        remote = _remote_worker(s, tmp_path)
        _a_run_on_the_remote_worker_is_registered_and_served(s, tmp_path, remote)
    finally:
        rc = s.stop(remote)
    assert rc == 0, s.out.read_text()[-2000:]

    # a non-loopback address without TLS: refused in one line, nothing started
    env = {**os.environ, "GRPO_SERVE_HOST": "0.0.0.0"}
    plain = subprocess.run([GRPO, "serve", "--state-dir", str(tmp_path / "open")], env=env,
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert plain.returncode == 2
    assert plain.stderr.count("\n") == 1 and "GRPO_SERVE_HOST=0.0.0.0 is not loopback" in (
        plain.stderr)  # fmt: skip
    assert not (tmp_path / "open" / "runs").exists()


def _remote_worker(s: Served, tmp: Path) -> subprocess.Popen:
    """`grpo worker` from a copy of the project at another path, with its own HOME and Prefect
    home and only the client settings a remote machine would hold (no serve state directory);
    serve's own worker is frozen so that the copy takes the next run."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    clone = tmp / "elsewhere" / "grpo-pipeline"
    for f in files:
        if (ROOT / f).is_file():
            (clone / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, clone / f)
    home = tmp / "remote-home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PREFECT_", "MLFLOW_", "GRPO_"))}  # fmt: skip
    # the copy's packages first on the path, as its own install would make them (this test
    # shares one virtual environment, whose editable install points at the project); on
    # MLflow the worker is a trainer account, made by serve's admin with `grpo users add`
    env.update({**s.client_env(), "HOME": str(home), "PREFECT_HOME": str(home / ".prefect"),
                "PREFECT_WORKER_QUERY_SECONDS": "2", "HF_HUB_OFFLINE": "1",
                "PYTHONPATH": str(clone)})  # fmt: skip
    env.update(_account(s, tmp, "remote-trainer", "trainer"))
    s.child("worker start").suspend()
    return subprocess.Popen(
        [GRPO, "worker", "--pool", "e2e-pool", "--name", "remote"], env=env, cwd=clone,
        stdout=(tmp / "remote.out").open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip


def _a_run_on_the_remote_worker_is_registered_and_served(
    s: Served, tmp: Path, remote: subprocess.Popen
) -> None:
    from mlflow import MlflowClient
    from mlflow.artifacts import download_artifacts

    run = s.trigger(timeout=0)
    state = s.wait_state(run["id"], (*WAITING, "RUNNING"), 600, "the remote worker's run ended")
    assert state == "COMPLETED", s.why(run["id"]) + (tmp / "remote.out").read_text()[-2000:]
    assert remote.poll() is None
    assert f"submitting flow run '{run['id']}'" in (tmp / "remote.out").read_text()
    clone = tmp / "elsewhere" / "grpo-pipeline"
    # the flow run entered the copy, not the path serve deployed from
    assert f"flow run in the project at {clone.resolve()}\n" in (tmp / "remote.out").read_text()
    # what it made is on the server: the registered version and its model, downloaded by a
    # client that holds nothing but the server's address, credentials and CA
    c = MlflowClient(s.tracking, s.tracking)
    mv = c.get_model_version_by_alias("serve-tls", "challenger")
    assert c.get_run(mv.run_id).info.artifact_uri.startswith("mlflow-artifacts:/")
    dst = download_artifacts(artifact_uri="models:/serve-tls@challenger", dst_path=str(tmp / "got"))
    assert list(Path(dst).rglob("model.safetensors")), list(Path(dst).rglob("*"))[:20]
    _roles_hold(s, tmp, mv)


def _account(s: Served, tmp: Path, name: str, role: str) -> dict[str, str]:
    """`grpo users add` as serve's admin (credentials from the state directory): the new
    account's settings file, read back as the variables its holder sets."""
    admin = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_TRACKING_")}
    admin |= {"MLFLOW_TRACKING_URI": s.tracking, "GRPO_SERVE_STATE": str(s.state)}
    out = subprocess.run([GRPO, "users", "add", name, "--role", role], env=admin, text=True,
                         capture_output=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    path = s.state / ".grpo-serve" / "users" / f"{name}.env"
    assert path.stat().st_mode & 0o077 == 0 and str(path) in out.stdout
    found = dict(line.split("=", 1) for line in path.read_text().split())
    assert found["MLFLOW_TRACKING_PASSWORD"] not in out.stdout + out.stderr
    return found


def _roles_hold(s: Served, tmp: Path, mv) -> None:  # noqa: ANN001
    """The remote worker's trainer account registered the version but could not move
    @champion; an approver's `grpo promote` does, and the server records both names. Readers
    read and nothing else; trainers cannot move or delete what an approver guards. An artifact
    upload is served by MLflow's FastAPI routes, not the Flask app the role check wraps: MLflow's
    own grants (a reader has READ) refuse it there."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException
    from requests import HTTPError

    c = MlflowClient(s.tracking, s.tracking)  # admin (the test's environment)
    assert mv.tags["registered_by"] == "remote-trainer"
    assert "promoted_by" not in mv.tags
    assert "champion" not in c.get_registered_model("serve-tls").aliases
    if mv.tags["gate/decision"] == "recommended":  # the gate passed; the account could not
        assert f"an approver runs `grpo promote --version {mv.version}`" in mv.tags["promotion"]
    else:
        assert mv.tags["gate/decision"] == "not promoted", mv.tags
    lead = _account(s, tmp, "lead", "approver")
    reader = _account(s, tmp, "viewer", "reader")
    trainer = dict(line.split("=", 1) for line in (
        s.state / ".grpo-serve" / "users" / "remote-trainer.env").read_text().split())  # fmt: skip

    def attempt(account: dict[str, str], call) -> str:  # noqa: ANN001
        with pytest.MonkeyPatch.context() as mp:
            for k, v in account.items():
                mp.setenv(k, v)
            mp.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
            try:
                call(MlflowClient(s.tracking, s.tracking))
            except MlflowException as e:
                return e.error_code
            except HTTPError as e:  # the artifact client's error: the status says it
                return {403: "PERMISSION_DENIED"}.get(e.response.status_code, str(e))
        return "OK"

    name, v = "serve-tls", mv.version
    writes = {
        "create experiment": lambda m: m.create_experiment(f"x-{len(m.search_experiments())}"),
        "tag the version": lambda m: m.set_model_version_tag(name, v, "note", "x"),
        "set @challenger": lambda m: m.set_registered_model_alias(name, "challenger", v),
        "set @champion": lambda m: m.set_registered_model_alias(name, "champion", v),
        "delete the version": lambda m: m.delete_model_version(name, "999"),
        "log a metric": lambda m: m.log_metric(mv.run_id, "role_check", 1.0),
        "upload an artifact": lambda m: m.log_text(mv.run_id, "x", "role_check.txt"),
    }
    may = {"viewer": set(), "remote-trainer": {"create experiment", "tag the version",
                                               "set @challenger", "log a metric",
                                               "upload an artifact"}}  # fmt: skip
    for who, account in (("viewer", reader), ("remote-trainer", trainer)):
        assert attempt(account, lambda m: m.search_experiments()) == "OK"
        for what, call in writes.items():
            want = "OK" if what in may[who] else "PERMISSION_DENIED"
            assert attempt(account, call) == want, (who, what)
    # reserved tags (infra.roles.reserved_tag): every role, setting and deleting each kind;
    # a permitted set writes the value the tag holds, so the record stays as the gate wrote it
    other = _account(s, tmp, "trainer-b", "trainer")
    tags = c.get_model_version(name, v).tags
    reserved = {"registered_by": tags["registered_by"], "promoted_by": "forged",
                "gate/decision": tags["gate/decision"], "promotion": tags["promotion"],
                "approval/decision": "approved", "manual/champion": "forged"}  # fmt: skip
    may_set = {"viewer": set(), "trainer-b": set(), "lead": {"manual/champion"},
               "remote-trainer": {"gate/decision", "promotion", "approval/decision"}}  # fmt: skip
    accounts = {"viewer": reader, "trainer-b": other, "lead": lead, "remote-trainer": trainer}
    for who, account in accounts.items():
        for key, value in reserved.items():
            if key == "approval/decision" and who == "remote-trainer":
                continue  # written below by the approval flow, with its own value
            got = attempt(account, lambda m, k=key, x=value: m.set_model_version_tag(name, v, k, x))
            assert got == ("OK" if key in may_set[who] else "PERMISSION_DENIED"), (who, key)
            got = attempt(account, lambda m, k=key: m.delete_model_version_tag(name, v, k))
            assert got == "PERMISSION_DENIED", (who, "delete", key)
    after = c.get_model_version(name, v).tags
    assert after["registered_by"] == "remote-trainer" and "promoted_by" not in after
    assert after["gate/decision"] == tags["gate/decision"], after
    assert after["manual/champion"] == "forged"  # the approver's (the one allowed) write
    with pytest.MonkeyPatch.context() as mp:  # the refusal line says what is reserved and why
        for k, val in other.items():
            mp.setenv(k, val)
        with pytest.raises(MlflowException, match="reserved for the account that registered"):
            MlflowClient(s.tracking, s.tracking).set_model_version_tag(
                name, v, "gate/decision", "promoted"
            )
    # an approval the trainer account's flow run would apply (in a process of its own, as a
    # flow run is, with the trainer's credentials): recorded, @champion unmoved
    code = ("import json, sys; from grpo.config import load_config; "
            "from tasks.registry import apply_approval; "
            "print(json.dumps(apply_approval(load_config(sys.argv[1]), json.loads(sys.argv[2]), "
            "{'promote': True, 'by': 'ana', 'reason': 'looks right', 'at': 'now'})))")  # fmt: skip
    reg = {"name": name, "version": v, "champion_version": None, "gate_passed": True,
           "decision": "the gate's text", "about": ""}  # fmt: skip
    run = subprocess.run([sys.executable, "-c", code, str(s.config), json.dumps(reg)],
                         env={**os.environ, **trainer}, capture_output=True, text=True,
                         timeout=180)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert not got["champion"] and "champion" not in c.get_registered_model(name).aliases
    tags = c.get_model_version(name, v).tags
    assert tags["approval/decision"] == "approved" and tags["approval/by"] == "ana"
    assert f"an approver runs `grpo promote --version {v}`" in tags["promotion"], tags
    # the approver promotes with the CLI; the server, not the client, names who did it
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_TRACKING_")}
    env |= {"MLFLOW_TRACKING_URI": s.tracking, **lead}
    out = subprocess.run([GRPO, "promote", "--config", str(s.config), "--version", str(v),
                          "--reason", "approved in review"], env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    now = c.get_model_version_by_alias("serve-tls", "champion")
    assert now.version == v and now.tags["promoted_by"] == "lead"
    assert "(account lead)" in now.tags["manual/champion"]
    listed = subprocess.run([GRPO, "users", "list"], capture_output=True, text=True, timeout=120)
    roles = "admin admin lead approver remote-trainer trainer trainer-b trainer viewer reader"
    assert listed.stdout.split() == roles.split(), listed.stderr[-2000:]
