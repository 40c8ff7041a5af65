"""Reward functions as TRL users write them, for tests/integration/test_trl_compat.py.

`reward_len` and `format_reward_func` are copied unchanged from TRL's documentation (the
quickstart and the GRPO trainer page); the others exercise the rest of TRL's contract.
"""

import re

from trl.rewards import get_soft_overlong_punishment


def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


# TRL's factory, made at import time as a TRL script does
soft_overlong = get_soft_overlong_punishment(max_completion_len=24, soft_punish_cache=8)

SEEN: list[dict] = []  # what the trainer passed, for the test to read (in-process trainer)


def uses_everything(prompts, completions, completion_ids, trainer_state, log_extra, log_metric,
                    solution, **kwargs):  # fmt: skip
    SEEN.append({"prompts": prompts, "completions": completions, "ids": completion_ids,
                 "step": trainer_state.global_step, "max_steps": trainer_state.max_steps,
                 "solution": solution, "columns": sorted(kwargs)})  # fmt: skip
    log_extra("n_chars", [len(str(c)) for c in completions])
    log_metric("my_metric", 0.5 + trainer_state.global_step)
    return [0.0] * len(completions)


def constant(completions, **kwargs):
    """No learning signal at all: every group's rewards are equal."""
    return [1.0] * len(completions)
