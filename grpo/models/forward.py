"""The training-side forward: logits of every completion token, given prompt and completion."""

from __future__ import annotations

import torch


def completion_logits(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
) -> torch.Tensor:
    """Logits predicting each completion token [B, C, V], one forward over prompt+completion."""
    ids = torch.cat([prompt_ids, completion_ids], 1)  # [B, P+C]
    mask = torch.cat([prompt_mask, completion_mask], 1)
    # positions count real tokens only, so left padding does not shift them
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits  # [B, P+C, V]
    p, c = prompt_ids.shape[1], completion_ids.shape[1]
    return logits[:, p - 1 : p + c - 1]  # position t predicts token t+1
