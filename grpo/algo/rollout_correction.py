"""The sampler-trainer mismatch, measured, and corrected by importance sampling.

The completions are drawn by the sampler, mu (its own kernels, its dtype, or an older copy of
the weights), while the loss is written for pi_old, the trainer's policy at the weights that
sampled. Where they differ, the policy gradient estimated from mu's samples is biased; the
importance weight w = pi_old / mu per token corrects it (TRL's
vllm_importance_sampling_correction, verl's rollout_is, OpenRLHF's tis/icepop). A weight far
from 1 has a large variance, so it is truncated at a threshold (TIS: min(w, C)) or the token
(or sequence) is masked out (MIS/IcePop: w > C contributes nothing).

Three levels. `token`: a weight per token. `sequence`: one weight per sequence, the product of
its token weights (exp of the summed log-ratio), the exact sequence likelihood ratio: TRL's
vllm_importance_sampling_mode sequence_* and verl's sequence level. `geometric`: the geometric
mean of the token weights (exp of the mean log-ratio). The product's log grows with the
length: a mismatch of 0.001 nats a token is a weight of e^0.5 over 500 tokens, so long
sequences are masked or truncated where short ones with the same per-token mismatch are not;
the geometric mean is the same for a sequence of any length with the same per-token mismatch,
as GSPO's sequence ratio is. It is our own level, not TRL's.

The bounds are TRL's: an upper C_max (vllm_importance_sampling_clip_max) and an optional lower
C_min (vllm_importance_sampling_clip_min); truncate clamps the weight into [C_min, C_max], mask
zeroes a token (or a sequence) whose weight lies outside it.

Dimension letters: N completions, T completion tokens.
"""

from __future__ import annotations

import math

import torch

CORRECTION_LEVELS = ("token", "sequence", "geometric")
CORRECTION_MODES = ("truncate", "mask")


def log_weights(old_logps: torch.Tensor, sampler_logps: torch.Tensor) -> torch.Tensor:
    """log pi_old - log mu per token [N, T], no gradient: the weight corrects, it is not
    learned through."""
    return (old_logps - sampler_logps).detach().float()


