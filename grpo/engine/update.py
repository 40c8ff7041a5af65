"""Step 4, update: mu passes of clipped policy-gradient steps over the rollout (one optimizer
step per pass), in micro-batches, through the DeepSpeed engine.

The bookkeeping here exists for DeepSpeed: every rank makes the same number of backward calls
per pass, whatever it skipped, because the accumulation boundary and ZeRO-2's gradient buckets
(filled in hook order) count on it. docs/ALGORITHM.md has the loss itself.
"""

from __future__ import annotations

from typing import Any

import torch

from grpo.algo.logprobs import token_entropy, token_logprobs
from grpo.algo.loss import policy_loss
from grpo.config import GRPOConfig
from grpo.engine.distributed import all_reduce_sum
from grpo.models.forward import completion_logits
from grpo.models.generate import Rollout

# per-token metrics of policy_loss (plus entropy), token-weighted over the trained rows; "kl"
# joins them when a reference is loaded: a fixed list, so every rank all-reduces the same keys
# even when it skipped all its rows
POLICY_METRICS = (
    "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "ratio_mean",
    "entropy", "clamp/log_ratio_frac",
)  # fmt: skip


def loss_mask(ro: Rollout, mask_truncated: bool) -> torch.Tensor:
    """The tokens the loss counts [N, C]: the completion mask, and with mask_truncated (DAPO's
    overlong filtering, TRL's mask_truncated_completions) none of a completion that hit
    max_completion_length without EOS: its end is unknown, so its reward says little."""
    if not mask_truncated:
        return ro.completion_mask
    return ro.completion_mask * (~ro.truncated).unsqueeze(1).to(ro.completion_mask.dtype)


