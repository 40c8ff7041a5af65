"""The registry's champion as a downstream user consumes it: mlflow.pyfunc and REST serving."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import new_experiment, small_config, tracking_uri

pytestmark = pytest.mark.slow
BETTER = {"diff": 0.2, "ci_low": 0.1, "ci_high": 0.3, "n": 100.0}  # than its own reference


@pytest.fixture(scope="module")
def champion(tmp_path_factory):
    """A tiny policy logged as an MLflow model and registered as @champion in a fresh store."""
    tmp = tmp_path_factory.mktemp("serving")
    with tracking_uri(f"sqlite:///{tmp / 'mlflow.db'}") as uri:
        yield _register_champion(tmp, uri)


def _register_champion(tmp, uri):
    from grpo.launch.paths import base_model_dir
    from tasks import tracking
    from tasks.registry import register
    from tasks.serving import log_policy

    cfg = small_config(tmp, "tracking.registered_model=served")
    c = tracking.client(cfg)
    run = c.create_run(new_experiment(c, uri, "serving")).info.run_id
    model_uri = log_policy(run, base_model_dir(cfg), {"chat_template": False, "system_prompt": "",
                                                      "max_new_tokens": 6})  # fmt: skip
    reg = register(cfg, run, model_uri, {"eval/synthetic/accuracy": 0.5}, vs_reference=BETTER,
                   vs_champion=None, champion_version=None)  # fmt: skip
    assert reg["champion"]
    return cfg, uri, reg, run, model_uri


def _greedy(model_dir, prompts: list[str], max_new_tokens: int = 6) -> list[str]:
    """Each prompt's greedy completion straight from transformers: what serving must answer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = []
    for p in prompts:
        enc = tok(p, return_tensors="pt", add_special_tokens=False)
        ids = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id)  # fmt: skip
        out.append(tok.decode(ids[0, enc["input_ids"].shape[1] :], skip_special_tokens=True))
    assert any(out)  # an empty answer would make the comparisons below vacuous
    return out


def test_the_champion_loads_with_pyfunc_and_registration_is_idempotent(champion):
    import mlflow
    from mlflow import MlflowClient

    from tasks.registry import register

    cfg, uri, reg, run, model_uri = champion
    model = mlflow.pyfunc.load_model("models:/served@champion")
    out = model.predict(["12+34=", "7+5="])
    from grpo.launch.paths import base_model_dir

    assert out == _greedy(base_model_dir(cfg), ["12+34=", "7+5="])  # batched, left-padded
    assert model.metadata.get_input_schema() is not None  # a signature, not an empty schema
    # a retry of the registration (Prefect retries it) reuses the version of the same run
    again = register(cfg, run, model_uri, {"eval/synthetic/pass@2": 0.7}, vs_reference=BETTER,
                     vs_champion=None, champion_version=None)  # fmt: skip
    c = MlflowClient(uri, uri)
    assert again["version"] == reg["version"]
    assert len(c.search_model_versions("name='served'")) == 1
    assert "eval/synthetic/pass_at_2" in c.get_model_version("served", reg["version"]).tags


def test_the_champion_answers_over_rest(champion, tmp_path):
    cfg, uri, *_ = champion
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mlflow_bin = str(Path(sys.executable).with_name("mlflow"))
    # mlflow starts uvicorn by name: the virtual environment's bin on PATH, as once activated
    path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PATH": path}
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        [mlflow_bin, "models", "serve", "-m", "models:/served@champion", "--env-manager", "local",
         "-h", "127.0.0.1", "-p", str(port)],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        body = json.dumps({"inputs": ["12+34="]}).encode()
        deadline, answer = time.time() + 120, None
        while time.time() < deadline and proc.poll() is None:
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/invocations", data=body,
                headers={"Content-Type": "application/json"},
            )  # fmt: skip
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    answer = json.loads(r.read())
                break
            except OSError:
                time.sleep(1)
        assert answer is not None, (tmp_path / "serve.log").read_text()[-3000:]
        from grpo.launch.paths import base_model_dir

        assert answer["predictions"] == _greedy(base_model_dir(cfg), ["12+34="])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
        proc.wait(timeout=30)
