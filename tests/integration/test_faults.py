"""Faults survived: hung or exploding reward functions, non-finite losses, a dead rank."""

import json
import time

import pytest
import torch
from safetensors.torch import load_file

from grpo.launch.paths import base_model_dir
from grpo.launch.runner import StageError, run_grpo
from reward_fns import RewardFunctionError
from tests import fault_rewards
from tests.helpers import small_config

pytestmark = [pytest.mark.slow, pytest.mark.faults]


def test_a_hung_reward_function_fails_the_step_naming_it(tmp_path):
    from grpo.engine.loop import Trainer

    cfg = small_config(
        tmp_path, "grpo.reward_funcs=[accuracy, 'tests.fault_rewards:hang']",
        "grpo.reward_weights=[1.0, 1.0]", "grpo.reward_timeout_s=1",
    )  # fmt: skip
    t = Trainer(cfg, base_model_dir(cfg), tmp_path / "grpo")
    start = time.perf_counter()
    with pytest.raises(RewardFunctionError, match=r"'hang' did not return within 1s"):
        t.train(progress=False)
    assert time.perf_counter() - start < 30


@pytest.mark.parametrize(("policy", "stage"), [("skip", 0), ("skip", 2), ("stop", 0)])
def test_non_finite_loss_is_skipped_or_stops_keeping_the_checkpoint(tmp_path, policy, stage):
    """Step 1 is finite and checkpointed, steps 2-3 overflow. `stop` fails at step 2, keeping
    step 1's checkpoint. `skip` drops the whole optimizer step of each pass with a non-finite
    loss, as DeepSpeed's loss scaler drops an overflowing one: the run ends with exactly the
    weights of a run that stopped after step 1 (no weight, Adam moment or schedule moved), both
    under ZeRO 0 (a bare optimizer, told to skip) and ZeRO 2 (DeepSpeed's own overflow check)."""
    from grpo.engine.loop import Trainer

    def trainer(name: str, steps: int) -> Trainer:
        fault_rewards._calls.clear()  # the rewards count their calls: step 1 is finite
        cfg = small_config(
            tmp_path, "grpo.reward_funcs=['tests.fault_rewards:overflow_from_step2']",
            "grpo.reward_weights=[1]", "grpo.advantage_mode=center", "grpo.lr=0.01",
            f"grpo.on_nonfinite={policy}", f"grpo.steps={steps}", "grpo.checkpoint_every=1",
            "grpo.warmup_steps=0", "grpo.lr_schedule=constant", "grpo.mu=2",
            f"deepspeed.zero_stage={stage}",
        )  # fmt: skip
        return Trainer(cfg, base_model_dir(cfg), tmp_path / name)

    t = trainer("grpo", 3)
    if policy == "stop":
        with pytest.raises(FloatingPointError, match="non-finite loss"):
            t.train(progress=False)
        # step 1's checkpoint is kept, finite, and a resume would start after it
        from grpo.engine import checkpoint

        ckpt = tmp_path / "grpo" / "checkpoints"
        assert (ckpt / "latest").read_text().strip() == "step0000001"
        fresh = trainer("fresh", 3)
        assert checkpoint.load(fresh.engine, ckpt)["step"] == 1
        assert all(torch.isfinite(p).all() for p in fresh.engine.module.parameters())
        return
    out = t.train(progress=False)
    assert out["final"]["nonfinite_losses"] > 0 and out["final"]["step"] == 3
    rows = [json.loads(ln) for ln in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    # mu = 2: two optimizer steps a GRPO step, both skipped at steps 2 and 3, none at step 1
    assert [r["optimizer_steps_skipped"] for r in rows] == [0.0, 2.0, 2.0]
    assert t.engine.skipped_steps == 4
    trainer("one", 1).train(progress=False)
    saved = load_file(tmp_path / "grpo" / "policy" / "model.safetensors")
    one = load_file(tmp_path / "one" / "policy" / "model.safetensors")
    base = load_file(base_model_dir(t.cfg) / "model.safetensors")
    assert any(not one[k].equal(base[k]) for k in base)  # step 1 did update
    for k, v in one.items():
        assert torch.equal(v, saved[k]), k


def test_a_non_finite_loss_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    """Two ranks, ZeRO 2: from step 2 only rank 1's loss overflows. Rank 0's finite
    micro-batches do not step alone: steps 2 and 3 are skipped on both ranks, and the final
    weights are step 1's checkpoint's."""
    cfg = small_config(
        tmp_path, "deepspeed.nproc=2", "deepspeed.zero_stage=2", "grpo.steps=3",
        "grpo.reward_funcs=['tests.fault_rewards:overflow_on_rank1_from_step2']",
        "grpo.reward_weights=[1]", "grpo.advantage_mode=center", "grpo.lr=0.01",
        "grpo.warmup_steps=0", "grpo.checkpoint_every=1", "grpo.keep_checkpoints=3",
    )  # fmt: skip
    out = tmp_path / "grpo"
    run_grpo(cfg, base_model_dir(cfg), out, log=lambda s: None)
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["optimizer_steps_skipped"] for r in rows] == [0.0, 1.0, 1.0]
    assert [r["nonfinite_losses"] > 0 for r in rows] == [False, True, True]
    states = out / "checkpoints" / "step{:07d}" / "mp_rank_00_model_states.pt"
    first, last = (torch.load(str(states).format(s), weights_only=False)["module"] for s in (1, 3))
    base = load_file(base_model_dir(cfg) / "model.safetensors")
    assert any(not first[k].equal(base[k]) for k in base if k in first)  # step 1 did update
    assert first.keys() == last.keys()
    for k, v in first.items():
        assert torch.equal(v, last[k]), k


