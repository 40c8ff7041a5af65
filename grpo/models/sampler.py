"""A lean sampler for Llama-family decoders (Qwen2, Llama): the rollout hot loop.

For small models, and for any model at small batch on CPU, HF `generate()` spends most of each
decoding step in Python: cache objects, mask building, logits processors, stopping criteria.
This sampler reads the model's own weights (no copy beyond fusing q/k/v and gate/up once per
call) and runs a fixed, minimal op sequence per step:

- q/k/v and gate/up as one matmul each; rotary tables computed once by the model's own
  `rotary_emb` (so any static rope scaling it supports is honoured);
- a preallocated KV cache, written in place; single-query attention as two small matmuls;
- sampling by inverse CDF (one uniform per row) instead of torch.multinomial;
- rows that finished are dropped from the batch (compaction), so a long tail of a few
  unfinished completions costs a few rows, not the whole batch.

It records log pi(token) under softmax(logits / T) for every sampled token, the quantity the
trainer recomputes (tests check both agree with a teacher-forced forward of the HF model).
Unsupported architectures are named by `unsupported_reason`; `generate.generate` then uses HF.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from grpo.algo.logprobs import filter_logits
from grpo.models.lora import base_model, effective_bias, effective_weight

SUPPORTED_TYPES = ("qwen2", "llama")

# finished rows leave the batch once they are 1/COMPACT_EVERY of it: copying the KV cache
# costs about one decoding step, so compacting for fewer idle rows than that does not pay
COMPACT_EVERY = 8


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why this sampler cannot run `model` exactly, or None when it can."""
    model = base_model(model)  # a LoRA policy's layers are the base model's
    cfg = getattr(model, "config", None)
    mtype = getattr(cfg, "model_type", None)
    if mtype not in SUPPORTED_TYPES:
        return f"model_type {mtype!r} is not one of {SUPPORTED_TYPES}"
    if getattr(cfg, "use_sliding_window", False) or any(
        t != "full_attention" for t in getattr(cfg, "layer_types", None) or []
    ):
        return "sliding-window attention is not implemented"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} (only silu)"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if "dynamic" in str(rope.get("rope_type", rope.get("type", ""))):
        return "dynamic rope scaling depends on the sequence length"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "rotary_emb") or not hasattr(inner, "layers"):
        return "expected model.model.{layers, rotary_emb}"
    return None


Linear = Callable[[torch.Tensor], torch.Tensor]


def make_linear(w: torch.Tensor, b: torch.Tensor | None) -> Linear:
    """The layer x -> x W^T + b in W's dtype."""
    return functools.partial(F.linear, weight=w, bias=b)


@dataclass
class _Layer:
    ln_in: torch.Tensor
    qkv: Linear
    o: Linear
    ln_post: torch.Tensor
    gate_up: Linear
    down: Linear


def _cat_bias(linears: list[torch.nn.Module], weights: list[torch.Tensor]) -> torch.Tensor | None:
    """The biases of `linears` side by side (zeros for one without), or None when none has one;
    `weights` are their (merged) weights, for the widths."""
    biases = [effective_bias(lin) for lin in linears]
    if all(b is None for b in biases):
        return None
    return torch.cat([b if b is not None else w.new_zeros(w.shape[0])
                      for b, w in zip(biases, weights)])  # fmt: skip


