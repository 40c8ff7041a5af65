"""The frozen reference policy pi_ref for the KL term (loaded only if GRPOConfig.uses_reference)."""

from __future__ import annotations

from pathlib import Path

import torch

from grpo.algo.logprobs import token_logprobs
from grpo.config import Config
from grpo.engine.deepspeed_setup import build_frozen
from grpo.models.forward import completion_logits
from grpo.models.generate import Rollout
from grpo.models.loading import load_model


class Reference:
    """pi_ref: the starting policy, frozen (a ZeRO-3 inference engine when sharding)."""

    def __init__(self, cfg: Config, policy_dir: str | Path, device: torch.device) -> None:
        model = load_model(policy_dir, cfg.model.dtype, trainable=False).to(device)
        self.model = build_frozen(model, cfg)
        self.temperature = cfg.grpo.temperature

    @torch.no_grad()
    def logps(self, ro: Rollout, micro: int) -> torch.Tensor:
        """log pi_ref of every completion token [N, C], in micro-batches of `micro` rows."""
        out = []
        for s in range(0, ro.completion_ids.shape[0], micro):
            sl = slice(s, s + micro)
            logits = completion_logits(
                self.model, ro.prompt_ids[sl], ro.prompt_mask[sl],
                ro.completion_ids[sl], ro.completion_mask[sl],
            )  # fmt: skip
            out.append(token_logprobs(logits, ro.completion_ids[sl], self.temperature))
        return torch.cat(out)
