"""Per-token log-probabilities and entropy from logits, without a full log-softmax copy.

A [B, T, V] log-softmax doubles peak memory for a large vocabulary; we only need the log-prob of
the sampled token, which is logit[id] - logsumexp(logits). Rows are processed in chunks so the
temperature-scaled float32 copy is at most `chunk_rows x V`.
"""

from __future__ import annotations

import torch


def token_logprobs(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0, chunk_rows: int = 4096
) -> torch.Tensor:
    """log pi(ids | context) under softmax(logits / temperature).

    logits: [B, T, V] (position t predicts ids[:, t]); ids: [B, T] -> [B, T] float32.
    """
    if logits.shape[:-1] != ids.shape:
        raise ValueError(
            f"ids: shape {tuple(ids.shape)} does not match logits {tuple(logits.shape[:-1])}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature: must be > 0, got {temperature}")
    flat_logits = logits.reshape(-1, logits.shape[-1])  # [B*T, V]
    flat_ids = ids.reshape(-1, 1)  # [B*T, 1]
    out = []
    for s in range(0, flat_logits.shape[0], chunk_rows):
        chunk = flat_logits[s : s + chunk_rows].float() / temperature  # [c, V]
        picked = chunk.gather(1, flat_ids[s : s + chunk_rows]).squeeze(1)  # [c]
        out.append(picked - torch.logsumexp(chunk, dim=-1))
    return torch.cat(out).view(ids.shape)


def token_entropy(
    logits: torch.Tensor, temperature: float = 1.0, chunk_rows: int = 4096
) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position: [B, T, V] -> [B, T]."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = []
    for s in range(0, flat.shape[0], chunk_rows):
        z = flat[s : s + chunk_rows].float() / temperature  # [c, V]
        lse = torch.logsumexp(z, dim=-1, keepdim=True)  # [c, 1]
        p = torch.exp(z - lse)
        out.append((lse - (p * z).sum(-1, keepdim=True)).squeeze(1))  # H = lse - E_p[z]
    return torch.cat(out).view(logits.shape[:-1])
