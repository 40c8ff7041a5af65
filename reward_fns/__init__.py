"""Reward functions with TRL's signature: fn(completions, **columns) -> list[float | None]."""

from reward_fns.accuracy import accuracy, extract_answer, gold_parses, is_correct
from reward_fns.format import format_reward, soft_overlong_penalty
from reward_fns.registry import RewardFunctionError, resolve, score

__all__ = [
    "RewardFunctionError",
    "accuracy",
    "extract_answer",
    "format_reward",
    "gold_parses",
    "is_correct",
    "resolve",
    "score",
    "soft_overlong_penalty",
]
