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
    """Logits predicting each completion token [B, C, V], one forward over prompt+completion.

    Only the C positions that predict a completion token get logits (transformers'
    `logits_to_keep`): with a 152k vocabulary, logits at every prompt position would be most of
    the activation memory.
    """
    ids = torch.cat([prompt_ids, completion_ids], 1)  # [B, P+C]
    mask = torch.cat([prompt_mask, completion_mask], 1)
    # positions count real tokens only, so left padding does not shift them
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    c = completion_ids.shape[1]
    # the last C + 1 positions: P-1 .. P+C-1; position t predicts token t+1, so drop the last
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=c + 1)
    return out.logits[:, :-1]  # [B, C, V]
