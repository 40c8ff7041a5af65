"""Step 4, update: mu passes of policy-gradient steps over the rollout (one optimizer step per
pass), in micro-batches, through the DeepSpeed engine.

`update_policy` is a function of the engine, the settings and the rollout; what one pass learns
for the next (pi_old) and the log-prob gap it measures are values passed along, not state.
The bookkeeping here exists for DeepSpeed: every rank makes the same number of backward calls
per pass, whatever it skipped, because the accumulation boundary and ZeRO-2's gradient buckets
(filled in hook order) count on it. DeepSpeed also averages gradients over the micro-batches of
a pass and over ranks; `micro_weight` turns that average back into the loss the aggregation
defines. docs/ALGORITHM.md has the loss itself. Dimension letters: N completions, C completion
tokens (padded), P prompt tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from grpo.algo.loss import LOSS_AGGREGATIONS, policy_loss
from grpo.algo.rollout_correction import correction_weights, mismatch_metrics, ratio_stats
from grpo.config import GRPOConfig
from grpo.engine.distributed import all_reduce_dict
from grpo.models.forward import completion_logprobs
from grpo.models.generate import Rollout

# per-token metrics of policy_loss (plus entropy), token-weighted over the trained rows; "kl"
# joins them when a reference is loaded: a fixed list, so every rank all-reduces the same keys
# even when it skipped all its rows
POLICY_METRICS = (
    "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "ratio_mean",
    "entropy", "clamp/log_ratio_frac",
)  # fmt: skip
# with grpo.rollout_correction: the mean weight and the share of tokens over the threshold
CORRECTION_METRICS = ("rollout_correction/weight_mean", "rollout_correction/over_threshold_frac")


@dataclass(frozen=True)
class UpdatePlan:
    """How a rank's rollout splits for the update: n_micro micro-batches of at most micro
    rows each, on `world` ranks under ZeRO stage zero_stage; each micro-batch's forward in
    length buckets of bucket_tokens, its LM head within logits_budget_mib (Config.forward_layout).
    """

    micro: int
    n_micro: int
    world: int
    zero_stage: int
    device: torch.device
    bucket_tokens: int = 0
    logits_budget_mib: float = 0.0


@dataclass
class _Gap:
    """|trainer - sampler| log-prob over the first pass: sum, tokens, max; and the sums of
    KL(mu || pi) estimates on the sampled tokens (grpo.algo.rollout_correction)."""

    total: float = 0.0
    tokens: float = 0.0
    largest: float = 0.0
    kl_k1: float = 0.0
    kl_k3: float = 0.0
    # multi-turn: the gap of each model turn (sum, tokens), turns 1..TURN_METRICS
    by_turn: dict[int, list[float]] = field(default_factory=dict)
    # every token's gap, for the quantiles (a step's tokens: a few thousand floats)
    values: list[torch.Tensor] = field(default_factory=list)

    def add(
        self, trainer: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor,
        turn: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        """Sampler vs training-forward log-probs of the same tokens under the same weights: the
        rollout/trainer mismatch (numerics, kernels, dtype) that TRL and verl users watch; in
        episodes also per turn, where the mismatch grows with the context."""
        d = (trainer - sampler).abs() * mask
        self.total += float(d.sum())
        self.tokens += float(mask.sum())
        if turn is not None:
            for k in range(1, TURN_METRICS + 1):
                at = (turn == k).to(mask.dtype) * mask
                s = self.by_turn.setdefault(k, [0.0, 0.0])
                s[0] += float((d * at).sum())
                s[1] += float(at.sum())
        self.largest = max(self.largest, float(d.max()) if d.numel() else 0.0)
        self.values.append(d[mask.bool()].detach().float().cpu())
        kl = mismatch_metrics(trainer, sampler, mask)
        self.kl_k1 += kl["kl_k1"]
        self.kl_k3 += kl["kl_k3"]

    def quantiles(self) -> dict[str, float]:
        """The per-token gap's median, 90th and 99th percentiles on this rank's tokens."""
        d = torch.cat(self.values) if self.values else torch.zeros(1)
        q = torch.quantile(d, torch.tensor(GAP_QUANTILES)) if d.numel() else torch.zeros(3)
        return {f"p{round(x * 100)}": float(v) for x, v in zip(GAP_QUANTILES, q)}


TURN_METRICS = 8  # logprob_gap/turn_<k> for the first turns of multi-turn episodes
GAP_QUANTILES = (0.5, 0.9, 0.99)  # logprob_gap/p50, p90, p99


@dataclass
class _PassState:
    """What the micro-batches of the update share: pi_old's log-probs [N, C] and the gap."""

    old: torch.Tensor
    gap: _Gap = field(default_factory=_Gap)


