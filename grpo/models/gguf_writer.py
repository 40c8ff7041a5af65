"""The policy's weights as a GGUF file that llama.cpp runs, rewritten in place as they train.

`write_gguf` writes a Llama or Qwen2 model (float32, or float16 matrices) with its tokenizer's
vocabulary; the returned `GGUFWeights` knows where each tensor's bytes lie in the file, and
`sync(model)` copies the current weights there. llama.cpp maps the file (shared, read-only) and
its CPU backend computes on the mapped float32/float16 tensors directly, so a sync is one copy
of the weights into the page cache and the engine sees them at its next decode: no reload, no
second file (tests/integration/test_llamacpp_rollouts.py checks the engine's log-probs after a
sync).

llama.cpp's "llama" architecture rotates query/key pairs interleaved where Hugging Face's Llama
rotates halves, so q_proj and k_proj rows are permuted on the way, as llama.cpp's own converter
does; its "qwen2" architecture rotates halves like Hugging Face, and takes the weights as they
are. A LoRA policy's base weights are written once and its adapters as an adapter file of their
own (`write_lora_gguf`), which llama.cpp loads and applies: a sync is then the adapters alone.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grpo.models.lora import base_model, effective_bias, effective_weight, linear_adapters

ARCHITECTURES = {"llama": "LLAMA", "qwen2": "QWEN2"}  # model_type -> gguf.MODEL_ARCH member
DTYPES = {"float32": torch.float32, "float16": torch.float16}


class GGUFExportError(ValueError):
    """The model cannot be written as a GGUF that llama.cpp runs the same way."""


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why this model cannot be written exactly, or None when it can."""
    cfg = base_model(model).config
    if cfg.model_type not in ARCHITECTURES:
        return f"model_type {cfg.model_type!r} is not one of {tuple(ARCHITECTURES)}"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        return f"rope scaling {rope.get('rope_type', rope.get('type'))!r} is not written"
    if getattr(cfg, "use_sliding_window", False):
        return "sliding-window attention is not written"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} (only silu)"
    return None


def rope_theta(cfg: Any) -> float:
    """The rotary base, wherever this transformers version keeps it."""
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(params.get("rope_theta") or getattr(cfg, "rope_theta", None) or 10000.0)


