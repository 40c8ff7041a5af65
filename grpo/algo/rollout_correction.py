"""The sampler-trainer mismatch, measured, and corrected by importance sampling.

The completions are drawn by the sampler, mu (its own kernels, its dtype, or an older copy of
the weights), while the loss is written for pi_old, the trainer's policy at the weights that
sampled. Where they differ, the policy gradient estimated from mu's samples is biased; the
importance weight w = pi_old / mu per token corrects it (TRL's
vllm_importance_sampling_correction, verl's rollout_is, OpenRLHF's tis/icepop). A weight far
from 1 has a large variance, so it is truncated at a threshold (TIS: min(w, C)) or the token
(or sequence) is masked out (MIS/IcePop: w > C contributes nothing).

Sequence level uses the geometric mean of the token weights: exp of the mean per-token
log-ratio. The product (exp of the summed log-ratio) is the exact sequence likelihood ratio,
but its log grows with the length: a mismatch of 0.001 nats a token is a weight of e^0.5 over
500 tokens, and a slightly negative mean mismatch drives long sequences' weights to 0 (the
shrinking sequence weights TRL users reported). The mean is the same for a sequence of any
length with the same per-token mismatch, as GSPO's sequence ratio is.

Dimension letters: N completions, T completion tokens.
"""

from __future__ import annotations

import math

import torch

CORRECTION_LEVELS = ("token", "sequence")
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


def correction_weights(
    old_logps: torch.Tensor,
    sampler_logps: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    threshold: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance weights [N, T] (0 at masked tokens) and which tokens were truncated or masked.

    Args:
        old_logps: log pi_old of the sampled tokens [N, T], the trainer's forward at the
            weights that sampled.
        sampler_logps: log mu of the same tokens [N, T], as the sampler drew them.
        mask: the tokens of the loss [N, T].
        level: "token" (a weight per token) or "sequence" (each sequence's geometric-mean
            weight on all its tokens).
        mode: "truncate" (min(w, threshold)) or "mask" (w above threshold -> 0).
        threshold: C, the largest weight kept.

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
    log_w = log_weights(old_logps, sampler_logps)
    if level == "sequence":
        log_w = sequence_log_weights(log_w, mask).expand_as(log_w)
    m = mask.bool()
    cap = math.log(threshold)
    over = (log_w > cap) & m
    if mode == "truncate":
        w = torch.exp(log_w.clamp(max=cap))
    else:
        # the exponent is capped as well, so a masked weight never overflows to inf * 0 = nan
        w = torch.exp(log_w.clamp(max=cap)).masked_fill(over, 0.0)
    return w * m.to(w.dtype), over


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