def sequence_log_weights(log_w: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean per-token log-ratio of each sequence [N, 1] (0 for a sequence with no tokens).

    >>> sequence_log_weights(torch.tensor([[0.1, 0.3, 9.0]]), torch.tensor([[1, 1, 0]]))
    tensor([[0.2000]])
    """
    m = mask.to(log_w.dtype)
    return (log_w * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1.0)


def sequence_sum_log_weights(log_w: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The summed log-ratio of each sequence [N, 1]: the log of the product of its token
    weights, the sequence likelihood ratio.

    >>> sequence_sum_log_weights(torch.tensor([[0.1, 0.3, 9.0]]), torch.tensor([[1, 1, 0]]))
    tensor([[0.4000]])
    """
    return (log_w * mask.to(log_w.dtype)).sum(1, keepdim=True)


def level_log_weights(log_w: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """The log-weight each token carries at a level [N, T]: its own (token), its sequence's
    summed log-ratio (sequence), or its sequence's mean log-ratio (geometric)."""
    if level == "sequence":
        return sequence_sum_log_weights(log_w, mask).expand_as(log_w)
    if level == "geometric":
        return sequence_log_weights(log_w, mask).expand_as(log_w)
    return log_w


def correction_weights(
    old_logps: torch.Tensor,
    sampler_logps: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    threshold: float = 2.0,
    min_threshold: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance weights [N, T] (0 at masked tokens) and which tokens were truncated or masked
    (their weight outside [min_threshold, threshold]).

    Args:
        old_logps: log pi_old of the sampled tokens [N, T], the trainer's forward at the
            weights that sampled.
        sampler_logps: log mu of the same tokens [N, T], as the sampler drew them.
        mask: the tokens of the loss [N, T].
        level: "token" (a weight per token), "sequence" (the product of the sequence's token
            weights on all its tokens) or "geometric" (their geometric mean).
        mode: "truncate" (w clamped into [min_threshold, threshold]) or "mask" (w outside it
            -> 0).
        threshold: C_max, the largest weight kept.
        min_threshold: C_min, the smallest weight kept (None: no lower bound).

    >>> w, hit = correction_weights(torch.tensor([[0.0, 2.0]]), torch.zeros(1, 2),
    ...                             torch.ones(1, 2), threshold=2.0)
    >>> w, hit
    (tensor([[1., 2.]]), tensor([[False,  True]]))
    """
    if level not in CORRECTION_LEVELS:
        raise ValueError(f"level: expected one of {CORRECTION_LEVELS}, got {level!r}")
    if mode not in CORRECTION_MODES:
        raise ValueError(f"mode: expected one of {CORRECTION_MODES}, got {mode!r}")
    if not threshold > 0:
        raise ValueError(f"threshold: must be > 0, got {threshold}")
    if min_threshold is not None and not 0 < min_threshold < threshold:
        raise ValueError(f"min_threshold: must be in (0, threshold), got {min_threshold}")
    log_w = level_log_weights(log_weights(old_logps, sampler_logps), mask, level)
    m = mask.bool()
    cap = math.log(threshold)
    floor = math.log(min_threshold) if min_threshold is not None else -math.inf
    outside = ((log_w > cap) | (log_w < floor)) & m
    # the exponent is clamped either way, so a masked weight never overflows to inf * 0 = nan
    w = torch.exp(log_w.clamp(min=floor, max=cap))
    if mode == "mask":
        w = w.masked_fill(outside, 0.0)
    return w * m.to(w.dtype), outside


def mismatch_metrics(
    old_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """How far the sampler is from pi_old on the tokens it drew, as sums over tokens (divide
    by "tokens"): KL(mu || pi_old) estimated on mu's samples by k1 = log mu - log pi (unbiased,
    either sign per token) and k3 = (r - 1) - log r with r = pi / mu (unbiased, never negative).

    >>> m = mismatch_metrics(torch.tensor([[math.log(0.5)]]), torch.tensor([[0.0]]),
    ...                      torch.ones(1, 1))
    >>> round(m["kl_k1"], 4), round(m["kl_k3"], 4), m["tokens"]
    (0.6931, 0.1931, 1.0)
    """
    log_r = log_weights(old_logps, sampler_logps)
    m = mask.to(log_r.dtype)
    k3 = torch.expm1(log_r) - log_r
    return {
        "kl_k1": float((-log_r * m).sum()),
        "kl_k3": float((k3 * m).sum()),
        "tokens": float(m.sum()),
    }


def ratio_stats(weights: torch.Tensor, mask: torch.Tensor, level: str) -> dict[str, float]:
    """The applied weights as TRL summarises them (sampling/importance_sampling_ratio/*): over
    the loss's tokens at token level, over sequences (one weight each) at the sequence levels;
    "n" elements, their "sum", "min" and "max" (n = 0: sum 0, min +inf, max -inf).

    >>> w = torch.tensor([[2.0, 2.0, 0.0], [0.5, 0.0, 0.0]])
    >>> ratio_stats(w, torch.tensor([[1, 1, 0], [1, 0, 0]]), "sequence")
    {'n': 2.0, 'sum': 2.5, 'min': 0.5, 'max': 2.0}
    """
    m = mask.bool()
    if level == "token":
        vals = weights[m]
    else:
        rows = m.any(1)
        vals = weights[rows].gather(1, m[rows].float().argmax(1, keepdim=True)).squeeze(1)
    if vals.numel() == 0:
        return {"n": 0.0, "sum": 0.0, "min": math.inf, "max": -math.inf}
    return {"n": float(vals.numel()), "sum": float(vals.sum()), "min": float(vals.min()),
            "max": float(vals.max())}  # fmt: skip
