"""LoRA policies with peft: wrapping a model, the reference as the same model with its adapters
switched off, the effective weights the fast sampler reads, and the two things a run keeps
(the merged model, which serves and evaluates like any other, and the small adapter).

peft is imported inside the functions: it costs seconds, and a run without LoRA never needs it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from grpo.config import LoRAConfig
from reward_fns.errors import UserError

ADAPTER_CONFIG = "adapter_config.json"  # peft's name: what makes a directory an adapter
EMBEDDINGS = ["embed_tokens", "lm_head"]


class AdapterDirError(UserError, ValueError):
    """An adapter directory cannot be loaded with the base it names (or was given)."""


def wrap(model: torch.nn.Module, lcfg: LoRAConfig) -> Any:
    """The model with LoRA adapters on lcfg.target_modules (B = 0, so it starts as the model).

    Only the adapters (and, with train_embeddings, the embeddings and LM head) are trainable.
    """
    from peft import LoraConfig, get_peft_model

    found = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in lcfg.target_modules if t not in found]
    if missing:
        mtype = getattr(getattr(model, "config", None), "model_type", "?")
        raise ValueError(
            f"model.lora.target_modules: {missing} not found in this {mtype} model (its linear "
            f"layers: {sorted(linear_names(model))})"
        )
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    config = LoraConfig(
        r=lcfg.r,
        lora_alpha=lcfg.alpha,
        lora_dropout=lcfg.dropout,
        target_modules=list(lcfg.target_modules),
        modules_to_save=list(EMBEDDINGS) if lcfg.train_embeddings else None,
        ensure_weight_tying=lcfg.train_embeddings and tied,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def linear_names(model: torch.nn.Module) -> set[str]:
    linears = (n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear))
    return {n.rsplit(".", 1)[-1] for n in linears}


def is_lora(model: torch.nn.Module) -> bool:
    """Whether model is a peft model (duck-typed: no peft import for a plain model)."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a peft model (its layers hold the adapters); the model
    itself otherwise."""
    return model.get_base_model() if is_lora(model) else model


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module) -> Iterator[None]:
    """The base model's forward for the `with` block: pi_ref of a LoRA policy, with no second
    copy of the weights."""
    with model.disable_adapter():
        yield


def is_fully_trained(module: torch.nn.Module) -> bool:
    """A peft wrapper of a module trained in full (modules_to_save: train_embeddings)."""
    return hasattr(module, "modules_to_save") and hasattr(module, "original_module")


def fully_trained_modules(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    return (m for m in model.modules() if is_fully_trained(m))


def effective_weight(module: torch.nn.Module) -> torch.Tensor:
    """What a layer computes with, as one tensor: W + (alpha / r) * B @ A for a LoRA linear
    with its adapters on; the active copy for a fully trained (modules_to_save) module; the
    weight itself otherwise. The fast sampler merges once per generate call this way: a
    rank-r product per layer costs far less than adding two thin matmuls to every token."""
    if is_fully_trained(module):
        return effective_weight(_saved_module(module))
    if not (hasattr(module, "base_layer") and hasattr(module, "lora_A")):
        return module.weight
    w = module.base_layer.weight
    if module.disable_adapters or module.merged:
        return w
    for name in module.active_adapters:
        if name not in module.lora_A:
            continue
        a, b = module.lora_A[name].weight, module.lora_B[name].weight  # [r, in], [out, r]
        w = w + (b @ a).to(w.dtype) * module.scaling[name]
    return w


def linear_adapters(
    model: torch.nn.Module,
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor, float]]:
    """(layer name in the base model, A [r, in], B [out, r], scale) of every active LoRA
    adapter of a peft model: what an engine that applies the adapters itself needs."""
    for name, module in base_model(model).named_modules():
        if not (hasattr(module, "base_layer") and hasattr(module, "lora_A")):
            continue
        if module.disable_adapters or module.merged:
            continue
        for adapter in module.active_adapters:
            if adapter in module.lora_A:
                yield (name, module.lora_A[adapter].weight, module.lora_B[adapter].weight,
                       float(module.scaling[adapter]))  # fmt: skip


def effective_bias(module: torch.nn.Module) -> torch.Tensor | None:
    if is_fully_trained(module):
        module = _saved_module(module)
    layer = module.base_layer if hasattr(module, "base_layer") else module
    return getattr(layer, "bias", None)


def _saved_module(wrapper: torch.nn.Module) -> torch.nn.Module:
    if wrapper.disable_adapters:
        return wrapper.original_module
    active = [a for a in wrapper.active_adapters if a in wrapper.modules_to_save]
    return wrapper.modules_to_save[active[0]] if active else wrapper.original_module


def parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    """Trainable and total parameters (what LoRA saves: the optimizer holds the first)."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return {"trainable": trainable, "total": total}


def save_merged_and_adapter(model: Any, tokenizer: Any, policy: Path, adapter: Path) -> None:
    """The merged model (W + scale * B @ A: a plain transformers directory that serves and
    evaluates unchanged) to `policy`, and the adapter alone to `adapter`. The training model
    is left as it was: its adapters are merged into a copy of the weights."""
    import copy

    from grpo.models.loading import save_model_dir

    model.save_pretrained(adapter, safe_serialization=True)
    tokenizer.save_pretrained(adapter)  # an adapter directory evaluates on its own
    _record_base(adapter)
    merged = copy.deepcopy(model).merge_and_unload()
    save_model_dir(merged, tokenizer, policy)


def _record_base(adapter: Path) -> None:
    """peft writes the base model's path as it was loaded (maybe relative); record it as an
    absolute path, so that `grpo evaluate --model adapter/` finds its base from anywhere."""
    p = adapter / ADAPTER_CONFIG
    cfg = json.loads(p.read_text())
    base = cfg.get("base_model_name_or_path")
    if base and Path(base).exists():
        cfg["base_model_name_or_path"] = str(Path(base).resolve())
        p.write_text(json.dumps(cfg, indent=2))


def is_adapter_dir(path: str | Path) -> bool:
    p = Path(path)
    return (p / ADAPTER_CONFIG).is_file() and not (p / "config.json").is_file()


def adapter_base(adapter: str | Path) -> str | None:
    """The base model directory an adapter directory names (peft's base_model_name_or_path)."""
    p = Path(adapter) / ADAPTER_CONFIG
    try:
        return json.loads(p.read_text()).get("base_model_name_or_path")
    except (OSError, json.JSONDecodeError) as e:
        raise AdapterDirError(f"{p}: cannot read the adapter config: {e}") from e


def load_merged(
    adapter: str | Path, base: str | Path | None, dtype: str = "float32"
) -> torch.nn.Module:
    """A model from an adapter directory and its base (given, or the one the adapter names),
    with the adapter merged into the weights."""
    from peft import PeftModel

    from grpo.models.loading import load_model

    base = base or adapter_base(adapter)
    if not base:
        raise AdapterDirError(
            f"{adapter}: an adapter directory names no base model; pass its base (--base DIR)"
        )
    if not Path(base).is_dir():
        raise AdapterDirError(
            f"{adapter}: its base model {base} is not a directory here; pass it (--base DIR)"
        )
    model = load_model(base, dtype, trainable=False)
    try:
        peft_model = PeftModel.from_pretrained(model, str(adapter))
    except (ValueError, RuntimeError, KeyError) as e:  # shapes or module names disagree
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise AdapterDirError(f"{adapter}: does not fit the base model {base}: {first}") from e
    return peft_model.merge_and_unload()