def permute_rotary(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Rows of q_proj/k_proj from rotate-half order (Hugging Face) to interleaved pairs
    (llama.cpp's llama architecture), head by head.

    >>> permute_rotary(torch.arange(4.0).view(4, 1), 1).view(-1).tolist()
    [0.0, 2.0, 1.0, 3.0]
    """
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def policy_tensors(
    model: torch.nn.Module, merged: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) of every weight the forward computes with; a LoRA layer's
    is its merged weight, or its base weight with merged=False (the adapters then go to the
    engine apart, write_lora_gguf). lm_head is left out when tied to the embeddings."""
    m = base_model(model)
    tied = bool(getattr(m.config, "tie_word_embeddings", False))
    seen = set()
    for name, module in m.named_modules():
        if any(name.startswith(s + ".") for s in seen):
            continue  # the parts of a LoRA layer (base_layer, lora_A, ...)
        layer = isinstance(module, torch.nn.Linear | torch.nn.Embedding)
        if layer or hasattr(module, "base_layer"):
            seen.add(name)
            if tied and name == "lm_head":
                continue
            base = hasattr(module, "base_layer") and not merged
            yield f"{name}.weight", module.base_layer.weight if base else effective_weight(module)
            bias = effective_bias(module) if not isinstance(module, torch.nn.Embedding) else None
            if bias is not None:
                yield f"{name}.bias", bias
            continue
        for pname, p in module.named_parameters(recurse=False):
            yield f"{name}.{pname}", p


def _vocabulary(tok: Any, n_vocab: int) -> tuple[list[str], list[int], list[str]]:
    """Token texts, types and merges for llama.cpp's byte-level BPE vocabulary ("gpt2"): the
    engine is given token ids and never tokenizes, but llama.cpp loads the vocabulary with the
    model and checks its size against the embedding's rows (padded with unused tokens)."""
    import gguf

    texts = tok.convert_ids_to_tokens(list(range(len(tok))))
    special, added = set(tok.all_special_ids), set(tok.get_added_vocab().values())
    types = [
        gguf.TokenType.CONTROL if i in special
        else gguf.TokenType.USER_DEFINED if i in added else gguf.TokenType.NORMAL
        for i in range(len(texts))
    ]  # fmt: skip
    if len(texts) > n_vocab:
        raise GGUFExportError(f"the tokenizer has {len(texts)} tokens, the embedding {n_vocab}")
    texts += [f"[PAD{i}]" for i in range(len(texts), n_vocab)]
    types += [gguf.TokenType.UNUSED] * (n_vocab - len(types))
    model = json.loads(tok.backend_tokenizer.to_str()).get("model", {})
    merges = [" ".join(m) if isinstance(m, list) else m for m in model.get("merges", [])]
    return texts, [int(t) for t in types], merges


@dataclass
class _Slot:
    offset: int  # bytes from the start of the file
    shape: tuple[int, ...]
    dtype: torch.dtype
    prepare: Callable[[torch.Tensor], torch.Tensor]  # HF layout -> GGUF layout

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * torch.empty(0, dtype=self.dtype).element_size()


class GGUFWeights:
    """A written GGUF file and where each of the policy's tensors lies in it."""

    def __init__(self, path: Path, slots: dict[str, _Slot], merged: bool = True) -> None:
        self.path, self.slots, self.merged = path, slots, merged
        self._map = np.memmap(path, dtype=np.uint8, mode="r+")

    @torch.no_grad()
    def sync(self, model: torch.nn.Module) -> int:
        """Copy `model`'s current weights into the file, in place; returns the bytes written.

        Not flushed to disk: llama.cpp reads the same page cache through its mapping."""
        written = 0
        for name, t in policy_tensors(model, self.merged):
            slot = self.slots[name]
            view = self._map[slot.offset : slot.offset + slot.nbytes]
            torch.from_numpy(view).view(slot.dtype).view(slot.shape).copy_(slot.prepare(t))
            written += slot.nbytes
        return written

    def close(self) -> None:
        del self._map


def _layout(model: torch.nn.Module) -> tuple[Any, Any, Callable[[str, torch.Tensor], torch.Tensor]]:
    """(gguf architecture, its tensor-name map, f(HF name, tensor) -> the rows GGUF wants)."""
    import gguf

    cfg = base_model(model).config
    arch = getattr(gguf.MODEL_ARCH, ARCHITECTURES[cfg.model_type])
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}

    def rows(name: str, t: torch.Tensor) -> torch.Tensor:
        """q_proj/k_proj rows (of a weight, a bias or a LoRA B, whose rows are its layer's
        output rows) permuted for llama.cpp's llama architecture."""
        module = name.split(".")[-2]
        if cfg.model_type == "llama" and module in heads:  # weights, biases and LoRA B
            return permute_rotary(t.detach(), heads[module])
        return t.detach()

    return arch, gguf.get_tensor_name_map(arch, cfg.num_hidden_layers), rows


def write_gguf(
    model: torch.nn.Module, tok: Any, path: str | Path, dtype: str, merged: bool = True
) -> GGUFWeights:
    """Write `model` (Llama or Qwen2 family) and `tok`'s vocabulary as a GGUF file at `path`.

    dtype: "float32", or "float16" for the 2-D matrices (norms and biases stay float32, as
    llama.cpp's converter writes them). merged: a LoRA policy's adapters merged into its
    weights, or (False) its base weights alone, for an engine that takes the adapters apart.
    Returns the file's GGUFWeights, for syncing in place.
    """
    import gguf

    if (reason := unsupported_reason(model)) is not None:
        raise GGUFExportError(f"the llama.cpp engine cannot run this model: {reason}")
    cfg = base_model(model).config
    arch, names, rows = _layout(model)
    path = Path(path)
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_head
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(rope_theta(cfg))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "float32"
                    else gguf.LlamaFileType.MOSTLY_F16)  # fmt: skip
    tensors = dict(policy_tensors(model, merged))
    n_vocab = tensors["model.embed_tokens.weight"].shape[0]
    texts, types, merges = _vocabulary(tok, n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(texts)
    w.add_token_types(types)
    # llama.cpp refuses a BPE vocabulary without the merges key, and gguf writes no key for an
    # empty list: a merge-free tokenizer (the tiny model's) gets one empty entry, never used
    w.add_token_merges(merges or [""])
    for key, value in (("eos", tok.eos_token_id), ("bos", tok.bos_token_id),
                       ("pad", tok.pad_token_id)):  # fmt: skip
        if value is not None:
            getattr(w, f"add_{key}_token_id")(value)
    slots: dict[str, _Slot] = {}
    gguf_names: dict[str, str] = {}
    for name, t in tensors.items():
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise GGUFExportError(f"{name}: no GGUF name for this tensor of {cfg.model_type}")
        to = DTYPES[dtype] if t.dim() == 2 else torch.float32
        # the offset is known once the file is written
        slots[name] = _Slot(0, tuple(t.shape), to, lambda x, name=name, to=to: rows(name, x).to(to))
        gguf_names[name] = new
        w.add_tensor(new, slots[name].prepare(t).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    # where each tensor landed: GGUF aligns them, so read the offsets back rather than guess
    reader = gguf.GGUFReader(path)
    at = {t.name: int(t.data_offset) for t in reader.tensors}
    for name, slot in slots.items():
        slot.offset = at[gguf_names[name]]
    del reader
    return GGUFWeights(path, slots, merged)


def write_lora_gguf(model: torch.nn.Module, path: str | Path) -> int:
    """Write a LoRA policy's adapters as a llama.cpp adapter file at `path` (float32); returns
    its size in bytes. llama.cpp scales B @ A by alpha / r, so alpha is written as the
    adapters' own scale times r: the engine then computes what peft does."""
    import gguf

    arch, names, rows = _layout(model)
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    scales = set()
    for name, a, b, scale in linear_adapters(model):
        new = names.get_name(f"{name}.weight", try_suffixes=(".weight",))
        if new is None:
            raise GGUFExportError(f"{name}: no GGUF name for this adapted layer")
        w.add_tensor(f"{new}.lora_a", a.detach().float().contiguous().numpy())
        w.add_tensor(f"{new}.lora_b", rows(f"{name}.weight", b).float().contiguous().numpy())
        scales.add((scale, a.shape[0]))
    if len(scales) != 1:
        raise GGUFExportError(f"the adapters' scales differ ({sorted(scales)}): llama.cpp "
                              "takes one per adapter file")  # fmt: skip
    scale, r = scales.pop()
    w.add_float32("adapter.lora.alpha", float(scale * r))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path).stat().st_size
