"""Reward functions with TRL's signature: fn(completions, **columns) -> list[float | None].

Importing the package registers the built-in functions by name (reward_fns.registry).
"""

from reward_fns.accuracy import accuracy, extract_answer, gold_parses, is_correct
from reward_fns.format import format_reward, soft_overlong_penalty
from reward_fns.process import arithmetic_steps
from reward_fns.registry import PROCESS_REWARDS, REWARD_FUNCS
from reward_fns.scoring import RewardFunctionError, resolve, score, with_time_limit

__all__ = [
    "PROCESS_REWARDS",
    "REWARD_FUNCS",
    "RewardFunctionError",
    "accuracy",
    "arithmetic_steps",
    "extract_answer",
    "format_reward",
    "gold_parses",
    "is_correct",
    "resolve",
    "score",
    "soft_overlong_penalty",
    "with_time_limit",
]
