"""Turning problems into the text and token ids the model sees before its completion."""

from __future__ import annotations

from typing import Any

import torch

from grpo.config import Config

SYSTEM_PROMPT = (
    "Think step by step inside <think></think>, then give only the final answer inside "
    "<answer></answer>."
)


def render_prompt(tokenizer: Any, problem: str, cfg: Config) -> str:
    """The text the model sees before its completion: plain, or the chat template."""
    if not cfg.model.chat_template:
        return problem
    messages = [
        {"role": "system", "content": cfg.model.system_prompt or SYSTEM_PROMPT},
        {"role": "user", "content": problem},
    ]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode_prompts(
    tokenizer: Any, problems: list[str], cfg: Config, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids and attention mask [B, P]."""
    texts = [render_prompt(tokenizer, p, cfg) for p in problems]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"].to(device), enc["attention_mask"].to(device)
