"""The environment's own score as a reward function: TRL's environment-owned reward.

With `tools.environment` (TRL's environment_factory), each episode has its environment instance,
passed to reward functions as the `environments` keyword argument, one per completion; this
function returns each one's `get_reward()`. It is listed like any other reward
(`grpo.reward_funcs: [environment, format]`), so its weight is explicit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from reward_fns.registry import reward_function
from reward_fns.scoring import RewardFunctionError


@reward_function("environment")
def environment_reward(
    completions: Sequence[Any], environments: Sequence[Any] | None = None, **kwargs: Any
) -> list[float]:
    """Each episode's environment scores itself (its get_reward(), no arguments)."""
    if environments is None:
        raise RewardFunctionError("environment: no environments were passed (tools.environment)")
    out = []
    for env in environments:
        if not callable(getattr(env, "get_reward", None)):
            raise RewardFunctionError(
                f"environment: {type(env).__name__} has no get_reward() method to score itself"
            )
        value = float(env.get_reward())
        if not math.isfinite(value):
            name = type(env).__name__
            raise RewardFunctionError(f"environment: {name}.get_reward() gave {value}")
        out.append(value)
    return out
