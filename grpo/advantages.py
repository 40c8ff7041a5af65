"""Group-relative advantages (GRPO.md section 2).

Outcome supervision gives one advantage per completion, [N]; process supervision gives one per
completion token, [N, T]. N = prompts x group_size with the G completions of a prompt contiguous.

Departures from textbook GRPO, on purpose:
- std is the population std (divide by G), as in the paper's worked example; TRL uses G - 1.
- a group whose rewards are all equal gets exact zeros (not (r - mean) / eps, which turns float
  round-off into a huge advantage), so such groups carry no signal and never NaN.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

ADVANTAGE_MODES = ("zscore", "center", "loo")


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards: expected a 1-D tensor [N], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"group_size: {group_size} does not divide the number of rewards {rewards.numel()}"
        )
    return rewards.float().view(-1, group_size)  # [P, G]


def group_advantages(
    rewards: torch.Tensor, group_size: int, mode: str = "zscore", eps: float = 1e-4
) -> torch.Tensor:
    """Advantage of each completion relative to its own group.

    rewards: [N] -> advantages: [N].
    zscore: (r - mean) / (std + eps); center (Dr. GRPO): r - mean;
    loo (RLOO): r_i - mean of the other G - 1 rewards.

    >>> group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), 4, eps=0.0)
    tensor([ 1., -1.,  1., -1.])
    """
    r = _grouped(rewards, group_size)  # [P, G]
    mean = r.mean(dim=1, keepdim=True)  # [P, 1]
    if mode == "zscore":
        std = r.std(dim=1, unbiased=False, keepdim=True)  # [P, 1]
        adv = (r - mean) / (std + eps)
    elif mode == "center":
        adv = r - mean
    elif mode == "loo":
        if group_size < 2:
            raise ValueError("group_size: leave-one-out needs at least 2 completions per group")
        others_mean = (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)  # [P, G]
        adv = r - others_mean
    else:
        raise ValueError(
            f"mode: unknown advantage mode {mode!r}, expected one of {ADVANTAGE_MODES}"
        )
    flat = r.max(dim=1, keepdim=True).values == r.min(dim=1, keepdim=True).values  # [P, 1]
    return adv.masked_fill(flat, 0.0).view(-1)


def zero_std_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Boolean [P]: True where every reward of the group is equal (no learning signal)."""
    r = _grouped(rewards, group_size)
    return r.max(dim=1).values == r.min(dim=1).values


def process_advantages(
    step_rewards: Sequence[Sequence[float]],
    step_ends: Sequence[Sequence[int]],
    group_size: int,
    num_tokens: int,
    eps: float = 1e-4,
) -> torch.Tensor:
    """Per-token advantages from per-step rewards (DeepSeekMath 4.1.3 process supervision).

    step_rewards[i][j]: reward of step j of completion i; step_ends[i][j]: 0-based token index in
    the completion where that step ends. The rewards of all steps of a group are normalised
    together (population std); A[i, t] = sum of the normalised rewards of i's steps ending at or
    after t; tokens after i's last step end get 0. Returns [N, num_tokens].
    """
    n = len(step_rewards)
    if len(step_ends) != n:
        raise ValueError(f"step_ends: {len(step_ends)} completions but step_rewards has {n}")
    if group_size < 1 or n % group_size != 0:
        raise ValueError(f"group_size: {group_size} does not divide {n} completions")
    adv = torch.zeros(n, num_tokens)
    for i in range(n):
        if len(step_rewards[i]) != len(step_ends[i]):
            raise ValueError(
                f"step_ends[{i}]: {len(step_ends[i])} ends for {len(step_rewards[i])} step rewards"
            )
        for end in step_ends[i]:
            if not 0 <= end < num_tokens:
                raise ValueError(f"step_ends[{i}]: end {end} outside [0, {num_tokens})")
    for g0 in range(0, n, group_size):
        pooled = torch.tensor(
            [r for i in range(g0, g0 + group_size) for r in step_rewards[i]], dtype=torch.float32
        )
        if pooled.numel() == 0 or bool((pooled == pooled[0]).all()):
            continue  # no steps, or all equal: zero advantage for the whole group
        mean, std = pooled.mean(), pooled.std(unbiased=False)
        for i in range(g0, g0 + group_size):
            for r, end in zip(step_rewards[i], step_ends[i]):
                # a step ending at `end` credits every token up to and including `end`
                adv[i, : end + 1] += (r - mean) / (std + eps)
    return adv
