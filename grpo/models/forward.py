"""The training-side forward: log-probs (and entropy) of every completion token, given prompt
and completion, for the update and for pi_ref.

Two things keep it near the cost of the real tokens alone (benchmarks/SCALING.md measures each
by turning it off):
- **Length buckets.** Rows are laid out again as [prompt, completion] with the padding at the
  end, sorted by length and run in buckets of at most `bucket_tokens` padded tokens. A batch
  of short and long completions does not pay the longest one's width on every row.
- **A chunked LM head.** The head is applied only at positions that predict a real completion
  token, and in chunks under activation checkpointing once its logits would pass a memory
  budget: the [tokens, vocab] logits never exist whole (at a 49k vocabulary they are most of
  the update's memory), at the price of one more head matmul per chunk in the backward.

All buckets' graphs stay alive until the caller's backward: one backward per micro-batch, as
DeepSpeed's gradient accumulation expects. Dimension letters: N rows, P prompt tokens, C
completion tokens, L a bucket's width, T real completion tokens, V vocabulary, D hidden size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from grpo.algo.logprobs import token_entropy, token_logprobs, truncated_token_logprobs
from grpo.models import lora

# model types whose logits are exactly lm_head(final hidden state): no soft-capping or scale
# after the head (Gemma 2's final_logit_softcapping would be lost by applying the head alone)
PLAIN_HEAD_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})


def causal_lm(model: Any) -> Any:
    """The transformers model inside a wrapper that holds it as `module` (a DeepSpeed engine,
    DDP) and/or a peft model (whose layers hold the adapters)."""
    inner = model._modules.get("module") if isinstance(model, torch.nn.Module) else None
    return lora.base_model(inner if inner is not None else model)


def length_buckets(lengths: torch.Tensor, max_tokens: int) -> list[torch.Tensor]:
    """Row indices grouped longest first, each group's rows x its longest row <= max_tokens (a
    row longer than max_tokens alone). max_tokens 0: one group of every row."""
    order = torch.argsort(lengths, descending=True, stable=True)
    if max_tokens <= 0:
        return [order]
    groups: list[torch.Tensor] = []
    start = 0
    n = len(order)
    while start < n:
        width = int(lengths[order[start]])  # the group's longest row: it comes first
        size = max(1, max_tokens // max(width, 1))
        groups.append(order[start : start + size])
        start += size
    return groups


def relayout(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor, completion_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Rows [prompt, completion] with every real token first and the padding last.

    Returns ids [B, L] and attention mask [B, L] (L the longest row's real length), and for
    every real completion token, in row-major order, its row, its column in completion_ids and
    the position whose output predicts it (its own position - 1): three [T] tensors."""
    ids = torch.cat([prompt_ids, completion_ids], 1)  # [B, P+C]
    real = torch.cat([prompt_mask, completion_mask], 1).bool()
    lengths = real.sum(1)
    width = int(lengths.max())
    # a stable sort of "is padding" moves the real tokens to the front, in order
    order = torch.argsort((~real).to(torch.int8), dim=1, stable=True)[:, :width]
    packed = ids.gather(1, order)
    attn = (torch.arange(width, device=ids.device) < lengths.unsqueeze(1)).long()
    packed = packed * attn  # padding ids are 0, whatever the source held
    rows, cols = completion_mask.bool().nonzero(as_tuple=True)  # row-major
    # completion token j of row i sits at p_i + j and is predicted at p_i + j - 1
    return packed, attn, rows, cols, prompt_mask.sum(1)[rows] + cols - 1


