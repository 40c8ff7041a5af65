"""Turning problems into the text and token ids the model sees before its completion."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from grpo.config import Config

SYSTEM_PROMPT = (
    "Think step by step inside <think></think>, then give only the final answer inside "
    "<answer></answer>."
)


def prompt_messages(problem: str, cfg: Config) -> list[dict[str, str]]:
    """The chat messages of a problem when the model uses its chat template."""
    return [
        {"role": "system", "content": cfg.model.system_prompt or SYSTEM_PROMPT},
        {"role": "user", "content": problem},
    ]


def render_prompt(tokenizer: Any, problem: str, cfg: Config) -> str:
    """The text the model sees before its completion: plain, or the chat template."""
    if not cfg.model.chat_template:
        return problem
    messages = prompt_messages(problem, cfg)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode_prompts(
    tokenizer: Any, problems: list[str], cfg: Config, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids and attention mask [B, P]."""
    texts = [render_prompt(tokenizer, p, cfg) for p in problems]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"].to(device), enc["attention_mask"].to(device)


def prompt_token_counts(tok: Any, cfg: Config, prompts: list[str]) -> list[int]:
    """Tokens of each prompt as the model sees it (chat template included)."""
    texts = [render_prompt(tok, p, cfg) for p in prompts]
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None and backend.padding is None:
        # the Rust tokenizer alone: half the time on a million prompts, most of the rest was
        # transformers turning each encoding into Python lists (validation counts every row)
        return [len(e) for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
    return [len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]


def model_context(model_dir: str | Path) -> int | None:
    """The positions a model was built for (config.json's max_position_embeddings), if any."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    value = json.loads(path.read_text()).get("max_position_embeddings")
    return int(value) if value else None


def eval_prompt_limit(cfg: Config, context: int | None) -> int:
    """Prompt tokens evaluation can hold: the model's context less the tokens it generates
    (eval.max_new_tokens, else grpo.max_completion_length). Training prompts keep
    grpo.max_prompt_length; an evaluation set is not training data, and a long problem of
    MATH-500 should not stop the run. With no known context: grpo.max_prompt_length."""
    if context is None:
        return cfg.grpo.max_prompt_length
    return context - (cfg.eval.max_new_tokens or cfg.grpo.max_completion_length)


def split_by_prompt_length(
    tok: Any, cfg: Config, rows: list[dict], limit: int
) -> tuple[list[dict], list[dict]]:
    """(rows whose prompt fits `limit` tokens, rows left out). A prompt longer in characters
    than the limit times the longest token's spelling is left out without tokenizing it (a
    10 MB prompt costs no tokenizer memory)."""
    widest = max(len(t) for t in tok.get_vocab())
    short = [r for r in rows if len(r["prompt"]) <= limit * widest]
    counts = prompt_token_counts(tok, cfg, [r["prompt"] for r in short])
    fits = {id(r) for r, n in zip(short, counts) if n <= limit}
    return [r for r in rows if id(r) in fits], [r for r in rows if id(r) not in fits]


def left_out_line(source: str, ids: list[str], total: int, limit: int) -> str:
    """The one line that reports prompts left out of an evaluation, naming the first ids."""
    shown = ", ".join(ids[:5]) + (", ..." if len(ids) > 5 else "")
    return (f"{source}: {len(ids)} of {total} prompts are longer than the {limit} tokens "
            f"evaluation can hold, left out (ids {shown})")  # fmt: skip
