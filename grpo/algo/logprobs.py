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


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Top-k then nucleus (top-p) truncation: removed tokens get -inf; the top token always stays.

    >>> filter_logits(torch.tensor([[1.0, 3.0, 2.0]]), top_k=2)
    tensor([[-inf, 3., 2.]])
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, -1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        srt, order = logits.sort(-1, descending=True)
        probs = srt.softmax(-1)
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p  # mass before this token already >= p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def truncated_token_logprobs(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(ids) under softmax(logits / temperature) truncated by top-k then top-p (the
    distribution a sampler with those settings draws from), and whether each id lies outside
    that truncation [B, T] bool. Which tokens are kept is decided without a gradient; an id
    outside is scored over the kept set and itself (z_id - logsumexp(kept + id)): a
    probability, so the caller keeps it in the loss and counts it.

    logits: [B, T, V]; ids: [B, T]. Makes float32 [B, T, V] copies: for the update's micro-batch
    of a small vocabulary model, not for a large one's whole batch.

    >>> lp, out = truncated_token_logprobs(torch.tensor([[[0.0, 0.0, -9.0]]]),
    ...                                    torch.tensor([[0]]), 1.0, top_k=2, top_p=1.0)
    >>> round(float(lp), 4), bool(out)
    (-0.6931, False)
    """
    if logits.shape[:-1] != ids.shape:
        raise ValueError(
            f"ids: shape {tuple(ids.shape)} does not match logits {tuple(logits.shape[:-1])}"
        )
    z = logits.float() / temperature
    v = z.shape[-1]
    with torch.no_grad():
        kept = torch.isfinite(filter_logits(z.detach().reshape(-1, v), top_k, top_p))
        kept = kept.view(z.shape)
        outside = ~kept.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        # the drawn token is in the sampler's truncation: where this forward's truncation left
        # it out (the two disagree at the edge), it joins the kept set, so the token stays in
        # the loss with a probability that is one
        kept.scatter_(-1, ids.unsqueeze(-1), True)
    picked = z.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    lse = torch.logsumexp(z.masked_fill(~kept, float("-inf")), dim=-1)
    return picked - lse, outside
