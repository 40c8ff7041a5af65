"""The embedded default model: a character tokenizer and a small Qwen2, built locally.

No hub access is needed. The tokenizer is Qwen2's own class (byte-level BPE) with one token per
printable ASCII character and no merges, plus the template tags as single tokens. Being the
class that AutoTokenizer picks for a qwen2 model directory, it reloads exactly as it was built:
decode(encode(text)) == text, spaces included (tests check it after a save and reload).
"""

from __future__ import annotations

import string
from pathlib import Path

from grpo.config import TinyModelConfig

TAGS = ["<think>", "</think>", "<answer>", "</answer>"]
SPECIALS = ["<pad>", "<eos>", "<unk>"]


def build_tokenizer():  # noqa: ANN201 - returns a transformers Qwen2Tokenizer
    """Character-level tokenizer; template tags are single (non-special) tokens."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    # byte-level BPE spells each byte as a printable character (space as "\u0120"): the vocab
    # holds those spellings, so the byte-level pre-tokenizer maps every character to one token
    to_byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    spelled = [to_byte_level.pre_tokenize_str(c)[0][0] for c in chars]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + spelled)}
    tok = Qwen2Tokenizer(
        vocab=vocab, merges=[], unk_token="<unk>", eos_token="<eos>", pad_token="<pad>"
    )
    tok.add_tokens(TAGS)
    tok.padding_side = "left"
    return tok


def build_tiny_model(out_dir: str | Path, cfg: TinyModelConfig, seed: int) -> Path:
    """Write a randomly initialised tiny Qwen2 and its tokenizer to out_dir; returns the path."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils.logging import disable_progress_bar

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
    disable_progress_bar()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
