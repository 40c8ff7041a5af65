"""grpo.async_rollouts as a user sets it: what it turns on, and what it refuses."""

import pytest

from grpo.config import ConfigError, load_config


def test_async_turns_the_correction_on_unless_the_user_set_it():
    assert not load_config(None, []).grpo.rollout_correction
    assert load_config(None, ["grpo.async_rollouts=true"]).grpo.rollout_correction
    off = load_config(None, ["grpo.async_rollouts=true", "grpo.rollout_correction=false"])
    assert not off.grpo.rollout_correction
    # staleness 0 samples with the current weights: on-policy, nothing to correct
    assert not load_config(None, ["grpo.async_rollouts=true", "grpo.max_staleness=0"]
                           ).grpo.rollout_correction  # fmt: skip


@pytest.mark.parametrize(
    ("sets", "words"),
    [
        (["grpo.max_staleness=2"], ["grpo.max_staleness", "grpo.async_rollouts=true"]),
        (["grpo.sampler_threads=1"], ["grpo.sampler_threads", "grpo.async_rollouts=true"]),
        (["grpo.sampler_dtype=bfloat16"], ["grpo.sampler_dtype", "grpo.async_rollouts=true"]),
        (["grpo.async_rollouts=true", "deepspeed.zero_stage=3"], ["zero_stage 3", "whole"]),
        (["grpo.async_rollouts=true", "grpo.sampler_dtype=int8"], ["sampler_dtype", "float16"]),
    ],
)
def test_async_settings_that_cannot_work_are_refused_naming_the_field(sets, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, sets)
    msg = str(e.value)
    for w in words:
        assert w in msg, msg
