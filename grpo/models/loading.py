"""Loading and saving a Hugging Face model directory.

Loading is safetensors-only (use_safetensors=True): a model directory never unpickles code.
Saving is atomic: a directory is written under a temporary name and renamed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from grpo.config import Config
from reward_fns.errors import UserError


def device_for(cfg: Config) -> torch.device:
    """Where this process runs its model: the CPU, or the GPU of its local rank."""
    if cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


class ModelDirError(UserError, ValueError):
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


def _quiet_transformers() -> None:
    """No per-file progress bars from transformers: the stages log their own progress, and
    SFT saves its best checkpoint many times (each bar is lines in a log file)."""
    from transformers.utils import logging

    logging.disable_progress_bar()


def load_model(path: str | Path, dtype: str = "float32", trainable: bool = True) -> Any:
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    p = Path(path)
    if not (p / "config.json").exists():
        raise ModelDirError(f"{p}: no config.json: not a Hugging Face model directory")
    model = AutoModelForCausalLM.from_pretrained(
        p, dtype=getattr(torch, dtype), use_safetensors=True
    )
    model.requires_grad_(trainable)
    return model


def eos_token_ids(tokenizer: Any, model: Any) -> list[int]:
    """Every id that ends a completion: the tokenizer's EOS first (SFT appends it), then those of
    the model's generation config (Qwen2.5-Instruct lists <|im_end|> and <|endoftext|>, Llama-3
    several)."""
    ids = [tokenizer.eos_token_id]
    gen = getattr(model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None)
    for i in extra if isinstance(extra, (list, tuple)) else [extra]:
        if i is not None and i not in ids:
            ids.append(int(i))
    return ids


def save_model_dir(model: torch.nn.Module, tokenizer: Any, out: str | Path) -> Path:
    """A Hugging Face model directory (safetensors + tokenizer) written atomically."""
    import os
    import shutil

    _quiet_transformers()
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
