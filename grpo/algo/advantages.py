"""Group-relative advantages (docs/ALGORITHM.md, "Advantages").

Outcome supervision gives one advantage per completion, [N]; process supervision gives one per
completion token, [N, T]. N = prompts x group_size with the G completions of a prompt contiguous.
The outcome estimators are registered by name in ADVANTAGE_ESTIMATORS; that dict (plus
"process") is the list of `grpo.advantage_mode` values the config accepts.

Departures from textbook GRPO, on purpose:
- std is the population std (divide by G), as in the paper's worked example; TRL uses G - 1.
- a group whose rewards are all equal gets exact zeros (not (r - mean) / eps, which turns float
  round-off into a huge advantage), so such groups carry no signal and never NaN.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

# rewards grouped [P, G], eps -> advantages [P, G]
Estimator = Callable[[torch.Tensor, float], torch.Tensor]
ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {}
PROCESS = "process"  # per-token advantages from step rewards: process_advantages
PROCESS_REDUCTIONS = ("sum", "mean")  # how a token combines the steps ending at or after it


def advantage_estimator(name: str) -> Callable[[Estimator], Estimator]:
    """Register an outcome advantage estimator under `name` (a `grpo.advantage_mode` value)."""

    def register(fn: Estimator) -> Estimator:
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return register


def advantage_modes() -> tuple[str, ...]:
    """Every value `grpo.advantage_mode` accepts."""
    return (*ADVANTAGE_ESTIMATORS, PROCESS)


STD_EPS = 1e-4  # added to the std before dividing; a constant of the method, not a setting


@advantage_estimator("zscore")
def _zscore(r: torch.Tensor, eps: float) -> torch.Tensor:
    """(r - mean) / (std + eps), the GRPO paper's form."""
    mean = r.mean(dim=1, keepdim=True)  # [P, 1]
    std = r.std(dim=1, unbiased=False, keepdim=True)  # [P, 1]
    return (r - mean) / (std + eps)


@advantage_estimator("center")
def _center(r: torch.Tensor, eps: float) -> torch.Tensor:
    """r - mean (Dr. GRPO): no division by a small std, so no difficulty bias."""
    return r - r.mean(dim=1, keepdim=True)


@advantage_estimator("batch_std")
def _batch_std(r: torch.Tensor, eps: float) -> torch.Tensor:
    """(r - group mean) / (std of all rewards of the batch + eps): TRL's scale_rewards="batch"
    (the batch is this rank's; a batch of equal rewards gives zeros)."""
    return (r - r.mean(dim=1, keepdim=True)) / (r.std(unbiased=False) + eps)


@advantage_estimator("loo")
def _leave_one_out(r: torch.Tensor, eps: float) -> torch.Tensor:
    """r_i - mean of the other G - 1 rewards (RLOO)."""
    g = r.shape[1]
    if g < 2:
        raise ValueError("group_size: leave-one-out needs at least 2 completions per group")
    return r - (r.sum(dim=1, keepdim=True) - r) / (g - 1)


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards: expected a 1-D tensor [N], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"group_size: {group_size} does not divide the number of rewards {rewards.numel()}"
        )
    return rewards.float().view(-1, group_size)  # [P, G]


def group_advantages(
    rewards: torch.Tensor, group_size: int, mode: str = "zscore", eps: float = STD_EPS
) -> torch.Tensor:
    """Advantage of each completion relative to its own group: rewards [N] -> advantages [N].

    mode: a name in ADVANTAGE_ESTIMATORS (zscore, center, loo).

    >>> group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), 4, "center")
    tensor([ 0.5000, -0.5000,  0.5000, -0.5000])
    """
    if mode not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"mode: unknown advantage mode {mode!r}, expected one of {tuple(ADVANTAGE_ESTIMATORS)}"
        )
    r = _grouped(rewards, group_size)  # [P, G]
    adv = ADVANTAGE_ESTIMATORS[mode](r, eps)
    flat = r.max(dim=1, keepdim=True).values == r.min(dim=1, keepdim=True).values  # [P, 1]
    return adv.masked_fill(flat, 0.0).view(-1)


def zero_std_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Boolean [P]: True where every reward of the group is equal (no learning signal)."""
    r = _grouped(rewards, group_size)
    return r.max(dim=1).values == r.min(dim=1).values


def process_flat_groups(step_rewards: Sequence[Sequence[float]], group_size: int) -> torch.Tensor:
    """Boolean [P]: True where a group's step rewards are all equal (or it has no steps), so
    process_advantages gives all its tokens 0.

    >>> process_flat_groups([[1.0, 0.0], [1.0], [1.0], []], 2)
    tensor([False,  True])
    """
    n = len(step_rewards)
    if group_size < 1 or n % group_size != 0:
        raise ValueError(f"group_size: {group_size} does not divide {n} completions")
    flat = []
    for g0 in range(0, n, group_size):
        pooled = [r for i in range(g0, g0 + group_size) for r in step_rewards[i]]
        flat.append(all(r == pooled[0] for r in pooled))
    return torch.tensor(flat, dtype=torch.bool)


def process_advantages(
    step_rewards: Sequence[Sequence[float]],
    step_ends: Sequence[Sequence[int]],
    group_size: int,
    num_tokens: int,
    eps: float = STD_EPS,
    reduce: str = "sum",
) -> torch.Tensor:
    """Per-token advantages from per-step rewards (DeepSeekMath 4.1.3 process supervision).

    step_rewards[i][j]: reward of step j of completion i; step_ends[i][j]: 0-based token index in
    the completion where that step ends. The rewards of all steps of a group are normalised
    together (population std). reduce "sum" (DeepSeekMath): A[i, t] = sum of the normalised
    rewards of i's steps ending at or after t; "mean": their mean, so that an early token's
    advantage has the scale of one step's (the sum grows with the steps left). Tokens after i's
    last step end get 0. Returns [N, num_tokens].
    """
    if reduce not in PROCESS_REDUCTIONS:
        raise ValueError(f"reduce: expected one of {PROCESS_REDUCTIONS}, got {reduce!r}")
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
            count = torch.zeros(num_tokens)
            for r, end in zip(step_rewards[i], step_ends[i]):
                # a step ending at `end` credits every token up to and including `end`
                adv[i, : end + 1] += (r - mean) / (std + eps)
                count[: end + 1] += 1
            if reduce == "mean":
                adv[i] /= count.clamp(min=1.0)
    return adv
