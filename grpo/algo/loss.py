"""The GRPO policy loss: a per-token surrogate, k3 KL and an entropy bonus, then an aggregation
(docs/ALGORITHM.md, "Loss").

policy_loss builds a per-token loss matrix [N, T] and then aggregates it. Two registries name
the choices: POLICY_OBJECTIVES (`grpo.policy_objective`: how the importance ratio rho and the
advantage make a token's loss: PPO's clip, CISPO, SAPO) and LOSS_AGGREGATIONS (`grpo.loss_type`:
how token losses become one number, which alone decides the length bias and how micro-batches
and ranks combine). Each aggregation declares that last property itself (LossAggregation), so
the update step never asks for a loss type by name. All inputs are tensors and plain scalars:
no config objects, no I/O. Dimension letters: N completions (rows), T completion tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# (per_token [N, T], mask [N, T] as float, max_completion_length, num_items) -> scalar
AggregationFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class LossAggregation:
    """A `grpo.loss_type`: its reduction, and how partial batches combine.

    global_normaliser: the reduction divides by num_items, the active tokens of the whole
    global batch, so the losses of micro-batches and ranks add up to the batch's loss, and a row
    whose token losses are all 0 may be left out without changing anything. Otherwise the
    reduction is a mean over the rows it is given: the update weights each micro-batch by its
    share of the rows, and every row is trained.
    """

    fn: AggregationFn
    global_normaliser: bool = False


LOSS_AGGREGATIONS: dict[str, LossAggregation] = {}
# (ratio [N, T], logps [N, T], adv [N, 1] or [N, T], params) -> per-token loss [N, T]
ObjectiveFn = Callable[..., torch.Tensor]
POLICY_OBJECTIVES: dict[str, ObjectiveFn] = {}
IMPORTANCE_LEVELS = ("token", "sequence")
# bounds that keep exp() and k3 finite when pi_theta and pi_old (or pi_ref) drift far apart, as
# verl does; the share of tokens that hit them is logged (clamp/log_ratio_frac, clamp/k3_frac)
LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0


def loss_aggregation(
    name: str, *, global_normaliser: bool = False
) -> Callable[[AggregationFn], AggregationFn]:
    """Register a loss aggregation under `name` (a `grpo.loss_type` value)."""

    def register(fn: AggregationFn) -> AggregationFn:
        LOSS_AGGREGATIONS[name] = LossAggregation(fn, global_normaliser)
        return fn

    return register


def policy_objective(name: str) -> Callable[[ObjectiveFn], ObjectiveFn]:
    """Register a per-token surrogate under `name` (a `grpo.policy_objective` value)."""

    def register(fn: ObjectiveFn) -> ObjectiveFn:
        POLICY_OBJECTIVES[name] = fn
        return fn

    return register


@dataclass(frozen=True)
class ObjectiveParams:
    """The knobs of the surrogates (GRPOConfig's defaults)."""

    eps_low: float = 0.2  # clip: rho kept within [1 - eps_low, 1 + eps_high]
    eps_high: float = 0.28
    cispo_max_weight: float = 5.0  # cispo: the importance weight's cap (no lower bound)
    sapo_tau_pos: float = 1.0  # sapo: gate temperature for A > 0
    sapo_tau_neg: float = 1.05  # sapo: for A < 0 (steeper: negative updates fade sooner)


@policy_objective("clip")
def _ppo_clip(
    ratio: torch.Tensor, logps: torch.Tensor, adv: torch.Tensor, p: ObjectiveParams
) -> torch.Tensor:
    """PPO's pessimistic clip: -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)."""
    clipped = torch.clamp(ratio, 1.0 - p.eps_low, 1.0 + p.eps_high)
    return -torch.min(ratio * adv, clipped * adv)


@policy_objective("cispo")
def _clipped_is_weight(
    ratio: torch.Tensor, logps: torch.Tensor, adv: torch.Tensor, p: ObjectiveParams
) -> torch.Tensor:
    """CISPO (MiniMax-M1): -sg(min(rho, cispo_max_weight)) A log pi. The weight is clipped and
    detached instead of the update, so every token keeps a gradient (PPO's clip zeroes it)."""
    weight = torch.clamp(ratio, max=p.cispo_max_weight).detach()
    return -weight * adv * logps


@policy_objective("sapo")
def _soft_gate(
    ratio: torch.Tensor, logps: torch.Tensor, adv: torch.Tensor, p: ObjectiveParams
) -> torch.Tensor:
    """SAPO: -(4 / tau) sigmoid(tau (rho - 1)) A, tau = sapo_tau_pos where A > 0, else
    sapo_tau_neg. Its slope at rho = 1 is 1 (the policy gradient), falling smoothly off-policy
    instead of a hard cut."""
    tau = torch.where(adv > 0, p.sapo_tau_pos, p.sapo_tau_neg)
    return -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * adv


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


@loss_aggregation("dapo", global_normaliser=True)
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
    _check_name("loss_type", loss_type, LOSS_AGGREGATIONS)
    m = mask.to(per_token.dtype)
    return LOSS_AGGREGATIONS[loss_type].fn(per_token, m, max_completion_length, num_items)


def _check_name(field: str, value: str, registry: dict | tuple) -> None:
    if value not in registry:
        raise ValueError(f"{field}: unknown {value!r}, expected one of {tuple(registry)}")


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
    beta: float = 0.0,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    loss_type: str = "dapo",
    objective: str = "clip",
    params: ObjectiveParams = ObjectiveParams(),  # noqa: B008 (frozen: a safe default)
    importance_level: str = "token",
    max_completion_length: int | None = None,
    num_items: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy loss (to minimise) and its metrics.

    logps, old_logps, ref_logps, entropy, mask: [N, T]; advantages: [N] or [N, T].
    per token: surrogate(rho, A) + beta k3(pi_theta, pi_ref) - entropy_coef H(pi_theta), then the
    aggregation `loss_type`. The caller decides the extra terms once: the KL term is there
    exactly when ref_logps is given (GRPOConfig.uses_reference), the entropy bonus when entropy
    is given (entropy_coef > 0). With mu = 1, old_logps == logps.detach() and rho = 1: the
    gradient is the policy gradient, and the value is minus the aggregated advantage (plus the
    extra terms), which is 0 only when advantages and lengths are uncorrelated.
    Defaults are the config's (GRPOConfig): clip-higher 0.2 / 0.28, dapo, no KL, no bonus.
    is_weights [N, T]: the rollout correction's importance weights pi_old / mu
    (grpo.algo.rollout_correction), on the policy term only, as TRL and verl apply them: the
    KL term and the entropy bonus are about pi_theta itself, not about how the tokens were
    drawn.
    """
    _check_name("loss_type", loss_type, LOSS_AGGREGATIONS)
    _check_name("policy_objective", objective, POLICY_OBJECTIVES)
    _check_name("importance_level", importance_level, IMPORTANCE_LEVELS)
    if ref_logps is None and beta != 0.0:
        raise ValueError("ref_logps: required when beta != 0")
    _check_shapes(
        logps=logps, old_logps=old_logps, advantages=advantages, mask=mask, ref_logps=ref_logps,
        entropy=entropy, is_weights=is_weights,
    )  # fmt: skip
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
    per_token = POLICY_OBJECTIVES[objective](ratio, logps, adv, params)  # [N, T]
    if is_weights is not None:
        per_token = per_token * is_weights.detach()

    metrics: dict[str, float] = {}
    if ref_logps is not None:
        kl = k3_kl(logps, ref_logps)
        per_token = per_token + beta * kl
        metrics["kl"] = _masked_mean(kl.detach(), m)
        metrics["clamp/k3_frac"] = _masked_mean((kl.detach() >= K3_CLAMP).to(m.dtype), m)
    if entropy is not None:
        # aggregated with the rest of the loss, as verl does (TRL takes a plain token mean)
        per_token = per_token - entropy_coef * entropy

    loss = aggregate(per_token, mask, loss_type, max_completion_length, num_items)

    with torch.no_grad():
        # the clip's regions, also logged for the other objectives: how far off-policy it went
        adv_full = adv.expand_as(ratio)
        low = ((ratio < 1.0 - params.eps_low) & (adv_full < 0)).to(m.dtype)
        high = ((ratio > 1.0 + params.eps_high) & (adv_full > 0)).to(m.dtype)
        metrics["clip_ratio/low_mean"] = _masked_mean(low, m)
        metrics["clip_ratio/high_mean"] = _masked_mean(high, m)
        metrics["clip_ratio/region_mean"] = _masked_mean(low + high, m)
        metrics["ratio_mean"] = _masked_mean(ratio, m)
        metrics["clamp/log_ratio_frac"] = _masked_mean(clamped_lr, m)
        metrics["active_tokens"] = float(m.sum())
    return loss, metrics


def _masked_mean(x: torch.Tensor, m: torch.Tensor) -> float:
    return float((x * m).sum() / m.sum().clamp(min=1.0))
