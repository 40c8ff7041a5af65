"""The embedded default model: a character tokenizer and a small Qwen2, built locally.

No hub access is needed: the tokenizer is a `tokenizers` WordLevel model over printable ASCII
plus the template tags as single tokens, saved with save_pretrained so that every later stage
loads it exactly like a real model directory (AutoTokenizer / AutoModelForCausalLM).
"""

from __future__ import annotations

import string
from pathlib import Path

from grpo.config import TinyModelConfig

TAGS = ["<think>", "</think>", "<answer>", "</answer>"]
SPECIALS = ["<pad>", "<eos>", "<unk>"]


def build_tokenizer():  # noqa: ANN201 - returns a transformers PreTrainedTokenizerFast
    """Character-level tokenizer; template tags are single (non-special) tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    tok.add_tokens(TAGS)
    tok.padding_side = "left"
    return tok


def build_tiny_model(out_dir: str | Path, cfg: TinyModelConfig, seed: int) -> Path:
    """Write a randomly initialised tiny Qwen2 and its tokenizer to out_dir; returns the path."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    tok = build_tokenizer()
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    model = Qwen2ForCausalLM(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
