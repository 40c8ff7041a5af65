"""The names a config may use for reward functions: one dict each, filled by decorators.

REWARD_FUNCS: name -> builder(**settings) -> reward function with TRL's signature
`fn(completions, **columns) -> list[float | None]`. Most builders return a plain function;
`soft_overlong` builds one from the GRPO settings (max_completion_length, overlong_cache).
PROCESS_REWARDS: name -> step-level reward function (reward_fns.process).
Config entries are these names, or import paths "package.module:function" (reward_fns.scoring).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

RewardFn = Callable[..., list]
RewardBuilder = Callable[..., RewardFn]
ProcessRewardFn = Callable[..., list[tuple[list[float], list[int]]]]

REWARD_FUNCS: dict[str, RewardBuilder] = {}
PROCESS_REWARDS: dict[str, ProcessRewardFn] = {}


class DuplicateRewardName(ValueError):
    """A second function registered under a name already taken: the first would be lost."""


def _claim(table: dict[str, Any], name: str, what: str) -> None:
    if name in table:
        raise DuplicateRewardName(
            f"{what} {name!r} is already registered ({table[name].__module__}); pick another name"
        )


def reward_function(name: str) -> Callable[[RewardFn], RewardFn]:
    """Register a plain reward function under `name`; a name already taken is refused.

    Args:
        name: the name a config's `grpo.reward_funcs` uses for it.
    """

    def register(fn: RewardFn) -> RewardFn:
        def build(**settings: Any) -> RewardFn:
            return fn

        _claim(REWARD_FUNCS, name, "reward function")
        build.__module__ = fn.__module__
        REWARD_FUNCS[name] = build
        return fn

    return register


def reward_builder(name: str) -> Callable[[RewardBuilder], RewardBuilder]:
    """Register a builder that makes a reward function from the GRPO settings; a name already
    taken is refused.

    Args:
        name: the name a config's `grpo.reward_funcs` uses for it.
    """

    def register(builder: RewardBuilder) -> RewardBuilder:
        _claim(REWARD_FUNCS, name, "reward function")
        REWARD_FUNCS[name] = builder
        return builder

    return register


def process_reward(name: str) -> Callable[[ProcessRewardFn], ProcessRewardFn]:
    """Register a step-level reward function under `name`; a name already taken is refused.

    Args:
        name: the name `grpo.process_reward` uses for it.
    """

    def register(fn: ProcessRewardFn) -> ProcessRewardFn:
        _claim(PROCESS_REWARDS, name, "process reward")
        PROCESS_REWARDS[name] = fn
        return fn

    return register
