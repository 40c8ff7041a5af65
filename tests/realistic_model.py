"""A real model's path without downloading one: a Qwen2.5-shaped model directory built locally.

- a byte-level BPE tokenizer trained with `tokenizers` on GSM8K train text, with Qwen2's
  pre-tokenizer (digits split one by one), saved as Qwen2's own tokenizer class;
- Qwen2.5's chat template (<|im_start|>/<|im_end|>, a default system prompt);
- a generation config with two EOS ids, <|im_end|> then <|endoftext|>, as Qwen2.5-Instruct has;
- a randomly initialised Qwen2ForCausalLM of small width.

Also a GPT-2-style BPE (digit runs merged into one token) for the offset tests.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def gsm8k_texts(split: str = "train", n: int | None = None) -> list[str]:
    rows = [json.loads(x) for x in (ROOT / "data" / "gsm8k" / f"{split}.jsonl").open()][:n]
    return [t for r in rows for t in (r["question"], r["answer"])]


def _train_bpe(texts: list[str], vocab_size: int, qwen_split: bool):  # noqa: ANN202
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tk = Tokenizer(models.BPE())
    if qwen_split:
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])  # fmt: skip
    else:  # GPT-2's split: runs of digits stay together and merge
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tk.train_from_iterator(texts, trainer)
    return tk


def qwen_like_tokenizer(vocab_size: int = 3000):  # noqa: ANN201
    """Qwen2Tokenizer over a BPE trained on GSM8K train: what AutoTokenizer reloads it as."""
    from transformers import Qwen2Tokenizer

    tk = _train_bpe(gsm8k_texts(), vocab_size, qwen_split=True)
    model = json.loads(tk.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Qwen2Tokenizer(
        vocab=model["vocab"], merges=merges, unk_token=None, eos_token="<|im_end|>",
        pad_token="<|endoftext|>", bos_token=None,
    )  # fmt: skip
    tok.chat_template = CHAT_TEMPLATE
    return tok


def digit_merging_tokenizer(vocab_size: int = 2000):  # noqa: ANN201
    """A GPT-2-style byte-level BPE: numbers such as "13" or "100" become single tokens."""
    from transformers import PreTrainedTokenizerFast

    tk = _train_bpe(gsm8k_texts(n=3000), vocab_size, qwen_split=False)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>")


def build_realistic_model(out: Path, hidden_size: int = 64, num_layers: int = 2) -> Path:
    """Save a Qwen2.5-shaped model directory (random weights) to out; returns out."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tok = qwen_like_tokenizer()
    im_end, eot = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=2 * hidden_size,
        max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=im_end, pad_token_id=eot,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=[im_end, eot], pad_token_id=eot, bos_token_id=None
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
