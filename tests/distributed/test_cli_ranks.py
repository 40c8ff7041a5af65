"""The commands a user runs on two ranks, through the CLI: SFT, the control, GRPO from a
hostfile under ZeRO-3 with a KL reference, and GRPO with asynchronous rollouts under ZeRO-2."""

import sys

import pytest
from safetensors.torch import load_file

from tests.helpers import small_config

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_sft_control_and_grpo_through_the_cli_on_two_ranks(tmp_path):
    """What a user runs on two ranks: `grpo sft` (distributed SFT), the SFT control, and `grpo
    train` launched from a hostfile (two local slots) under ZeRO-3 with beta > 0, so that the
    frozen reference is partitioned too. Each finishes with weights written once, by rank 0."""
    import json
    import subprocess

    from grpo.launch.paths import reference_dir
    from grpo.launch.runner import run_control
    from tests.helpers import SMALL

    two = ["deepspeed.nproc=2", "sft.batch_size=8", "grpo.prompts_per_step=2"]
    cfg = small_config(tmp_path, *two)
    cli = [sys.executable, "-m", "cli.main"]
    flags = [x for s in [*SMALL, *two, f"output_dir={tmp_path}"] for x in ("--set", s)]
    sft = subprocess.run([*cli, "sft", *flags], capture_output=True, text=True, timeout=600)
    assert sft.returncode == 0, sft.stderr[-2000:]
    ref = reference_dir(cfg)
    summary = json.loads((ref / "sft_summary.json").read_text())
    assert summary["steps"] == 2 * 8 and summary["history"]  # 64 rows / 8 per step, 2 epochs

    ctl = run_control(cfg, ref, tmp_path / "control", seconds=2.0, log=lambda s: None)
    assert ctl["steps"] >= 1 and (tmp_path / "control" / "model.safetensors").exists()

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    out = tmp_path / "grpo"
    train = subprocess.run(
        [*cli, "train", "--hostfile", str(hostfile), "--policy", str(ref), "--out", str(out),
         *flags, "--set", "deepspeed.zero_stage=3", "--set", "grpo.beta=0.04"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert train.returncode == 0, train.stderr[-2000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all("kl" in r and r["kl"] >= 0 for r in rows)  # the ZeRO-3 reference answered
    policy = load_file(out / "policy" / "model.safetensors")  # gathered from the partitions
    start = load_file(ref / "model.safetensors")
    assert policy.keys() == start.keys()
    assert all(policy[k].shape == start[k].shape for k in start)

    # asynchronous rollouts on two ranks: each rank's sampler process samples the rank's share
    # one step ahead, with the weights every rank holds after each update (ZeRO-2)
    out = tmp_path / "grpo_async"
    train = subprocess.run(
        [*cli, "train", "--policy", str(ref), "--out", str(out), *flags,
         "--set", "deepspeed.zero_stage=2", "--set", "grpo.async_rollouts=true",
         "--set", "grpo.reward_funcs=[tests.trl_doc_rewards:reward_len]",
         "--set", "grpo.reward_weights=[1.0]"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert train.returncode == 0, train.stderr[-2000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").open()]
    assert [r["async/staleness"] for r in rows] == [0.0, 1.0]
    # step 1 sampled with the weights it trains (the gap is numerics), step 2 one update behind
    # (reward_len: completion lengths differ, so step 1 did update)
    assert rows[0]["logprob_gap/mean"] < 1e-4 < rows[1]["logprob_gap/mean"]