class PolicyUpdate:
    """The update of one step: `update(rollout, advantages [N, C], ref_logps) -> metrics`."""

    def __init__(
        self,
        engine: Any,
        g: GRPOConfig,
        *,
        micro: int,
        n_micro: int,
        world: int,
        zero_stage: int,
        device: torch.device,
    ) -> None:
        self.engine, self.g, self.device = engine, g, device
        self.micro, self.n_micro, self.world, self.zero_stage = micro, n_micro, world, zero_stage
        self.metric_keys = POLICY_METRICS + (("kl", "clamp/k3_frac") if g.uses_reference else ())

    def update(
        self, ro: Rollout, adv: torch.Tensor, ref_logps: torch.Tensor | None
    ) -> dict[str, float]:
        """Entropy and clip metrics are over the completions trained on (see trained_rows)."""
        g = self.g
        mask = loss_mask(ro, g.mask_truncated_completions)  # [N, C]
        if adv.shape != mask.shape:
            raise ValueError(f"adv: expected [N, C] {tuple(mask.shape)}, got {tuple(adv.shape)}")
        # dapo: normalise by the active tokens of the whole global batch (all ranks, all micro)
        (num_items,) = all_reduce_sum([float(mask.sum())], self.device)
        # DeepSpeed averages gradients over ranks and accumulation steps; dapo's per-micro loss
        # is already a share of the global mean, so undo that averaging
        scale = self.world * self.n_micro if g.loss_type == "dapo" else 1.0
        if mask.shape[0] > self.n_micro * self.micro:
            raise ValueError(
                f"rollout: {mask.shape[0]} local rows exceed {self.n_micro} micro-batches of "
                f"{self.micro}"
            )
        rows = self.trained_rows(adv, mask)
        sums: dict[str, float] = {"_w": 0.0, "loss": 0.0}
        nonfinite = 0
        grad_norms: list[float] = []
        # pi_old: the sampler's log-probs, replaced row by row by the first pass's own forward
        # (the parameters do not change within a pass) when old_logprobs is recompute
        self.old = ro.sampling_logps.clone() if g.mu > 1 else ro.sampling_logps
        self.gap = [0.0, 0.0, 0.0]  # |trainer - sampler| log-prob: sum, tokens, max
        for self.pass_ in range(g.mu):
            for j in range(self.n_micro):
                idx = rows[j * self.micro : (j + 1) * self.micro]
                if idx.numel():
                    loss, m = self._micro_loss(ro, mask, adv, ref_logps, idx, num_items)
                else:
                    loss, m = self._zero_gradient_loss(ro, mask, adv, ref_logps, num_items), {}
                if not torch.isfinite(loss):
                    nonfinite += 1
                    loss = self._zero_gradient_loss(ro, mask, adv, ref_logps, num_items)
                self.engine.backward(loss * scale)
                if j == self.n_micro - 1 and self.zero_stage == 0:
                    grad_norms.append(self._local_grad_norm())
                self.engine.step()
                w = m.pop("_w", 0.0)
                for k in self.metric_keys:
                    sums[k] = sums.get(k, 0.0) + m.get(k, 0.0) * w
                sums["_w"] += w
                sums["loss"] += float(loss.detach()) * scale / self.n_micro / g.mu
        keys = sorted(self.metric_keys)
        tot_gap = all_reduce_sum(self.gap[:2], self.device)
        tot = all_reduce_sum(
            [sums.get(k, 0.0) for k in keys] + [sums["_w"], sums["loss"], nonfinite], self.device
        )
        out = {k: v / max(tot[-3], 1.0) for k, v in zip(keys, tot)}
        out["loss"] = tot[-2] / self.world
        out["nonfinite_losses"] = tot[-1]
        if tot[-1] and g.on_nonfinite == "stop":
            raise FloatingPointError(
                f"non-finite loss in {int(tot[-1])} micro-batches; stopping (grpo.on_nonfinite="
                "stop); the last checkpoint is kept"
            )
        # ZeRO 1-3 report the global norm; stage 0 does not, and its grads are whole on each rank
        gn = self.engine.get_global_grad_norm()
        out["grad_norm"] = float(gn) if gn is not None else float(grad_norms[-1])
        (gap_max,) = all_reduce_sum([self.gap[2]], self.device, "max")
        out["logprob_gap/mean"] = tot_gap[0] / max(tot_gap[1], 1.0)
        out["logprob_gap/max"] = gap_max
        out["learning_rate"] = float(self.engine.get_lr()[0])
        return out

    def trained_rows(self, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Local rows to run forward/backward on, from advantages and the loss mask [N, C].

        With no KL term and the dapo loss, a completion whose advantage is zero at every token
        adds exactly zero to the loss and its gradient (-min(rho*0, clip(rho)*0) = 0), and dapo's
        normaliser (num_items, all tokens of the global batch) does not depend on which rows run;
        skipping them is exact and saves the forward/backward of every group whose rewards were
        all equal. Other loss types divide by per-micro-batch counts, and a KL term acts on every
        row, so they train on all rows.
        """
        g = self.g
        n = adv.shape[0]
        if not (g.skip_zero_advantage and not g.uses_reference and g.loss_type == "dapo"):
            return torch.arange(n)
        per_row = (adv.abs() * mask).sum(1)  # [N]; a masked-out (truncated) row adds nothing
        # != rather than >: a NaN advantage is kept, so its loss is seen as non-finite
        return (per_row != 0).nonzero().squeeze(1).cpu()

    def _zero_gradient_loss(
        self,
        ro: Rollout,
        mask: torch.Tensor,
        adv: torch.Tensor,
        ref_logps: torch.Tensor | None,
        num_items: float,
    ) -> torch.Tensor:
        """A loss with an exactly zero gradient that still runs the model: one row, advantage 0,
        weight 0. Every rank then makes the same backward calls with gradient hooks firing in
        the same order (ZeRO-2 packs gradients into its reduce buckets in hook order)."""
        one_row = torch.tensor([0])
        zeros = torch.zeros_like(adv)
        loss, _ = self._micro_loss(ro, mask, zeros, ref_logps, one_row, num_items, record=False)
        if torch.isfinite(loss):
            return loss * 0.0
        # the model's own output is not finite: a zero gradient without a forward pass
        return sum(p.sum() for p in self.engine.parameters()) * 0.0

    def _micro_loss(
        self,
        ro: Rollout,
        loss_mask: torch.Tensor,
        adv: torch.Tensor,
        ref_logps: torch.Tensor | None,
        idx: torch.Tensor,
        num_items: float,
        record: bool = True,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss and metrics of the rows idx, with columns that are padding in all of them cut.

        The completion mask is the attention mask; loss_mask (the completion mask, without
        truncated completions when those are masked) selects the tokens of the loss."""
        g = self.g
        attn = ro.completion_mask[idx]
        pmask = ro.prompt_mask[idx]
        # causal attention: trailing completion padding never affects earlier positions, and
        # positions count real tokens, so leading prompt padding can go too
        c = int(attn.sum(1).max())
        p0 = int((pmask.sum(0) > 0).long().argmax())
        attn, pmask, cids = attn[:, :c], pmask[:, p0:], ro.completion_ids[idx, :c]
        mask = loss_mask[idx, :c]
        logits = completion_logits(self.engine, ro.prompt_ids[idx, p0:], pmask, cids, attn)
        logps = token_logprobs(logits, cids, g.temperature)  # [mb, c]
        if self.pass_ == 0 and record:
            self._record_gap(logps.detach(), ro.sampling_logps[idx, :c], mask)
            if g.old_logprobs == "recompute" and g.mu > 1:
                self.old[idx, :c] = logps.detach()
        # mu = 1: pi_old is the current policy exactly (rho = 1, the gradient is the PG)
        old = self.old[idx, :c] if g.mu > 1 else logps.detach()
        loss, m = policy_loss(
            logps, old, adv[idx, :c], mask,
            ref_logps=None if ref_logps is None else ref_logps[idx, :c],
            loss_type=g.loss_type, eps_low=g.eps_low, eps_high=g.eps_high, beta=g.beta,
            importance_level=g.importance_level, max_completion_length=g.max_completion_length,
            num_items=num_items if g.loss_type == "dapo" else None,
        )  # fmt: skip
        with torch.no_grad():
            ent = token_entropy(logits.detach(), g.temperature)
            m["_w"] = float(mask.sum())
            m["entropy"] = float((ent * mask).sum()) / max(m["_w"], 1.0)
        return loss, m

    def _record_gap(self, trainer: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor) -> None:
        """Sampler vs training-forward log-probs of the same tokens under the same weights: the
        rollout/trainer mismatch (numerics, kernels, dtype) that TRL and verl users watch."""
        d = (trainer - sampler).abs() * mask
        self.gap[0] += float(d.sum())
        self.gap[1] += float(mask.sum())
        self.gap[2] = max(self.gap[2], float(d.max()) if d.numel() else 0.0)

    def _local_grad_norm(self) -> float:
        norms = [
            p.grad.detach().float().norm() for p in self.engine.parameters() if p.grad is not None
        ]
        return float(torch.stack(norms).norm()) if norms else 0.0
