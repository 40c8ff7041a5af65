"""Step 5, log: what the sampled batch looked like (rewards, lengths, truncation), over all ranks.

docs/ALGORITHM.md, "Metrics", says what each one means.
"""

from __future__ import annotations

import math

import torch

from grpo.algo.advantages import zero_std_groups
from grpo.engine.distributed import all_reduce_sum
from grpo.models.generate import Rollout


def rollout_metrics(
    ro: Rollout, rewards: torch.Tensor, per_fn: dict[str, list], device: torch.device
) -> dict[str, float]:
    """Reward mean/std (overall and per function), zero-std share, completion lengths."""
    G = ro.group_size
    lengths = ro.lengths.float()
    fn_sums = []
    for name in per_fn:
        vals = [v for v in per_fn[name] if v is not None]
        fn_sums += [sum(vals), sum(v * v for v in vals), len(vals)]
    local = [
        float(rewards.sum()), float((rewards**2).sum()), float(rewards.numel()),
        float(zero_std_groups(rewards, G).sum()), float(rewards.numel() // G),
        float(lengths.sum()), float(ro.truncated.sum()),
    ] + fn_sums  # fmt: skip
    tot = all_reduce_sum(local, device)
    neg_min, mx = all_reduce_sum([-float(lengths.min()), float(lengths.max())], device, "max")
    n = tot[2]
    out = {
        "reward": tot[0] / n,
        "reward_std": math.sqrt(max(tot[1] / n - (tot[0] / n) ** 2, 0.0)),
        "frac_reward_zero_std": tot[3] / tot[4],
        "completions/mean_length": tot[5] / n,
        "completions/clipped_ratio": tot[6] / n,
        "completions/min_length": -neg_min,
        "completions/max_length": mx,
    }
    for j, name in enumerate(per_fn):
        s, s2, c = tot[7 + 3 * j : 10 + 3 * j]
        out[f"rewards/{name}/mean"] = s / max(c, 1)
        out[f"rewards/{name}/std"] = math.sqrt(max(s2 / max(c, 1) - (s / max(c, 1)) ** 2, 0))
    return out
