"""The clipped GRPO surrogate with k3 KL and its loss aggregations (docs/ALGORITHM.md, "Loss").

policy_loss builds a per-token loss matrix [N, T] and then aggregates it; aggregation is its own
step (`aggregate`) because it alone decides the length bias and whether micro-batching changes
the gradient. The aggregations are registered by name in LOSS_AGGREGATIONS, which is the list of
`grpo.loss_type` values the config accepts. All inputs are tensors and plain scalars: no config
objects, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# (per_token [N, T], mask [N, T] as float, max_completion_length, num_items) -> scalar
Aggregation = Callable[..., torch.Tensor]
LOSS_AGGREGATIONS: dict[str, Aggregation] = {}
IMPORTANCE_LEVELS = ("token", "sequence")
# bounds that keep exp() and k3 finite when pi_theta and pi_old (or pi_ref) drift far apart, as
# verl does; the share of tokens that hit them is logged (clamp/log_ratio_frac, clamp/k3_frac)
LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0


def loss_aggregation(name: str) -> Callable[[Aggregation], Aggregation]:
    """Register a loss aggregation under `name` (a `grpo.loss_type` value)."""

    def register(fn: Aggregation) -> Aggregation:
        LOSS_AGGREGATIONS[name] = fn
        return fn

    return register


@loss_aggregation("grpo")
def _per_sequence_mean(
    per_token: torch.Tensor, m: torch.Tensor, max_len: int | None, num_items: float | None
) -> torch.Tensor:
    """Mean over sequences of each sequence's token mean: the paper's 1/G sum 1/|o_i| sum_t."""
    return ((per_token * m).sum(1) / m.sum(1).clamp(min=1.0)).mean()


@loss_aggregation("bnpo")
def _batch_token_mean(
    per_token: torch.Tensor, m: torch.Tensor, max_len: int | None, num_items: float | None
) -> torch.Tensor:
    """Token sum / token count of this (micro-)batch."""
    return (per_token * m).sum() / m.sum().clamp(min=1.0)


@loss_aggregation("dr_grpo")
def _fixed_length(
    per_token: torch.Tensor, m: torch.Tensor, max_len: int | None, num_items: float | None
) -> torch.Tensor:
    """Token sum / (N * max_completion_length): no length normalisation at all (Dr. GRPO)."""
    if max_len is None:
        raise ValueError("max_completion_length: required for loss_type 'dr_grpo'")
    return (per_token * m).sum() / (per_token.shape[0] * max_len)


@loss_aggregation("dapo")
def _global_token_mean(
    per_token: torch.Tensor, m: torch.Tensor, max_len: int | None, num_items: float | None
) -> torch.Tensor:
    """Token sum / num_items, the active tokens of the global batch (None: of this batch), so
    that micro-batching and ranks do not change the gradient."""
    denom = m.sum().item() if num_items is None else float(num_items)
    return (per_token * m).sum() / max(denom, 1.0)


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi_theta || pi_ref): exp(d) - d - 1, d = ref - logp; >= 0.

    d is clamped to +-LOG_RATIO_CLAMP and the estimate to K3_CLAMP, so that one token far from
    the reference cannot make the loss infinite (a clamped token passes no gradient).
    """
    delta = torch.clamp(ref_logps - logps, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.clamp(torch.exp(delta) - delta - 1.0, max=K3_CLAMP)


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    max_completion_length: int | None = None,
    num_items: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss matrix [N, T] to a scalar with the aggregation `loss_type`.

    grpo: mean over sequences of (masked token sum / max(tokens, 1));
    bnpo: masked sum / max(masked count, 1); dr_grpo: masked sum / (N * max_completion_length);
    dapo: masked sum / num_items, num_items = active tokens of the global batch (None: local).
    """
    if loss_type not in LOSS_AGGREGATIONS:
        raise ValueError(
            f"loss_type: unknown {loss_type!r}, expected one of {tuple(LOSS_AGGREGATIONS)}"
        )
    m = mask.to(per_token.dtype)
    return LOSS_AGGREGATIONS[loss_type](per_token, m, max_completion_length, num_items)


def _check_shapes(**tensors: torch.Tensor | None) -> None:
    ref_shape = tensors["logps"].shape
    if len(ref_shape) != 2:
        raise ValueError(f"logps: expected [N, T], got shape {tuple(ref_shape)}")
    for name, t in tensors.items():
        if t is None:
            continue
        ok = t.shape == ref_shape or (name == "advantages" and t.shape == ref_shape[:1])
        if not ok:
            raise ValueError(
                f"{name}: shape {tuple(t.shape)} does not match logps {tuple(ref_shape)}"
            )


def policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ref_logps: torch.Tensor | None = None,
    loss_type: str = "dapo",
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    beta: float = 0.0,
    importance_level: str = "token",
    max_completion_length: int | None = None,
    num_items: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate loss (to minimise) and its metrics.

    logps, old_logps, ref_logps, mask: [N, T]; advantages: [N] or [N, T].
    per token: -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) + beta k3.
    With mu = 1 and fresh rollouts old_logps == logps.detach(): rho = 1 and the loss value is ~0
    while its gradient is the policy gradient (docs/ALGORITHM.md, "Loss").
    Defaults are the config's (GRPOConfig): clip-higher 0.2 / 0.28, dapo, no KL.
    """
    if loss_type not in LOSS_AGGREGATIONS:
        raise ValueError(
            f"loss_type: unknown {loss_type!r}, expected one of {tuple(LOSS_AGGREGATIONS)}"
        )
    if importance_level not in IMPORTANCE_LEVELS:
        raise ValueError(
            f"importance_level: unknown {importance_level!r}, expected one of {IMPORTANCE_LEVELS}"
        )
    _check_shapes(
        logps=logps, old_logps=old_logps, advantages=advantages, mask=mask, ref_logps=ref_logps
    )
    m = mask.to(logps.dtype)  # [N, T]
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # [N, 1] or [N, T]

    log_ratio = logps - old_logps  # [N, T]
    if importance_level == "sequence":
        # GSPO: one ratio per sequence, the geometric mean of its token ratios; every token of
        # the sequence carries it, so aggregation "grpo" weights sequences equally (the paper)
        # and the token-weighted ones weight them by length (docs/ALGORITHM.md)
        seq = (log_ratio * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1.0)
        log_ratio = seq.expand_as(logps)  # [N, T]
    clamped_lr = (log_ratio.detach().abs() > LOG_RATIO_CLAMP).to(m.dtype)
    ratio = torch.exp(torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    per_token = -torch.min(ratio * adv, clipped * adv)  # [N, T]

    metrics: dict[str, float] = {}
    if ref_logps is not None:
        kl = k3_kl(logps, ref_logps)
        if beta != 0.0:
            per_token = per_token + beta * kl
        metrics["kl"] = _masked_mean(kl.detach(), m)
        metrics["clamp/k3_frac"] = _masked_mean((kl.detach() >= K3_CLAMP).to(m.dtype), m)
    elif beta != 0.0:
        raise ValueError("ref_logps: required when beta != 0")

    loss = aggregate(per_token, mask, loss_type, max_completion_length, num_items)

    with torch.no_grad():
        adv_full = adv.expand_as(ratio)
        low = ((ratio < 1.0 - eps_low) & (adv_full < 0)).to(m.dtype)
        high = ((ratio > 1.0 + eps_high) & (adv_full > 0)).to(m.dtype)
        metrics["clip_ratio/low_mean"] = _masked_mean(low, m)
        metrics["clip_ratio/high_mean"] = _masked_mean(high, m)
        metrics["clip_ratio/region_mean"] = _masked_mean(low + high, m)
        metrics["ratio_mean"] = _masked_mean(ratio, m)
        metrics["clamp/log_ratio_frac"] = _masked_mean(clamped_lr, m)
        metrics["active_tokens"] = float(m.sum())
    return loss, metrics


def _masked_mean(x: torch.Tensor, m: torch.Tensor) -> float:
    return float((x * m).sum() / m.sum().clamp(min=1.0))
