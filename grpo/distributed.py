"""DeepSpeed in one place: process group, the JSON config filled from the typed config, engines.

The same code runs as one process (no launcher: we set the env a launcher would) and as N ranks
started by `deepspeed` (GPUs, or CPU processes on a machine without one).
"""

from __future__ import annotations

import copy
import json
import math
import os
import socket
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from grpo.config import Config

INFRA = Path(__file__).resolve().parents[1] / "infra"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_s: int) -> tuple[int, int]:
    """Start (or join) the process group; returns (rank, world_size)."""
    import deepspeed
    import torch.distributed as dist

    init_method = None
    if "RANK" not in os.environ:  # a single process started without a launcher
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
        )  # fmt: skip
        # a file rendezvous: no TCP port that a neighbouring process could take first
        fd, store = tempfile.mkstemp(prefix="grpo-dist-")
        os.close(fd)
        os.remove(store)
        init_method = f"file://{store}"
    if not dist.is_initialized():
        deepspeed.init_distributed(
            timeout=timedelta(seconds=timeout_s), init_method=init_method, rank=0 if init_method
            else -1, world_size=1 if init_method else -1,
        )  # fmt: skip
    return dist.get_rank(), dist.get_world_size()


def device_for(cfg: Config) -> torch.device:
    if cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def deepspeed_config(
    cfg: Config, *, micro_batch: int, grad_accum: int, lr: float, weight_decay: float
) -> dict[str, Any]:
    """infra/deepspeed.json with every 'auto' filled from the typed config."""
    ds = json.loads((INFRA / "deepspeed.json").read_text())
    ds.pop("_comment", None)
    ds["train_micro_batch_size_per_gpu"] = micro_batch
    ds["gradient_accumulation_steps"] = grad_accum
    ds["gradient_clipping"] = cfg.grpo.max_grad_norm
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


def lr_lambda(warmup: int, total: int, schedule: str):  # noqa: ANN201 - Callable[[int], float]
    """Linear warmup then constant, linear or cosine decay to 0 at `total` optimizer steps."""

    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def time_cosine(warmup: int, seconds: float):  # noqa: ANN201 - Callable[[int], float]
    """Warmup by steps, then cosine decay over wall-clock time: a run given a time budget
    (the SFT control) anneals fully by its end, however many steps fit."""
    import time

    start: list[float] = []

    def f(step: int) -> float:
        if not start:
            start.append(time.time())
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (time.time() - start[0]) / seconds)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def build_engine(
    model: torch.nn.Module,
    cfg: Config,
    *,
    micro_batch: int,
    grad_accum: int,
    lr: float,
    weight_decay: float,
    warmup: int,
    total_steps: int,
    schedule: str,
    lr_fn: Any = None,
) -> tuple[Any, dict[str, Any]]:
    """deepspeed.initialize for a trainable policy; returns (engine, the DeepSpeed config)."""
    import deepspeed
    from torch.optim.lr_scheduler import LambdaLR

    ds = deepspeed_config(
        cfg, micro_batch=micro_batch, grad_accum=grad_accum, lr=lr, weight_decay=weight_decay
    )
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=copy.deepcopy(ds),
        lr_scheduler=lambda opt: LambdaLR(opt, lr_fn or lr_lambda(warmup, total_steps, schedule)),
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


def all_reduce_sum(values: list[float], device: torch.device, op: str = "sum") -> list[float]:
    """Element-wise sum (or "max") of a list of floats over all ranks."""
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return t.tolist()


def all_gather_objects(obj: Any) -> list[Any]:
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def save_policy(engine: Any, tokenizer: Any, out: Path, rank: int, zero_stage: int) -> None:
    """Write the engine's model as a Hugging Face directory from rank 0 (ZeRO-3: gathered)."""
    import contextlib

    from grpo.modeling import save_model_dir

    ctx: Any = contextlib.nullcontext()
    if zero_stage == 3:
        import deepspeed

        ctx = deepspeed.zero.GatheredParameters(list(engine.module.parameters()))
    with ctx:
        if rank == 0:
            save_model_dir(engine.module, tokenizer, out)


# progress bars redraw often on a terminal, but every redraw is a log line in Prefect/CI logs
BAR_INTERVAL = 0.2 if os.isatty(2) else 15.0