def test_a_reward_beyond_float32_stops_the_run_naming_it(tmp_path):
    """1e308 is a finite Python float and inf in float32: it made reward inf and reward_std NaN,
    and the run exited 0 without a single update."""
    from grpo.engine.loop import Trainer
    from reward_fns.scoring import RewardFunctionError

    cfg = small_config(tmp_path, "grpo.reward_funcs=['tests.fault_rewards:huge']",
                       "grpo.reward_weights=[1]")  # fmt: skip
    t = Trainer(cfg, base_model_dir(cfg), tmp_path / "grpo")
    with pytest.raises(RewardFunctionError, match=r"completion 1: weighted reward 1e\+308 is "
                       r"beyond float32's range .*huge=1e\+308"):  # fmt: skip
        t.train(progress=False)


def test_a_dead_rank_fails_the_stage_with_its_error_and_keeps_the_checkpoint(tmp_path):
    cfg = small_config(
        tmp_path, "deepspeed.nproc=2", "deepspeed.timeout_s=60", "grpo.steps=6",
        "grpo.reward_funcs=['tests.fault_rewards:kill_rank1_at_step3']", "grpo.reward_weights=[1]",
    )  # fmt: skip
    out = tmp_path / "grpo"
    start = time.perf_counter()
    with pytest.raises(StageError) as err:
        run_grpo(cfg, base_model_dir(cfg), out, log=lambda s: None)
    elapsed = time.perf_counter() - start
    assert elapsed < 240  # nobody hangs forever
    assert "exited with" in str(err.value)
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert latest == "step0000002"  # written before rank 1 died at step 3
    assert (out / "checkpoints" / latest / "mp_rank_00_model_states.pt").exists()


def test_a_checkpoint_that_cannot_be_written_is_named_and_the_last_one_kept(tmp_path):
    """A write that fails halfway (here the rank's file-size limit, set once its first
    checkpoint is written; a full disk fails the same way): one line naming the step, the
    directory and the cause, no partial `.tmp` left, the previous checkpoint kept. Before: a
    full disk read "RuntimeError: ... unexpected pos 1461888 vs 1461776" and left the .tmp."""
    import signal
    import threading

    import psutil

    cfg = small_config(tmp_path, "grpo.steps=400", "grpo.checkpoint_every=1")
    out, base, failed = tmp_path / "grpo", base_model_dir(cfg), []

    def train() -> None:
        try:
            run_grpo(cfg, base, out, log=lambda s: None)
        except StageError as e:
            failed.append(e)

    # over its limit a write fails with EFBIG instead of the signal killing the process
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        thread = threading.Thread(target=train)
        thread.start()
        deadline = time.time() + 180
        while not (out / "checkpoints" / "latest").exists():
            assert time.time() < deadline and thread.is_alive(), "no first checkpoint"
            time.sleep(0.05)
        (rank,) = [p for p in psutil.Process().children(recursive=True)
                   if "grpo.launch.worker" in " ".join(p.cmdline())]  # fmt: skip
        rank.rlimit(psutil.RLIMIT_FSIZE, (40_000, 40_000))  # a model file is 90 KB
        thread.join(timeout=180)
    finally:
        signal.signal(signal.SIGXFSZ, old)
    assert failed, "the run did not fail"
    msg = str(failed[0])
    assert "CheckpointWriteError: checkpoint of step" in msg and str(out / "checkpoints") in msg
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert f"the checkpoint {latest} is kept" in msg, msg
    assert len(msg.splitlines()) == 1
    assert not list((out / "checkpoints").glob("*.tmp"))
    assert (out / "checkpoints" / latest / "mp_rank_00_model_states.pt").stat().st_size > 40_000


def test_a_single_rank_leaves_no_rendezvous_file_behind(tmp_path):
    """Every single-rank stage made a grpo-dist-* file in the temp directory and left it (54
    after one afternoon); the directory it now uses goes when the process exits."""
    import os
    import subprocess
    import sys

    code = ("import os, tempfile; from grpo.engine.distributed import init_distributed; "
            "init_distributed(60); print(os.listdir(tempfile.gettempdir()))")  # fmt: skip
    from grpo.launch.runner import DIST_VARS

    # a process started as one rank, as run_launches starts it: without the process group
    # variables that in-process trainers of this test worker left in its environment
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS} | {"TMPDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "grpo-dist-" in out.stdout  # there while it ran
    assert not list(tmp_path.glob("grpo-dist-*"))  # gone after
