"""DeepSpeed in one place: the JSON config filled from the typed config, the training engine,
the frozen reference, gathering ZeRO-3 weights, and saving the policy."""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from grpo.config import Config

# shipped inside the package (package data), so that an installed copy finds it too
TEMPLATE = "deepspeed.json"
ADAPTER_DIR = "adapter"  # a LoRA run's adapter, beside its merged policy directory


def deepspeed_config(
    cfg: Config,
    *,
    micro_batch: int,
    grad_accum: int,
    lr: float,
    weight_decay: float,
    max_grad_norm: float,
) -> dict[str, Any]:
    """grpo/engine/deepspeed.json with every 'auto' filled from the typed config and the stage's
    optimizer settings (GRPO's or SFT's)."""
    ds = json.loads(resources.files("grpo.engine").joinpath(TEMPLATE).read_text())
    ds.pop("_comment", None)
    ds["train_micro_batch_size_per_gpu"] = micro_batch
    ds["gradient_accumulation_steps"] = grad_accum
    ds["gradient_clipping"] = max_grad_norm
    ds["zero_optimization"]["stage"] = cfg.deepspeed.zero_stage
    if cfg.deepspeed.offload_optimizer:
        ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    else:
        # torch's AdamW: DeepSpeed's fused Adam needs CUDA, its CPU Adam is for offload
        ds["optimizer"]["params"]["torch_adam"] = True
    ds["optimizer"]["params"]["lr"] = lr
    ds["optimizer"]["params"]["weight_decay"] = weight_decay
    ds["bf16"]["enabled"] = cfg.model.dtype == "bfloat16"
    return ds


def build_engine(
    model: torch.nn.Module,
    cfg: Config,
    *,
    micro_batch: int,
    grad_accum: int,
    lr: float,
    weight_decay: float,
    max_grad_norm: float,
    lr_fn: Callable[[int], float],
) -> tuple[Any, dict[str, Any]]:
    """deepspeed.initialize for a trainable policy; returns (engine, the DeepSpeed config).

    lr_fn: the learning-rate multiplier per optimizer step (grpo.engine.schedules)."""
    import deepspeed
    from torch.optim.lr_scheduler import LambdaLR

    ds = deepspeed_config(
        cfg, micro_batch=micro_batch, grad_accum=grad_accum, lr=lr, weight_decay=weight_decay,
        max_grad_norm=max_grad_norm,
    )  # fmt: skip
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=copy.deepcopy(ds),
        lr_scheduler=lambda opt: LambdaLR(opt, lr_fn),
    )
    return engine, ds


def build_frozen(model: torch.nn.Module, cfg: Config) -> torch.nn.Module:
    """The frozen reference: a ZeRO-3 inference engine when sharding, else the module."""
    model.requires_grad_(False).eval()
    if cfg.deepspeed.zero_stage != 3:
        return model
    import deepspeed

    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": cfg.model.dtype == "bfloat16"},
    }
    engine, *_ = deepspeed.initialize(model=model, config=ds)
    engine.eval()
    return engine.module


def save_policy(engine: Any, tokenizer: Any, out: Path, rank: int, zero_stage: int) -> None:
    """Write the engine's model as a Hugging Face directory from rank 0 (ZeRO-3: gathered).

    A LoRA policy is written merged to `out` (it then serves and evaluates like any model),
    and its adapter alone to `adapter` beside it."""
    from grpo.models.loading import save_model_dir
    from grpo.models.lora import is_lora, save_merged_and_adapter

    with gathered(engine.module, zero_stage):
        if rank == 0 and is_lora(engine.module):
            save_merged_and_adapter(engine.module, tokenizer, out, out.parent / ADAPTER_DIR)
        elif rank == 0:
            save_model_dir(engine.module, tokenizer, out)


def gathered(model: torch.nn.Module, zero_stage: int) -> Any:
    """Under ZeRO-3, the full weights gathered on every rank for the `with` block.

    Generation runs inside one such block: fetching each layer's shards per decoding step is
    much slower (a known TRL trap).
    """
    if zero_stage != 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(model.parameters()))
