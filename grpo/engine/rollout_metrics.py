"""Step 5, log: what the sampled batch looked like (rewards, lengths, truncation), over all ranks.

docs/ALGORITHM.md, "Metrics", says what each one means.
"""

from __future__ import annotations

import math

import torch

from grpo.algo.advantages import zero_std_groups
from grpo.engine.distributed import all_reduce_dict
from grpo.models.generate import Rollout


def rollout_metrics(
    ro: Rollout, rewards: torch.Tensor, per_fn: dict[str, list], device: torch.device
) -> dict[str, float]:
    """Reward mean/std (overall and per function), zero-std share, completion lengths."""
    G = ro.group_size
    lengths = ro.lengths.float()
    local = {
        "reward": float(rewards.sum()), "reward_sq": float((rewards**2).sum()),
        "n": float(rewards.numel()), "zero_std_groups": float(zero_std_groups(rewards, G).sum()),
        "groups": float(rewards.numel() // G), "length": float(lengths.sum()),
        "truncated": float(ro.truncated.sum()),
    }  # fmt: skip
    for name in per_fn:
        vals = [v for v in per_fn[name] if v is not None]  # None: not applicable, left out
        local |= {f"fn/{name}": sum(vals), f"fn/{name}/sq": sum(v * v for v in vals),
                  f"fn/{name}/n": len(vals)}  # fmt: skip
    tot = all_reduce_dict(local, device)
    extremes = all_reduce_dict({"neg_min": -float(lengths.min()), "max": float(lengths.max())},
                               device, "max")  # fmt: skip
    n = tot["n"]
    out = {
        "reward": tot["reward"] / n,
        "reward_std": math.sqrt(max(tot["reward_sq"] / n - (tot["reward"] / n) ** 2, 0.0)),
        "frac_reward_zero_std": tot["zero_std_groups"] / tot["groups"],
        "completions/mean_length": tot["length"] / n,
        "completions/clipped_ratio": tot["truncated"] / n,
        "completions/min_length": -extremes["neg_min"],
        "completions/max_length": extremes["max"],
    }
    for name in per_fn:
        s, s2, c = (tot[f"fn/{name}"], tot[f"fn/{name}/sq"], max(tot[f"fn/{name}/n"], 1))
        out[f"rewards/{name}/mean"] = s / c
        out[f"rewards/{name}/std"] = math.sqrt(max(s2 / c - (s / c) ** 2, 0))
    return out
