"""Sampling G completions per prompt in one batched call, with sampling log-probs.

Two engines: grpo.models.sampler ("fast", the default for Qwen2/Llama-family models, several
times less Python per token) and transformers generate() ("hf") for every other architecture.
Under ZeRO-3 the caller gathers the weights around the call (grpo.engine.deepspeed_setup).

Both record log pi(token) under softmax(logits / T) while sampling, so mu > 1 needs no extra
forward pass to know pi_old. With generate() a logits processor does it; custom processors run
before transformers' temperature/top-k/top-p warpers, so the recorded value is the quantity the
trainer computes (TRL does the same; top-k/top-p truncation is not part of pi's log-prob).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from grpo.algo.logprobs import token_logprobs, truncated_token_logprobs
from grpo.models import sampler


@dataclass
class Rollout:
    """B = prompts x group_size completions; rows of one prompt are contiguous."""

    prompt_ids: torch.Tensor  # [N, P] left-padded
    prompt_mask: torch.Tensor  # [N, P]
    completion_ids: torch.Tensor  # [N, C] pad after EOS
    completion_mask: torch.Tensor  # [N, C] 1 up to and including EOS
    truncated: torch.Tensor  # [N] bool: no EOS within max_completion_length
    sampling_logps: torch.Tensor  # [N, C] log pi_old of each sampled token (0 where masked)
    group_size: int  # G: completions per prompt
    # multi-turn episodes (grpo.env): 1 where the model wrote the token, 0 for the tool
    # responses between its turns, which only the attention sees; and each token's turn
    model_mask: torch.Tensor | None = None  # [N, C]
    turn: torch.Tensor | None = None  # [N, C] the model turn a token belongs to (from 1)

    def select(self, idx: torch.Tensor) -> Rollout:
        """The rows idx, which must be whole groups (or a rank's share of whole groups)."""
        if idx.numel() % self.group_size:
            raise ValueError(f"idx: {idx.numel()} rows are not whole groups of {self.group_size}")
        return self._map(lambda t: t[idx])

    def to(self, device: torch.device | str) -> Rollout:
        """The same rollout with every tensor on `device`."""
        return self._map(lambda t: t.to(device))

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Rollout:
        tensors = {
            f.name: None if getattr(self, f.name) is None else fn(getattr(self, f.name))
            for f in fields(self) if f.name != "group_size"
        }  # fmt: skip
        return Rollout(**tensors, group_size=self.group_size)

    @property
    def trained_mask(self) -> torch.Tensor:
        """The tokens a loss may count [N, C]: the completion's, less tool responses."""
        if self.model_mask is None:
            return self.completion_mask
        return self.completion_mask * self.model_mask

    @property
    def lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(1)  # [N]

    @property
    def num_groups(self) -> int:
        return self.completion_ids.shape[0] // self.group_size


class _LogpRecorder:
    """Logits processor that records log pi(chosen token) one step late (when it is known)."""

    def __init__(self, temperature: float, top_k: int = 0, top_p: float = 1.0) -> None:
        self.temperature = temperature
        # the truncation generate() samples with: the log-prob recorded is over what it kept
        self.top_k, self.top_p = top_k, top_p
        self.prev: torch.Tensor | None = None  # [B, V] raw logits of the previous step
        self.logps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.prev is not None:
            self.finish(input_ids[:, -1])
        self.prev = scores.detach()
        return scores

    def finish(self, chosen: torch.Tensor) -> None:
        assert self.prev is not None
        if self.top_k or self.top_p < 1.0:
            lp, _ = truncated_token_logprobs(self.prev.unsqueeze(1), chosen.unsqueeze(1),
                                             self.temperature, self.top_k, self.top_p)  # fmt: skip
        else:
            lp = token_logprobs(self.prev.unsqueeze(1), chosen.unsqueeze(1), self.temperature)
        self.logps.append(lp.squeeze(1))


def completion_mask(
    ids: torch.Tensor, eos_ids: int | list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask of tokens up to and including the first EOS (any of eos_ids), and whether no EOS
    was produced.

    >>> completion_mask(torch.tensor([[5, 2, 0], [5, 6, 7], [3, 9, 2]]), eos_ids=[2, 3])
    (tensor([[1, 1, 0],
            [1, 1, 1],
            [1, 0, 0]]), tensor([False,  True, False]))
    """
    is_eos = torch.isin(ids, torch.tensor(eos_ids, device=ids.device).view(-1))  # [N, C]
    has_eos = is_eos.any(1)
    first = torch.where(has_eos, is_eos.int().argmax(1), ids.shape[1])  # [N]
    pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)  # [1, C]
    return (pos <= first.unsqueeze(1)).long(), ~has_eos


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    num_generations: int,
    max_completion_length: int,
    eos_token_id: int | list[int],
    pad_token_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    do_sample: bool = True,
    engine: str = "auto",
) -> Rollout:
    """G completions for each of the B0 left-padded prompts -> a Rollout of B0 * G rows.

    Rows of one prompt are contiguous (the layout group_advantages expects). eos_token_id: every
    id that ends a completion (models.loading.eos_token_ids); the first EOS ends the mask.
    engine: "fast" (grpo.models.sampler), "hf" (transformers generate) or "auto" (fast when
    the architecture is supported, see resolve_engine).
    """
    ids = prompt_ids.repeat_interleave(num_generations, 0)  # [N, P]: each prompt G times
    mask = prompt_mask.repeat_interleave(num_generations, 0)
    was_training = model.training
    model.eval()
    fast = resolve_engine(model, engine) == "fast"
    sample = sampler.sample if fast else _hf_generate
    comp, logps = sample(
        model, prompt_ids, prompt_mask, max_new_tokens=max_completion_length,
        eos_token_id=eos_token_id, pad_token_id=pad_token_id, temperature=temperature,
        top_p=top_p, top_k=top_k, do_sample=do_sample, num_generations=num_generations,
    )  # fmt: skip
    model.train(was_training)
    cmask, truncated = completion_mask(comp, eos_token_id)
    comp = comp.masked_fill(cmask == 0, pad_token_id)
    return Rollout(ids, mask, comp, cmask, truncated, logps * cmask, num_generations)


def resolve_engine(model: torch.nn.Module, engine: str) -> str:
    """ "fast" or "hf" for this model; "fast" on an unsupported architecture is an error.

    "auto" picks the fast sampler for a supported architecture on the CPU only: it has been
    compared with transformers (log-probs, greedy tokens) on the CPU, not yet on a GPU
    (benchmarks/gpu_check.py does that comparison; "fast" asks for it explicitly).
    """
    if engine not in ("auto", "fast", "hf"):
        raise ValueError(f"generation engine: expected auto, fast or hf, got {engine!r}")
    if engine == "hf":
        return "hf"
    reason = sampler.unsupported_reason(model)
    if engine == "fast":
        if reason is not None:
            raise ValueError(f"generation engine 'fast' cannot run this model: {reason}")
        return "fast"
    on_cpu = next(model.parameters()).device.type == "cpu"
    return "fast" if reason is None and on_cpu else "hf"


@torch.no_grad()
def _hf_generate(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_token_id: int | list[int],
    pad_token_id: int,
    temperature: float,
    top_p: float,
    top_k: int,
    do_sample: bool,
    num_generations: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """sampler.sample's contract with transformers generate(): completions [B*G, C] and the
    log-prob of each sampled token."""
    from transformers import GenerationConfig, LogitsProcessorList

    recorder = _LogpRecorder(temperature, top_k if do_sample else 0,
                             top_p if do_sample else 1.0)  # fmt: skip
    gen_cfg = GenerationConfig(
        do_sample=do_sample,
        temperature=temperature if do_sample else None,
        top_p=top_p if do_sample else None,
        top_k=top_k if do_sample else None,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        use_cache=True,
    )
    ids = prompt_ids.repeat_interleave(num_generations, 0)
    out = model.generate(
        input_ids=ids,
        attention_mask=prompt_mask.repeat_interleave(num_generations, 0),
        generation_config=gen_cfg,
        logits_processor=LogitsProcessorList([recorder]),
    )
    comp = out[:, ids.shape[1] :]  # [N, C]
    if comp.shape[1] > 0:
        recorder.finish(comp[:, -1])
    logps = torch.stack(recorder.logps, 1) if recorder.logps else torch.zeros_like(comp).float()
    return comp, logps
