"""The frozen reference policy pi_ref for the KL term (loaded only if GRPOConfig.uses_reference)."""

from __future__ import annotations

from pathlib import Path

import torch

from grpo.config import Config
from grpo.engine.deepspeed_setup import build_frozen
from grpo.models import lora
from grpo.models.forward import completion_logprobs
from grpo.models.generate import Rollout
from grpo.models.loading import load_model


class Reference:
    """pi_ref: the starting policy, frozen (a ZeRO-3 inference engine when sharding). For a
    LoRA policy it is the policy itself with its adapters switched off (`of_lora_policy`):
    the frozen base is the starting policy, and no second copy of it is loaded."""

    def __init__(
        self, model: torch.nn.Module, temperature: float, adapters_off: bool = False,
        bucket_tokens: int = 0, logits_budget_mib: float = 0,
    ) -> None:  # fmt: skip
        self.model, self.temperature, self.adapters_off = model, temperature, adapters_off
        self.bucket_tokens, self.logits_budget_mib = bucket_tokens, logits_budget_mib

    @classmethod
    def load(cls, cfg: Config, policy_dir: str | Path, device: torch.device) -> Reference:
        """The starting policy loaded from its directory, frozen."""
        model = load_model(policy_dir, cfg.model.dtype, trainable=False).to(device)
        return cls(build_frozen(model, cfg), cfg.grpo.temperature, False, *cfg.forward_layout())

    @classmethod
    def of_lora_policy(cls, policy: torch.nn.Module, cfg: Config) -> Reference:
        return cls(policy, cfg.grpo.temperature, True, *cfg.forward_layout())

    @torch.no_grad()
    def logps(self, ro: Rollout, micro: int) -> torch.Tensor:
        """log pi_ref of every completion token [N, C], in micro-batches of `micro` rows."""
        if not self.adapters_off:
            return self._logps(ro, micro)
        was_training = self.model.training
        self.model.eval()  # no dropout in pi_ref, as in a reference loaded frozen
        try:
            with lora.adapters_off(self.model):
                return self._logps(ro, micro)
        finally:
            self.model.train(was_training)

    def _logps(self, ro: Rollout, micro: int) -> torch.Tensor:
        out = []
        for s in range(0, ro.completion_ids.shape[0], micro):
            sl = slice(s, s + micro)
            logps, _ = completion_logprobs(
                self.model, ro.prompt_ids[sl], ro.prompt_mask[sl], ro.completion_ids[sl],
                ro.completion_mask[sl], self.temperature, bucket_tokens=self.bucket_tokens,
                logits_budget_mib=self.logits_budget_mib,
            )  # fmt: skip
            out.append(logps)
        return torch.cat(out)
