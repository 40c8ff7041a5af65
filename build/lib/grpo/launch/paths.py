"""Where a config's models live: the base model, the cached SFT reference, a written config."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path

import yaml

from grpo.config import Config

ERROR_DIR = "GRPO_ERROR_DIR"  # environment: where a failing rank writes its error (worker.py)


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock held for the `with` block, across processes (two pipelines building
    the same cached model, or creating the same sqlite store, wait for each other)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def base_model_dir(cfg: Config) -> Path:
    """The model SFT starts from: model.path, or the tiny model built into the run directory."""
    if cfg.model.path:
        return Path(cfg.model.path)
    from grpo.models.tiny import build_tiny_model

    out = Path(cfg.output_dir) / "base" / f"tiny-{cfg.digest('model')}-s{cfg.seed}"
    with file_lock(out.with_name(out.name + ".lock")):
        if not (out / "config.json").exists():
            build_tiny_model(out, cfg.model.tiny, cfg.seed)
    return out


def reference_dir(cfg: Config) -> Path:
    """Where the SFT reference of this config lives (model.path itself when SFT is off)."""
    if not cfg.sft.enabled:
        return Path(cfg.model.path or "")
    key = cfg.digest("model", "data", "sft", "seed")
    return Path(cfg.output_dir) / "sft" / key


def write_config(cfg: Config, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return path
