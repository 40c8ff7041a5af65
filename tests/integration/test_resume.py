"""SIGKILL mid-run, then --resume: the same final parameters as an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo.launch.paths import base_model_dir, write_config
from grpo.launch.runner import run_subprocess
from tests.helpers import small_config

pytestmark = [pytest.mark.slow, pytest.mark.faults]


def _cmd(cfg_path: Path, base: Path, out: Path, resume: bool) -> list[str]:
    cmd = [sys.executable, "-m", "grpo.launch.worker", "train", "--config", str(cfg_path),
           "--policy", str(base), "--out", str(out)]  # fmt: skip
    return cmd + (["--resume"] if resume else [])


def test_kill_and_resume_matches_uninterrupted_run(tmp_path):
    cfg = small_config(tmp_path, "grpo.steps=6", "grpo.checkpoint_every=2")
    base = base_model_dir(cfg)
    cfg_path = write_config(cfg, tmp_path / "config.yaml")
    run_subprocess(_cmd(cfg_path, base, tmp_path / "whole", False), log=lambda s: None)

    out = tmp_path / "killed"
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    log = (tmp_path / "killed.log").open("w")
    proc = subprocess.Popen(
        _cmd(cfg_path, base, out, False), env=env, stdout=log, stderr=subprocess.STDOUT
    )
    latest = out / "checkpoints" / "latest"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if latest.exists() and latest.read_text().strip() >= "step0000002":
            break
        time.sleep(0.05)
    assert proc.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "policy").exists()  # it really died before the end
    killed_at = latest.read_text().strip()

    run_subprocess(_cmd(cfg_path, base, out, True), log=lambda s: None)
    whole = load_file(tmp_path / "whole" / "policy" / "model.safetensors")
    resumed = load_file(out / "policy" / "model.safetensors")
    for k in whole:
        assert torch.equal(whole[k], resumed[k]), (killed_at, k)
    steps = [line for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    assert len(steps) == 6  # no duplicated or lost step lines after the resume
    _a_finished_run_is_never_overwritten_or_resumed_by_another(tmp_path, base, cfg_path)


def _grpo_train(*args: str) -> tuple[int, str]:
    from tests.helpers import SMALL

    sets = [a for s in [*SMALL, "grpo.steps=6", "grpo.checkpoint_every=2"] for a in ("--set", s)]
    p = subprocess.run([sys.executable, "-m", "cli.main", "train", *args, *sets],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    return p.returncode, p.stderr


def _a_finished_run_is_never_overwritten_or_resumed_by_another(tmp, base, cfg_path) -> None:
    """`grpo train` on a directory that holds a run: refused in one line naming --resume and
    --overwrite, before any rank starts, and nothing in it changes. A resume with a config that
    trains something else, or from a checkpoint its metrics do not reach, is refused too."""
    whole = tmp / "whole"
    (whole / "config.yaml").write_text(cfg_path.read_text())  # as run_grpo writes it
    before = {f: f.read_bytes() for f in whole.rglob("*") if f.is_file()}
    code, err = _grpo_train("--policy", str(base), "--out", str(whole))
    assert code == 2 and len(err.strip().splitlines()) == 1, err[-2000:]
    assert "--resume" in err and "--overwrite" in err and "6 steps logged" in err
    assert {f: f.read_bytes() for f in whole.rglob("*") if f.is_file()} == before
    code, err = _grpo_train("--policy", str(base), "--out", str(whole), "--resume", "--set",
                            "grpo.lr=0.5")  # fmt: skip
    assert code == 2 and "grpo.lr" in err and "0.5" in err, err[-2000:]
    # what a rerun without --resume would leave if it were let through: the old checkpoint,
    # new metrics of 2 steps
    metrics = whole / "metrics.jsonl"
    metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:2]))
    code, err = _grpo_train("--policy", str(base), "--out", str(whole), "--resume")
    assert code == 2 and "step 6" in err and "1..2" in err, err[-2000:]


def test_a_kill_during_checkpoint_write_leaves_the_previous_one_usable(tmp_path):
    from grpo.engine import checkpoint
    from grpo.engine.loop import Trainer

    cfg = small_config(tmp_path, "grpo.steps=2", "grpo.checkpoint_every=2")
    t = Trainer(cfg, base_model_dir(cfg), tmp_path / "grpo")
    t.train(progress=False)
    root = tmp_path / "grpo" / "checkpoints"
    assert checkpoint.latest_tag(root) == "step0000002"
    # what a kill in the middle of DeepSpeed's write leaves: a partial temporary tag
    partial = root / "step0000004.tmp"
    partial.mkdir()
    (partial / "mp_rank_00_model_states.pt").write_bytes(b"\x00" * 10)
    client = checkpoint.load(t.engine, root)
    assert client["step"] == 2
    checkpoint.save(t.engine, root, 4, client, rank=0, keep=1)
    assert checkpoint.latest_tag(root) == "step0000004"
    assert not partial.exists() and not (root / "step0000002").exists()  # keep=1


def test_secrets_never_become_mlflow_params(tmp_path):
    from tasks.tracking import public_params, safe_params

    cfg = small_config(tmp_path, "tracking.tracking_uri=http://user:pw@host:5000")
    params = safe_params(cfg)
    assert len(params) == len(cfg.flat())  # no config key is a credential: all are logged
    assert params["eval.max_new_tokens"] == str(cfg.eval.max_new_tokens)  # a count, kept
    assert params["tracking.tracking_uri"] == "http://***@host:5000"
    assert all("pw@" not in v for v in params.values())
    # keys that name credentials, as a user's config or a plugin's section may have them
    flat = {
        "hub.hf_token": "hf_abc",
        "db.password": "pw",
        "aws.secret_access_key": "s",
        "api.API-KEY": "k",
        "grpo.max_completion_length": 8,
        "model.tokenizer": "x",
    }
    assert public_params(flat) == {"grpo.max_completion_length": "8", "model.tokenizer": "x"}


def test_resume_after_a_torn_line_trims_both_files_and_ends_the_same(tmp_path):
    """Killed while writing step 6's lines after the step-4 checkpoint: metrics.jsonl ends in a
    torn line and completions.jsonl holds steps past the checkpoint. --resume continues from
    step 4 and ends with the weights of an uninterrupted run, each step logged once."""
    import shutil

    cfg = small_config(tmp_path, "grpo.steps=6", "grpo.checkpoint_every=2",
                       "grpo.log_completions_every=1")  # fmt: skip
    base = base_model_dir(cfg)
    cfg_path = write_config(cfg, tmp_path / "config.yaml")
    out = tmp_path / "run"
    run_subprocess(_cmd(cfg_path, base, out, False), log=lambda s: None)
    whole = load_file(out / "policy" / "model.safetensors")
    # what a kill during step 6 leaves: latest = step 4, step 5's lines, a torn step-6 line
    (out / "checkpoints" / "latest").write_text("step0000004")
    shutil.rmtree(out / "policy")
    lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    (out / "metrics.jsonl").write_text("".join(lines[:5]) + lines[5][: len(lines[5]) // 2])
    n_samples = len((out / "completions.jsonl").read_text().splitlines())
    with (out / "completions.jsonl").open("a") as f:
        f.write('{"step": 6, "prompt": "1+1=", "compl')

    run_subprocess(_cmd(cfg_path, base, out, True), log=lambda s: None)
    resumed = load_file(out / "policy" / "model.safetensors")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
    samples = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    assert len(samples) == n_samples  # steps 5 and 6 logged once, not twice
    assert sorted({s["step"] for s in samples}) == [1, 2, 3, 4, 5, 6]


def test_a_best_selected_after_the_last_checkpoint_is_not_kept_by_a_resume(tmp_path, monkeypatch):
    """The selection found a new best at step 3, after the step-2 checkpoint, then the run
    died. The resumed run trims the curve to step 2 and redoes step 3, which this time is not
    the best: policy/ must hold step 2's weights (what the final curve names), not the weights
    of the step 3 the first run selected and then lost."""
    from grpo.engine.loop import Trainer

    cfg = small_config(tmp_path, "grpo.steps=4", "grpo.checkpoint_every=2", "grpo.eval_every=1",
                       "data.num_select=8", "grpo.reward_funcs=['tests.fault_rewards:alternating']",
                       "grpo.reward_weights=[1.0]")  # fmt: skip
    base = base_model_dir(cfg)
    # scripted accuracies per evaluation: the first run's steps 0-3, then the resume's 3 and 4
    scripted = iter([0.1, 0.2, 0.3, 0.9, 0.25, 0.28])
    weights: list[dict[str, torch.Tensor]] = []

    def accuracy(self) -> float:  # noqa: ANN001
        weights.append({k: v.detach().clone() for k, v in self.engine.module.state_dict().items()})
        return next(scripted)

    monkeypatch.setattr(Trainer, "heldout_accuracy", accuracy)
    real_step = Trainer.step

    def dies_at_step_3(self, step: int):  # noqa: ANN001, ANN202
        if step == 3:
            raise RuntimeError("killed")
        return real_step(self, step)

    monkeypatch.setattr(Trainer, "step", dies_at_step_3)
    out = tmp_path / "grpo"
    with pytest.raises(RuntimeError, match="killed"):
        Trainer(cfg, base, out).train(progress=False)
    assert (out / "best-000003").is_dir()  # the lost best, selected after the checkpoint
    monkeypatch.setattr(Trainer, "step", real_step)
    summary = Trainer(cfg, base, out).train(resume=True, progress=False)
    assert summary["selection"]["selected_step"] == 2
    assert summary["selection"]["curve"] == [[0, 0.1], [1, 0.2], [2, 0.3], [3, 0.25], [4, 0.28]]
    got = load_file(out / "policy" / "model.safetensors")
    step2 = weights[2]  # the first run's evaluation of step 2 (before its checkpoint)
    assert got and all(torch.equal(got[k], step2[k]) for k in got)
    # step 3 did move the weights, so the lost best's are not step 2's
    assert not all(torch.equal(got[k], weights[3][k]) for k in got)
    assert sorted(p.name for p in out.glob("best-*")) == ["best-000002"]
