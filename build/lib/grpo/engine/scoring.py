"""Steps 2 and 3, score and advantages: reward functions over the completions, then one
advantage per completion token, [N, C], whichever the supervision (docs/ALGORITHM.md).

Outcome supervision broadcasts each completion's group-relative advantage over its tokens;
process supervision scores each reasoning step and credits the tokens up to where it ends.
"""

from __future__ import annotations

from typing import Any

import torch

from grpo.algo.advantages import PROCESS, group_advantages, process_advantages
from grpo.config import GRPOConfig
from grpo.models.generate import Rollout
from grpo.models.offsets import char_to_token, token_char_ends
from reward_fns import PROCESS_REWARDS, REWARD_FUNCS, resolve, score, with_time_limit

# the worked solution is SFT's data, never shown to GRPO's reward functions
HIDDEN_COLUMNS = ("solution",)


class RewardScorer:
    """The configured reward functions, weighted; user functions are bounded in time."""

    def __init__(self, g: GRPOConfig) -> None:
        self.weights = g.reward_weights
        self.funcs = {}
        for name in g.reward_funcs:
            fn = resolve(
                name, max_completion_length=g.max_completion_length, overlong_cache=g.overlong_cache
            )
            key = name.rpartition(":")[2]
            # built-in functions bound their own time (math-verify limits)
            self.funcs[key] = (
                fn if name in REWARD_FUNCS else with_time_limit(key, fn, g.reward_timeout_s)
            )

    def __call__(
        self, ro: Rollout, rows: list[dict], texts: list[str]
    ) -> tuple[torch.Tensor, dict[str, list]]:
        """Weighted reward per completion [N], and each function's raw scores."""
        G = ro.group_size
        columns: dict[str, list[Any]] = {
            k: [r.get(k) for r in rows for _ in range(G)]
            for k in rows[0]
            if k not in HIDDEN_COLUMNS
        }
        columns["completion_ids"] = [
            ids[: int(n)].tolist() for ids, n in zip(ro.completion_ids, ro.lengths)
        ]
        rewards, per_fn = score(self.funcs, self.weights, texts, columns)
        return torch.tensor(rewards, dtype=torch.float32), per_fn


def token_advantages(
    g: GRPOConfig, ro: Rollout, rewards: torch.Tensor, rows: list[dict], texts: list[str], tok: Any
) -> torch.Tensor:
    """Advantages [N, C]: outcome ones broadcast over tokens, or process-supervised ones."""
    n, c = ro.completion_ids.shape
    if g.advantage_mode != PROCESS:
        adv = group_advantages(rewards, ro.group_size, g.advantage_mode)  # [N]
        return adv.unsqueeze(1).expand(n, c)
    steps = PROCESS_REWARDS[g.process_reward](texts, answer=[r["answer"] for r in rows])
    step_rewards = [r for r, _ in steps]
    step_ends = [
        step_token_ends(tok, ro.completion_ids[i], int(ro.lengths[i]), char_ends)
        for i, (_, char_ends) in enumerate(steps)
    ]
    return process_advantages(step_rewards, step_ends, ro.group_size, c)


def step_token_ends(tok: Any, ids: torch.Tensor, length: int, char_ends: list[int]) -> list[int]:
    """The token index at which each step's last character is complete.

    ids: [C] one completion; length: its real tokens (EOS included).
    """
    ends = token_char_ends(tok, ids[:length].tolist())
    return [max(char_to_token(ends, e), 0) for e in char_ends]
