"""Loading a model directory and turning problems into prompt token ids.

Loading is safetensors-only (use_safetensors=True): a model directory never unpickles code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from grpo.config import Config

SYSTEM_PROMPT = (
    "Think step by step inside <think></think>, then give only the final answer inside "
    "<answer></answer>."
)


class ModelDirError(ValueError):
    """A model directory is missing, incomplete or has no tokenizer."""


def load_tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    p = Path(path)
    if not p.is_dir():
        raise ModelDirError(f"{p}: model directory not found")
    if not any((p / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ModelDirError(f"{p}: no tokenizer (tokenizer.json / tokenizer_config.json) found")
    tok = AutoTokenizer.from_pretrained(p)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # generation pads finished rows with it; masked out anyway
    return tok


def load_model(path: str | Path, dtype: str = "float32", trainable: bool = True) -> Any:
    from transformers import AutoModelForCausalLM

    p = Path(path)
    if not (p / "config.json").exists():
        raise ModelDirError(f"{p}: no config.json: not a Hugging Face model directory")
    model = AutoModelForCausalLM.from_pretrained(
        p, dtype=getattr(torch, dtype), use_safetensors=True
    )
    model.requires_grad_(trainable)
    return model


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


def save_model_dir(model: torch.nn.Module, tokenizer: Any, out: str | Path) -> Path:
    """A Hugging Face model directory (safetensors + tokenizer) written atomically."""
    import os
    import shutil

    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if out.exists():
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out)
    return out
