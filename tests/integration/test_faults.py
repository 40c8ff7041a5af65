"""Faults survived: hung or exploding reward functions, non-finite losses, a dead rank."""

import time

import pytest
import torch
from safetensors.torch import load_file

from grpo.launch.paths import base_model_dir
from grpo.launch.runner import StageError, run_grpo
from reward_fns import RewardFunctionError
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


@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_non_finite_loss_is_skipped_or_stops_keeping_the_checkpoint(tmp_path, policy):
    from grpo.engine.loop import Trainer

    cfg = small_config(
        tmp_path, "grpo.reward_funcs=['tests.fault_rewards:overflow']", "grpo.reward_weights=[1]",
        "grpo.advantage_mode=center", f"grpo.on_nonfinite={policy}", "grpo.steps=2",
    )  # fmt: skip
    base = base_model_dir(cfg)
    t = Trainer(cfg, base, tmp_path / "grpo")
    before = {k: v.clone() for k, v in t.engine.module.state_dict().items()}
    if policy == "stop":
        with pytest.raises(FloatingPointError, match="non-finite loss"):
            t.train(progress=False)
        assert not (tmp_path / "grpo" / "checkpoints" / "latest").exists()
        return
    out = t.train(progress=False)
    assert out["final"]["nonfinite_losses"] > 0
    after = t.engine.module.state_dict()
    for k, v in before.items():  # skipped: no update, and above all no NaN in the weights
        assert torch.equal(v, after[k]), k
    saved = load_file(tmp_path / "grpo" / "policy" / "model.safetensors")
    assert all(torch.isfinite(v).all() for v in saved.values())


def test_a_dead_rank_fails_the_stage_with_its_error_and_keeps_the_checkpoint(tmp_path):
    cfg = small_config(
        tmp_path, "deepspeed.nproc=2", "deepspeed.timeout_s=60", "grpo.steps=6",
        "grpo.reward_funcs=['tests.fault_rewards:kill_rank1_at_step3']", "grpo.reward_weights=[1]",
        "deepspeed.master_port=29671",
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