def metric_keys(g: GRPOConfig) -> tuple[str, ...]:
    return (POLICY_METRICS + (("kl", "clamp/k3_frac") if g.uses_reference else ())
            + (CORRECTION_METRICS if g.rollout_correction else ())
            + (("truncation/outside_frac",) if g.scores_truncated else ()))  # fmt: skip


def loss_mask(ro: Rollout, mask_truncated: bool) -> torch.Tensor:
    """The tokens the loss counts [N, C]: the completion mask, and with mask_truncated (DAPO's
    overlong filtering, TRL's mask_truncated_completions) none of a completion that hit
    max_completion_length without EOS: its end is unknown, so its reward says little. In a
    multi-turn episode the tool responses are never counted (Rollout.trained_mask), and an
    episode ended by a limit is truncated."""
    mask = ro.trained_mask
    if not mask_truncated:
        return mask
    return mask * (~ro.truncated).unsqueeze(1).to(mask.dtype)


def trained_rows(g: GRPOConfig, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Local rows to run forward/backward on, from advantages and the loss mask [N, C].

    A completion whose advantage is zero at every token adds exactly zero to every objective's
    token loss (clip: -min(rho*0, clip(rho)*0); cispo: -w*0*log pi; sapo: -gate*0). When the
    aggregation's normaliser does not depend on which rows run (global_normaliser), and no KL
    term or entropy bonus acts on every row, skipping such rows is exact and saves the
    forward/backward of every group whose rewards were all equal.
    """
    n = adv.shape[0]
    exact = LOSS_AGGREGATIONS[g.loss_type].global_normaliser
    if not (g.skip_zero_advantage and exact and not g.uses_reference and not g.uses_entropy_bonus):
        return torch.arange(n)
    per_row = (adv.abs() * mask).sum(1)  # [N]; a masked-out (truncated) row adds nothing
    # != rather than >: a NaN advantage is kept, so its loss is seen as non-finite
    return (per_row != 0).nonzero().squeeze(1).cpu()


def micro_weight(g: GRPOConfig, plan: UpdatePlan, rows_in_micro: int, local_rows: int) -> float:
    """The factor on a micro-batch's loss that makes DeepSpeed's gradient the defined loss's.

    DeepSpeed divides each micro-batch's gradient by n_micro and averages ranks. With a global
    normaliser each micro-batch's loss is already its share of the global loss: undo both
    (world * n_micro). Otherwise the loss is a mean over the micro-batch's rows: weight it by its
    share of the rank's rows (n_micro * rows / local_rows), so that a short last micro-batch
    does not count its rows more (ranks hold equal rows, so their average is right).
    """
    if LOSS_AGGREGATIONS[g.loss_type].global_normaliser:
        return plan.world * plan.n_micro
    if rows_in_micro == 0:  # an empty micro-batch's loss is already multiplied by 0
        return 1.0
    return plan.n_micro * rows_in_micro / local_rows


def update_policy(
    engine: Any, g: GRPOConfig, plan: UpdatePlan, ro: Rollout, adv: torch.Tensor,
    ref_logps: torch.Tensor | None,
) -> dict[str, float]:  # fmt: skip
    """The update of one step: mu optimizer steps; returns its metrics, reduced over ranks.
    Entropy and clip metrics are over the completions trained on (see trained_rows)."""
    mask = loss_mask(ro, g.mask_truncated_completions)  # [N, C]
    if adv.shape != mask.shape:
        raise ValueError(f"adv: expected [N, C] {tuple(mask.shape)}, got {tuple(adv.shape)}")
    if mask.shape[0] > plan.n_micro * plan.micro:
        raise ValueError(
            f"rollout: {mask.shape[0]} local rows exceed {plan.n_micro} micro-batches of "
            f"{plan.micro}"
        )
    # the active tokens of the whole global batch (all ranks, all micro-batches)
    num_items = all_reduce_dict({"tokens": float(mask.sum())}, plan.device)["tokens"]
    rows = trained_rows(g, adv, mask)
    keys = metric_keys(g)
    sums: dict[str, float] = {"_w": 0.0, "loss": 0.0, "nonfinite_losses": 0.0}
    # the applied importance weights, as TRL summarises them (ratio_stats)
    ratio = {"n": 0.0, "sum": 0.0, "min": float("inf"), "max": float("-inf")}
    skipped = 0  # optimizer steps skipped for a non-finite loss (the same on every rank)
    grad_norms: list[float] = []
    # pi_old: the sampler's log-probs, replaced row by row by the first pass's own forward
    # (the parameters do not change within a pass) when old_logprobs is recompute
    state = _PassState(ro.sampling_logps.clone() if g.mu > 1 else ro.sampling_logps)
    for pass_ in range(g.mu):
        bad_in_pass = 0
        for j in range(plan.n_micro):
            idx = rows[j * plan.micro : (j + 1) * plan.micro]
            weight = micro_weight(g, plan, idx.numel(), mask.shape[0])
            if idx.numel():
                loss, m = _micro_loss(engine, g, plan, ro, mask, adv, ref_logps, idx, num_items,
                                      state, first_pass=pass_ == 0)  # fmt: skip
            else:
                loss = _zero_gradient_loss(engine, g, plan, ro, mask, adv, ref_logps, num_items)
                m = {}
            if not torch.isfinite(loss):
                sums["nonfinite_losses"] += 1
                bad_in_pass += 1
                loss = _zero_gradient_loss(engine, g, plan, ro, mask, adv, ref_logps, num_items)
            boundary = j == plan.n_micro - 1
            skip = boundary and _any_rank_nonfinite(g, plan, bad_in_pass)
            # a skipped step's gradient is made non-finite on every rank: DeepSpeed's own
            # overflow check (ZeRO 1-3, bf16, fp16) then drops it, as a loss scaler does
            engine.backward(loss * weight * (float("nan") if skip else 1.0))
            if boundary and plan.zero_stage == 0:
                grad_norms.append(_local_grad_norm(engine))
            if skip:
                _skip_step(engine)
                skipped += 1
            else:
                engine.step()
            w = m.pop("_w", 0.0)
            if (r := m.pop("_ratio", None)) is not None:
                ratio = {"n": ratio["n"] + r["n"], "sum": ratio["sum"] + r["sum"],
                         "min": min(ratio["min"], r["min"]),
                         "max": max(ratio["max"], r["max"])}  # fmt: skip
            for k in keys:
                sums[k] = sums.get(k, 0.0) + m.get(k, 0.0) * w
            sums["_w"] += w
            sums["loss"] += float(loss.detach()) * weight / plan.n_micro / g.mu
    gap = state.gap
    turns = {f"_turn{k}/{i}": v[i] for k, v in gap.by_turn.items() for i in (0, 1)}
    tot = all_reduce_dict(
        {**{k: sums.get(k, 0.0) for k in keys}, "_w": sums["_w"], "loss": sums["loss"],
         "nonfinite_losses": sums["nonfinite_losses"], "_gap": gap.total,
         "_gap_tokens": gap.tokens, "_kl_k1": gap.kl_k1, "_kl_k3": gap.kl_k3, **turns},
        plan.device,
    )  # fmt: skip
    turn_gaps = {f"logprob_gap/turn_{k}": tot[f"_turn{k}/0"] / tot[f"_turn{k}/1"]
                 for k in gap.by_turn if tot[f"_turn{k}/1"] > 0}  # fmt: skip
    out = {k: tot[k] / max(tot["_w"], 1.0) for k in keys}
    out["loss"] = tot["loss"] / plan.world
    out["nonfinite_losses"] = tot["nonfinite_losses"]
    out["optimizer_steps_skipped"] = float(skipped)
    # ZeRO 1-3 report the global norm; stage 0 does not, and its grads are whole on each rank
    gn = engine.get_global_grad_norm()
    out["grad_norm"] = float(gn) if gn is not None else float(grad_norms[-1])
    out["logprob_gap/mean"] = tot["_gap"] / max(tot["_gap_tokens"], 1.0)
    out |= turn_gaps
    out["mismatch/kl_k1"] = tot["_kl_k1"] / max(tot["_gap_tokens"], 1.0)
    out["mismatch/kl_k3"] = tot["_kl_k3"] / max(tot["_gap_tokens"], 1.0)
    out["logprob_gap/max"] = all_reduce_dict({"max": gap.largest}, plan.device, "max")["max"]
    # quantiles do not add up over ranks: each rank's own, and the largest is logged
    qs = all_reduce_dict(gap.quantiles(), plan.device, "max")
    out |= {f"logprob_gap/{k}": v for k, v in qs.items()}
    # TRL's names for the same measures, so a TRL user's dashboard reads these runs
    out["sampling/sampling_logp_difference/mean"] = out["logprob_gap/mean"]
    out["sampling/sampling_logp_difference/max"] = out["logprob_gap/max"]
    if g.rollout_correction:
        n_sum = all_reduce_dict({"n": ratio["n"], "sum": ratio["sum"]}, plan.device)
        hi = all_reduce_dict({"max": ratio["max"], "neg_min": -ratio["min"]}, plan.device, "max")
        if n_sum["n"] > 0:
            out["sampling/importance_sampling_ratio/min"] = -hi["neg_min"]
            out["sampling/importance_sampling_ratio/mean"] = n_sum["sum"] / n_sum["n"]
            out["sampling/importance_sampling_ratio/max"] = hi["max"]
    out["learning_rate"] = float(engine.get_lr()[0])
    return out


def _any_rank_nonfinite(g: GRPOConfig, plan: UpdatePlan, bad_in_pass: int) -> bool:
    """At a pass's accumulation boundary, before its optimizer step: did any rank's loss in
    this pass go non-finite? A collective every rank reaches at the same micro-batch. With
    on_nonfinite=stop the run stops here, before the step, keeping the last checkpoint."""
    bad = all_reduce_dict({"bad": float(bad_in_pass)}, plan.device)["bad"]
    if bad and g.on_nonfinite == "stop":
        raise FloatingPointError(
            f"non-finite loss in {int(bad)} micro-batches; stopping (grpo.on_nonfinite=stop); "
            "the last checkpoint is kept"
        )
    return bool(bad)


def _skip_step(engine: Any) -> None:
    """Ends a pass whose gradient is non-finite without an optimizer step: no weight, moment
    or learning-rate schedule moves (DeepSpeed counts it in skipped_steps). DeepSpeed's
    optimizer wrappers detect the non-finite gradient themselves; a bare optimizer (ZeRO 0 in
    float32) is told to skip."""
    before = engine.skipped_steps
    opt = engine.optimizer
    if hasattr(opt, "overflow"):
        engine.step()
    else:
        opt.step = lambda *args, **kwargs: None  # shadows the class's step for this call
        opt.overflow = True
        try:
            engine.step()
        finally:
            del opt.step, opt.overflow
    if engine.skipped_steps != before + 1:
        raise RuntimeError(
            f"a pass with a non-finite loss was not skipped by {type(opt).__name__}: its "
            "optimizer step would have applied a non-finite gradient"
        )


def _zero_gradient_loss(
    engine: Any, g: GRPOConfig, plan: UpdatePlan, ro: Rollout, mask: torch.Tensor,
    adv: torch.Tensor, ref_logps: torch.Tensor | None, num_items: float,
) -> torch.Tensor:  # fmt: skip
    """A loss with an exactly zero gradient that still runs the model: one row, advantage 0,
    weight 0. Every rank then makes the same backward calls with gradient hooks firing in
    the same order (ZeRO-2 packs gradients into its reduce buckets in hook order)."""
    one_row = torch.tensor([0])
    zeros = torch.zeros_like(adv)
    loss, _ = _micro_loss(engine, g, plan, ro, mask, zeros, ref_logps, one_row, num_items, None)
    if torch.isfinite(loss):
        return loss * 0.0
    # the model's own output is not finite: a zero gradient without a forward pass
    return sum(p.sum() for p in engine.parameters()) * 0.0


def _micro_loss(
    engine: Any, g: GRPOConfig, plan: UpdatePlan, ro: Rollout, loss_mask: torch.Tensor,
    adv: torch.Tensor, ref_logps: torch.Tensor | None, idx: torch.Tensor, num_items: float,
    state: _PassState | None, first_pass: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:  # fmt: skip
    """Loss and metrics of the rows idx, with columns that are padding in all of them cut.

    The completion mask is the attention mask; loss_mask (the completion mask, without
    truncated completions when those are masked) selects the tokens of the loss. state None:
    a zero-gradient stand-in, which records nothing and uses pi_theta as pi_old."""
    # trailing completion padding of all rows is cut; the forward itself reads real tokens only
    c = int(ro.completion_mask[idx].sum(1).max())
    mask = loss_mask[idx, :c]
    # top-k/top-p sampling with the correction (or pi_old from the sampler): pi over the same
    # truncated distribution the sampler drew from, so that pi / mu compares like with like; a
    # token outside this forward's own truncation (the two disagree at the edge) is scored
    # over the kept set and itself, stays in the loss and its normaliser, and is counted
    trunc = (g.top_k, g.top_p) if g.scores_truncated else None
    outside = torch.zeros(mask.shape, dtype=torch.bool, device=mask.device) if trunc else None
    logps, entropy = completion_logprobs(
        engine, ro.prompt_ids[idx], ro.prompt_mask[idx], ro.completion_ids[idx, :c],
        ro.completion_mask[idx, :c], g.temperature, entropy=True,
        bucket_tokens=plan.bucket_tokens, logits_budget_mib=plan.logits_budget_mib,
        truncation=trunc, outside=outside,
    )  # fmt: skip
    n_outside = 0.0
    if outside is not None:
        n_outside = float((outside.to(mask.device) & mask.bool()).sum())
    sampler = ro.sampling_logps[idx, :c]
    if state is not None and first_pass:
        state.gap.add(logps.detach(), sampler, mask,
                      None if ro.turn is None else ro.turn[idx, :c])  # fmt: skip
        if g.old_logprobs == "recompute" and g.mu > 1:
            state.old[idx, :c] = logps.detach()
    # mu = 1: pi_old is the current policy exactly (rho = 1, the gradient is the PG)
    old = state.old[idx, :c] if g.mu > 1 and state is not None else logps.detach()
    # the entropy bonus needs the entropy's gradient; otherwise it is a metric only
    bonus = entropy if g.uses_entropy_bonus else None
    is_w = over = None
    if g.rollout_correction and state is not None:
        is_w, over = correction_weights(
            old, sampler, mask, level=g.rollout_correction_level,
            mode=g.rollout_correction_mode, threshold=g.rollout_correction_threshold,
            min_threshold=g.rollout_correction_min_threshold,
        )  # fmt: skip
    loss, m = policy_loss(
        logps, old, adv[idx, :c], mask,
        ref_logps=None if ref_logps is None else ref_logps[idx, :c], beta=g.beta,
        entropy=bonus, entropy_coef=g.entropy_coef,
        loss_type=g.loss_type, objective=g.policy_objective, params=g.objective_params(),
        importance_level=g.importance_level, max_completion_length=g.max_completion_length,
        num_items=num_items if LOSS_AGGREGATIONS[g.loss_type].global_normaliser else None,
        is_weights=is_w,
    )  # fmt: skip
    with torch.no_grad():
        m["_w"] = float(mask.sum())
        n_tok = max(m["_w"], 1.0)
        m["entropy"] = float((entropy.detach() * mask).sum()) / n_tok
        if trunc is not None:
            m["truncation/outside_frac"] = n_outside / n_tok
        if is_w is not None and over is not None:
            m["rollout_correction/weight_mean"] = float(is_w.sum()) / n_tok
            m["rollout_correction/over_threshold_frac"] = float(over.sum()) / n_tok
            m["_ratio"] = ratio_stats(is_w, mask, g.rollout_correction_level)
    return loss, m


def _local_grad_norm(engine: Any) -> float:
    norms = [p.grad.detach().float().norm() for p in engine.parameters() if p.grad is not None]
    return float(torch.stack(norms).norm()) if norms else 0.0