@contextlib.contextmanager
def _head_inputs(head: torch.nn.Module, store: list[torch.Tensor]) -> Iterator[None]:
    """Within the block, the LM head records the hidden states it is given and computes no
    logits (it gets an empty slice of them): the caller applies it where it is needed."""

    def keep(_module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        store.append(args[0])
        return (args[0][:, :0], *args[1:])

    handle = head.register_forward_pre_hook(keep)
    try:
        yield
    finally:
        handle.remove()


def _chunk(
    head: torch.nn.Module, h: torch.Tensor, ids: torch.Tensor, temperature: float,
    entropy: bool, top_k: int = 0, top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """log pi, entropy and outside-the-truncation (float 0/1) of h's rows [t, D] (the entropy
    is zeros unless asked for). top_k > 0 or top_p < 1: log pi over that truncation of the
    logits; the entropy stays the whole distribution's."""
    if top_k > 0 or top_p < 1.0:
        logits = head(h).unsqueeze(0)  # [1, t, V]
        lp, out_of = truncated_token_logprobs(logits, ids.unsqueeze(0), temperature, top_k, top_p)
        ent = token_entropy(logits, temperature)[0] if entropy else torch.zeros_like(lp[0])
        return lp[0], ent, out_of[0].float()
    z = head(h).float() / temperature  # [t, V]
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(1, ids.unsqueeze(1)).squeeze(1) - lse
    none_outside = torch.zeros_like(logp.detach())
    if not entropy:
        return logp, torch.zeros_like(logp), none_outside
    p = torch.exp(z - lse.unsqueeze(1))
    return logp, lse - (p * z).sum(-1), none_outside  # H = lse - E_p[z]


def chunk_rows(tokens: int, vocab: int, budget_mib: float) -> int:
    """Rows per LM-head chunk so that a chunk's float32 logits fit budget_mib; 0 when all
    `tokens` rows fit at once (or budget_mib is 0: no limit), and then nothing is chunked.

    >>> chunk_rows(5000, 49152, 256), chunk_rows(5000, 300, 256), chunk_rows(5000, 49152, 0)
    (1365, 0, 0)
    """
    per_row = 4 * vocab
    if budget_mib <= 0 or tokens * per_row <= budget_mib * 2**20:
        return 0
    return max(1, int(budget_mib * 2**20) // per_row)


def head_logprobs(
    head: torch.nn.Module, h: torch.Tensor, ids: torch.Tensor, temperature: float,
    chunk: int, entropy: bool, truncation: tuple[int, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """log pi(ids), entropy and outside-the-truncation (bool) [T] from final hidden states
    h [T, D], `chunk` rows at a time; truncation (top_k, top_p): log pi over that truncated
    distribution.

    With gradients on, each chunk is checkpointed: its logits are freed after the forward and
    recomputed in the backward, so at most chunk x V of them exist at once (the truncation's
    float32 copies too). chunk 0: all rows at once, logits kept for the backward (cheaper when
    they are small: no recompute)."""
    trunc = truncation or (0, 1.0)
    if chunk <= 0:
        lp, ent, out_of = _chunk(head, h, ids, temperature, entropy, *trunc)
        return lp, ent, out_of.bool()
    parts = []
    for s in range(0, h.shape[0], chunk):
        args = (head, h[s : s + chunk], ids[s : s + chunk], temperature, entropy, *trunc)
        if torch.is_grad_enabled():
            parts.append(checkpoint(_chunk, *args, use_reentrant=False, preserve_rng_state=False))
        else:
            parts.append(_chunk(*args))
    return (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
            torch.cat([p[2] for p in parts]).bool())  # fmt: skip


def completion_logprobs(
    model: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor, completion_mask: torch.Tensor, temperature: float = 1.0,
    *, entropy: bool = False, bucket_tokens: int = 0, logits_budget_mib: float = 0,
    truncation: tuple[int, float] | None = None, outside: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """log pi of every completion token [N, C] (0 at padding), and its entropy [N, C] (zeros
    unless asked for), under softmax(logits / temperature).

    model: a causal LM, a peft model around one, or a DeepSpeed engine around either (called
    as a whole, so that the engine's and ZeRO-3's hooks run). Prompts may be left-padded and
    completions right-padded: only the masks' real tokens are read.
    truncation (top_k, top_p): the log-probs are over that truncated distribution (the one a
    sampler with those settings draws from; the entropy stays the whole distribution's), on
    the model's full logits; `outside` [N, C] bool, when given, is set where a completion token
    lies outside this forward's own truncation.
    """
    if completion_ids.shape != completion_mask.shape:
        raise ValueError(
            f"completion_mask: shape {tuple(completion_mask.shape)} does not match "
            f"completion_ids {tuple(completion_ids.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature: must be > 0, got {temperature}")
    n, c = completion_ids.shape
    lm = causal_lm(model)
    plain = lm.config.model_type in PLAIN_HEAD_TYPES
    head = lm.get_output_embeddings()  # the module the model itself calls
    lengths = prompt_mask.sum(1) + completion_mask.sum(1)
    rows_out, cols_out, logps, ents = [], [], [], []
    for rows in length_buckets(lengths, bucket_tokens):
        if not int(completion_mask[rows].sum()):
            continue
        ids, attn, tok_rows, tok_cols, pred = relayout(
            prompt_ids[rows], prompt_mask[rows], completion_ids[rows], completion_mask[rows]
        )
        targets = completion_ids[rows][completion_mask[rows].bool()]  # [T], row-major
        if plain:
            seen: list[torch.Tensor] = []
            with _head_inputs(head, seen):
                model(input_ids=ids, attention_mask=attn, use_cache=False, logits_to_keep=0)
            h = seen[-1][tok_rows, pred]  # [T, D]
            # the truncation makes three float32 copies of a chunk's logits: a third the rows
            copies = 3 if truncation is not None else 1
            chunk = chunk_rows(h.shape[0], lm.config.vocab_size, logits_budget_mib / copies)
            lp, ent, out_of = head_logprobs(head, h, targets, temperature, chunk, entropy,
                                            truncation)  # fmt: skip
            if outside is not None and truncation is not None:
                outside[rows[tok_rows], tok_cols] = out_of
        else:  # the model's own logits at every position: slower, and right for any head
            logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
            picked = logits[tok_rows, pred].unsqueeze(0)  # [1, T, V]
            if truncation is None:
                lp = token_logprobs(picked, targets.unsqueeze(0), temperature)[0]
            else:
                lp, out_of = truncated_token_logprobs(picked, targets.unsqueeze(0), temperature,
                                                      *truncation)  # fmt: skip
                lp = lp[0]
                if outside is not None:
                    outside[rows[tok_rows], tok_cols] = out_of[0]
            ent = token_entropy(picked, temperature)[0] if entropy else torch.zeros_like(lp)
        rows_out.append(rows[tok_rows])
        cols_out.append(tok_cols)
        logps.append(lp)
        ents.append(ent)
    out = completion_ids.new_zeros((n, c), dtype=torch.float32)
    out_ent = out.clone()
    if logps:
        where = (torch.cat(rows_out), torch.cat(cols_out))
        out = out.index_put(where, torch.cat(logps))
        out_ent = out_ent.index_put(where, torch.cat(ents))
    return out, out_ent


def completion_logits(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
) -> torch.Tensor:
    """Logits predicting each completion token [B, C, V], one padded forward over
    prompt+completion: the plain reference the fast path above is tested against.

    Only the C positions that predict a completion token get logits (transformers'
    `logits_to_keep`).
    """
    ids = torch.cat([prompt_ids, completion_ids], 1)  # [B, P+C]
    mask = torch.cat([prompt_mask, completion_mask], 1)
    # positions count real tokens only, so left padding does not shift them
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    c = completion_ids.shape[1]
    # the last C + 1 positions: P-1 .. P+C-1; position t predicts token t+1, so drop the last
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=c + 1)
    return out.logits[:, :-1]  # [B, C, V]
