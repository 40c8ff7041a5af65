"""Training checkpoints: DeepSpeed engine state plus our step and RNG states.

Written atomically: DeepSpeed writes under a temporary tag, rank 0 renames it and then replaces
the `latest` pointer, so a kill during the write leaves the previous checkpoint usable.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from reward_fns.errors import UserError

CLIENT_KEYS = ("step", "rng")  # the training order is a function of the step alone
# what a rank holds beyond the engine's state (asynchronous rollouts sampled ahead of the
# step), one file per rank: DeepSpeed's client state is written by rank 0 alone
RANK_STATE = "rank{rank}_state.pt"


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])


def has_frozen(module: torch.nn.Module) -> bool:
    """Whether some weights are frozen (a LoRA policy's base): a checkpoint then holds only the
    trainable ones, and a resume takes the frozen ones from the model directory it starts from,
    as the first run did (SmolLM2-135M's base is 540 MB; its r = 16 adapters are 20 MB)."""
    return any(not p.requires_grad for p in module.parameters())


def latest_tag(root: Path) -> str | None:
    p = root / "latest"
    if not p.exists():
        return None
    tag = p.read_text().strip()
    return tag if (root / tag).is_dir() else None


def save(
    engine: Any, root: Path, step: int, client: dict[str, Any], rank: int, keep: int,
    rank_state: Any = None,
) -> str:  # fmt: skip
    """Write a checkpoint of `step` under root; rank_state (this rank's own, or None) is saved
    beside the engine's and given back by load_rank_state."""
    import torch.distributed as dist

    tag = f"step{step:07d}"
    tmp = f"{tag}.tmp"
    if rank == 0 and (root / tmp).exists():
        shutil.rmtree(root / tmp)
    dist.barrier()
    try:
        engine.save_checkpoint(str(root), tag=tmp, client_state=client, save_latest=False,
                               exclude_frozen_parameters=has_frozen(engine.module))  # fmt: skip
    except (OSError, RuntimeError) as e:  # torch's zip writer reports a short write as Runtime
        shutil.rmtree(root / tmp, ignore_errors=True)
        raise CheckpointWriteError(write_failure(root, step, e)) from e
    if rank_state is not None:
        torch.save(rank_state, root / tmp / RANK_STATE.format(rank=rank))
    dist.barrier()
    if rank == 0:
        if (root / tag).exists():
            shutil.rmtree(root / tag)
        os.replace(root / tmp, root / tag)
        pointer = root / "latest.tmp"
        pointer.write_text(tag)
        os.replace(pointer, root / "latest")
        done = sorted(p for p in root.glob("step*") if p.is_dir() and not p.name.endswith(".tmp"))
        for old in done[:-keep]:
            shutil.rmtree(old)
    dist.barrier()
    return tag


class CheckpointWriteError(UserError, OSError):
    """A checkpoint could not be written (disk full, a file-size limit, permissions)."""


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MB"


def write_failure(root: Path, step: int, e: BaseException) -> str:
    """One line: what failed, the space there against what a checkpoint takes, what is kept;
    torch's own message for a full disk ("unexpected pos ...") names neither."""
    cause = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
    free = shutil.disk_usage(root).free
    prev = latest_tag(root)
    need = sum(f.stat().st_size for f in (root / prev).rglob("*") if f.is_file()) if prev else 0
    if need and free < need:
        cause = f"no space left on device: {_mb(free)} free, a checkpoint takes {_mb(need)}"
    kept = f"the checkpoint {prev} is kept" if prev else "no earlier checkpoint exists"
    return f"checkpoint of step {step} could not be written to {root} ({cause}); {kept}"


def load(engine: Any, root: Path) -> dict[str, Any] | None:
    """Restore the latest checkpoint into the engine; returns its client state, or None."""
    tag = latest_tag(root)
    if tag is None:
        return None
    path, client = engine.load_checkpoint(
        str(root), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True,
        load_module_strict=not has_frozen(engine.module),
    )  # fmt: skip
    if path is None:
        raise RuntimeError(f"{root / tag}: checkpoint could not be loaded")
    # DeepSpeed returns its own bookkeeping too; hand back only what we stored
    return {k: client[k] for k in CLIENT_KEYS if k in client}


def load_rank_state(root: Path, rank: int) -> Any:
    """This rank's state saved with the latest checkpoint, or None when it saved none."""
    tag = latest_tag(root)
    path = root / tag / RANK_STATE.format(rank=rank) if tag else None
    if path is None or not path.exists():
        return None
    return torch.load(path, weights_only=False)
