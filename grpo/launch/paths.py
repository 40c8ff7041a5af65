"""Where a config's models live: the base model, the cached SFT reference, a written config."""

from __future__ import annotations

from pathlib import Path

import yaml

from grpo.config import Config


def base_model_dir(cfg: Config) -> Path:
    """The model SFT starts from: model.path, or the tiny model built into the run directory."""
    if cfg.model.path:
        return Path(cfg.model.path)
    from grpo.models.tiny import build_tiny_model

    out = Path(cfg.output_dir) / "base" / f"tiny-{cfg.digest('model')}-s{cfg.seed}"
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