class Decoder:
    """The model's weights arranged for decoding; build one per generate call (weights change)."""

    def __init__(self, model: torch.nn.Module) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"fast generation engine: {reason}")
        # a LoRA policy decodes with W + scale * B @ A, merged here once per call
        model = base_model(model)
        w = effective_weight
        cfg, inner = model.config, model.model
        self.layers = []
        for layer in inner.layers:
            a, m = layer.self_attn, layer.mlp
            qkv = [a.q_proj, a.k_proj, a.v_proj]
            w_qkv = [w(lin) for lin in qkv]  # merged once each (LoRA: one B @ A per matrix)
            rows_qkv = sum(x.shape[0] for x in w_qkv)
            self.layers.append(
                _Layer(
                    ln_in=layer.input_layernorm.weight,
                    qkv=make_linear(torch.cat(w_qkv), _cat_bias(qkv, w_qkv)),
                    o=make_linear(w(a.o_proj), effective_bias(a.o_proj)),
                    ln_post=layer.post_attention_layernorm.weight,
                    gate_up=make_linear(torch.cat([w(m.gate_proj), w(m.up_proj)]), None),
                    down=make_linear(w(m.down_proj), None),
                )
            )
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        # q, k, v rows: (n_heads + 2 n_kv) heads of head_dim
        self.head_dim = rows_qkv // (self.n_heads + 2 * self.n_kv)
        self.eps = cfg.rms_norm_eps
        self.embed = w(inner.embed_tokens)
        self.norm = inner.norm.weight
        self.head = make_linear(w(model.lm_head), effective_bias(model.lm_head))
        self.rotary = inner.rotary_emb
        self.dtype = self.embed.dtype
        self.device = self.embed.device

    def rope_tables(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions 0..n-1: [n, head_dim], from the model's own rotary module."""
        pos = torch.arange(n, device=self.device).unsqueeze(0)
        cos, sin = self.rotary(self.embed[:1].unsqueeze(0), pos)
        return cos[0].to(self.dtype), sin[0].to(self.dtype)

    def forward(
        self,
        ids: torch.Tensor,  # [B, T]
        cos: torch.Tensor,  # [B, T, 1, D] rotary tables at each token's position
        sin: torch.Tensor,
        cache: list[tuple[torch.Tensor, torch.Tensor]],  # per layer K, V: [B, n_kv, S, D]
        start: int,  # write position of ids[:, 0] in the cache
        mask: torch.Tensor,  # prefill: bool [B, 1, T, start+T]; decode: additive [B, 1, 1, S']
    ) -> torch.Tensor:
        """Logits of the last position: [B, V]. Writes K, V of the T new tokens into cache."""
        b, t = ids.shape
        nh, nkv, d = self.n_heads, self.n_kv, self.head_dim
        end = start + t
        half = d // 2
        h = F.embedding(ids, self.embed)
        for layer, (k_cache, v_cache) in zip(self.layers, cache, strict=True):
            x = F.rms_norm(h, (h.shape[-1],), layer.ln_in, self.eps)
            qkv = layer.qkv(x).view(b, t, nh + 2 * nkv, d)
            qk, v = qkv[:, :, : nh + nkv], qkv[:, :, nh + nkv :]
            # rotate q and k heads together: one rope application per layer
            qk = qk * cos + torch.cat([-qk[..., half:], qk[..., :half]], -1) * sin
            k_cache[:, :, start:end] = qk[:, :, nh:].transpose(1, 2)
            v_cache[:, :, start:end] = v.transpose(1, 2)
            q = qk[:, :, :nh].transpose(1, 2)  # [B, nh, T, D]
            if t == 1:
                # single query: [B, nkv, group, D] @ [B, nkv, D, S] -> two small matmuls
                qg = q.reshape(b, nkv, nh // nkv, d)
                scores = qg @ k_cache[:, :, :end].transpose(2, 3) * d**-0.5 + mask[:, :, :, :end]
                o = torch.softmax(scores.float(), -1).to(qg.dtype) @ v_cache[:, :, :end]
                o = o.reshape(b, 1, nh * d)
            else:
                o = F.scaled_dot_product_attention(
                    q, k_cache[:, :, :end], v_cache[:, :, :end], attn_mask=mask, enable_gqa=True
                )
                o = o.transpose(1, 2).reshape(b, t, nh * d)
            h = h + layer.o(o)
            x = F.rms_norm(h, (h.shape[-1],), layer.ln_post, self.eps)
            gate, up = layer.gate_up(x).chunk(2, -1)
            h = h + layer.down(F.silu(gate) * up)
        last = F.rms_norm(h[:, -1], (h.shape[-1],), self.norm, self.eps)
        return self.head(last)


def sample_tokens(probs: torch.Tensor) -> torch.Tensor:
    """One draw per row by inverse CDF: [B, V] probabilities -> [B] token ids.

    u is drawn from (0, total]; a zero-probability token can never be chosen.
    >>> sample_tokens(torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]))
    tensor([1, 2])
    """
    cdf = probs.cumsum(-1)
    u = (1.0 - torch.rand(probs.shape[0], 1, device=probs.device)) * cdf[:, -1:]
    return (cdf < u).sum(-1).clamp(max=probs.shape[-1] - 1)


def draw(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, do_sample: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The next token of each row [B] from its logits [B, V], and its log-probability under
    the distribution it was drawn from: softmax(logits / T), restricted to what top-k/top-p
    keep when they are on (greedy: the argmax, with its log-prob under softmax(logits / T))."""
    scaled = logits.float() / temperature
    logp_all = torch.log_softmax(scaled, -1)
    if do_sample:
        kept = filter_logits(scaled, top_k, top_p)
        if kept is not scaled:  # top-k/top-p: the log-probs of what was drawn from
            logp_all = kept.log_softmax(-1)
        probs = logp_all.exp() if kept is scaled else kept.softmax(-1)
        tok = sample_tokens(probs)
    else:
        tok = scaled.argmax(-1)
    return tok, logp_all.gather(1, tok[:, None]).squeeze(1)


def _in_inference_mode(fn: Callable[..., tuple[torch.Tensor, ...]]) -> Callable:
    """Run fn in inference mode, which skips autograd's view and version bookkeeping (~15% of a
    sampling step here), and clone its outputs outside it so that training may save them for
    backward (inference tensors cannot be)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        with torch.inference_mode():
            out = fn(*args, **kwargs)
        return tuple(t.clone() for t in out)

    return wrapper


@_in_inference_mode
def sample(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,  # [B, P] left-padded
    prompt_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_token_id: int | list[int],
    pad_token_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    do_sample: bool = True,
    num_generations: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Completions [B*G, C] and log pi of each sampled token [B*G, C].

    Each of the B prompts is prefilled once; its KV cache is then copied to its G rows
    (rows of one prompt contiguous), so the prompt costs one forward, not G.

    Rows of the batch draw from one shared random stream: results are reproducible for a given
    seed and batch, not row by row across different batches.

    eos_token_id: one id or several (Qwen2.5-Instruct ends a turn with <|im_end|> or
    <|endoftext|>). C is the number of steps taken: max_new_tokens, or fewer when every row
    ended early. Tokens
    after a row's first EOS are arbitrary (the row kept decoding until the next compaction) and
    their log-probs too: generate.generate masks both with completion_mask, for either engine.
    """
    dec = Decoder(model)
    b, p = prompt_ids.shape  # b distinct prompts here; b * G rows after the prefill
    total = p + max_new_tokens
    dev = prompt_ids.device
    eos_ids = torch.tensor(eos_token_id, device=dev).view(-1)  # any of them ends a row
    cos_t, sin_t = dec.rope_tables(total)
    cache = [
        (
            torch.empty(b, dec.n_kv, total, dec.head_dim, dtype=dec.dtype, device=dev),
            torch.empty(b, dec.n_kv, total, dec.head_dim, dtype=dec.dtype, device=dev),
        )
        for _ in dec.layers
    ]
    # positions as HF computes them for left padding: count of real tokens before, from 0
    pos = (prompt_mask.long().cumsum(1) - 1).clamp(min=0)  # [B, P]
    keys = prompt_mask.bool()
    causal = torch.ones(p, p, dtype=torch.bool, device=dev).tril()
    # a pad query attends to itself only (never NaN); real queries never see pads
    prefill_mask = (causal & keys[:, None, :]) | torch.eye(p, dtype=torch.bool, device=dev)
    logits = dec.forward(
        prompt_ids, cos_t[pos].unsqueeze(2), sin_t[pos].unsqueeze(2), cache, 0,
        prefill_mask.unsqueeze(1),
    )  # fmt: skip
    if num_generations > 1:
        g = num_generations
        cache = [(k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)) for k, v in cache]
        logits, pos, keys = (t.repeat_interleave(g, 0) for t in (logits, pos, keys))
        b = b * g
    bias = torch.zeros(b, 1, 1, total, dtype=dec.dtype, device=dev)
    bias[:, 0, 0, :p] = torch.where(keys, 0.0, float("-inf"))
    out = torch.full((b, max_new_tokens), pad_token_id, dtype=torch.long, device=dev)
    logps = torch.zeros(b, max_new_tokens, dtype=torch.float32, device=dev)
    rows = torch.arange(b, device=dev)  # active row -> original row
    done = torch.zeros(b, dtype=torch.bool, device=dev)  # active row has emitted EOS
    next_pos = pos[:, -1] + 1  # [active]
    steps = 0
    for step in range(max_new_tokens):
        steps = step + 1
        tok, tok_logp = draw(logits, temperature, top_k, top_p, do_sample)
        # rows already done keep decoding until the next compaction; what they write after
        # their EOS is masked by the caller
        out[rows, step] = tok
        logps[rows, step] = tok_logp
        done = done | torch.isin(tok, eos_ids)
        n_done = int(done.sum())
        if n_done == rows.shape[0] or step + 1 == max_new_tokens:
            break
        if n_done >= max(1, rows.shape[0] // COMPACT_EVERY):
            # compaction: finished rows leave the batch; the cache rows are copied once
            keep = (~done).nonzero().squeeze(1)
            rows, tok, next_pos, bias = rows[keep], tok[keep], next_pos[keep], bias[keep]
            done = done[keep]
            cache = [(k[keep], v[keep]) for k, v in cache]
        at = next_pos.unsqueeze(1)  # [active, 1]
        logits = dec.forward(
            tok[:, None], cos_t[at].unsqueeze(2), sin_t[at].unsqueeze(2), cache, p + step, bias
        )
        next_pos = next_pos + 1
    return out[:, :steps], logps[:, :steps]
