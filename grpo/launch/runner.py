"""Running a training stage (SFT reference, GRPO) in this process or as DeepSpeed ranks.

One rank runs in this process (SFT) or a child process (GRPO); with deepspeed.nproc > 1 or a
hostfile, DeepSpeed's launcher starts the ranks running `python -m grpo.launch.worker`. The CLI
and the Prefect tasks call these.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grpo.config import Config
from grpo.launch.paths import base_model_dir, reference_dir, write_config


class StageError(RuntimeError):
    """A stage (or one of its ranks) failed; the message carries the failing output."""


def _distributed(cfg: Config) -> bool:
    return cfg.deepspeed.nproc > 1 or cfg.deepspeed.hostfile is not None


def launcher_command(cfg: Config, stage: str, config_path: Path, *args: str) -> list[str]:
    """The `deepspeed` launcher command that starts the ranks of one stage."""
    ds = cfg.deepspeed
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--master_port", str(ds.master_port)]
    if ds.hostfile:
        cmd += ["--hostfile", ds.hostfile]
    else:
        cmd += ["--num_gpus", str(ds.nproc)]
    return cmd + ["--module", "grpo.launch.worker", stage, "--config", str(config_path), *args]


def run_subprocess(
    cmd: list[str], log: Callable[[str], None] = print, env: dict[str, str] | None = None
) -> None:
    """Run a command, streaming its output line by line; on failure raise with its tail."""
    # a rank's own process group settings must not leak into the ranks it starts
    dist_vars = {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    }
    inherited = {k: v for k, v in os.environ.items() if k not in dist_vars}
    full_env = {**inherited, "OMP_WAIT_POLICY": "PASSIVE", **(env or {})}
    tail: deque[str] = deque(maxlen=40)
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            log(line)
        code = proc.wait()
    if code != 0:
        errors = [ln for ln in tail if "Error" in ln or "error" in ln] or list(tail)[-10:]
        raise StageError(f"{' '.join(cmd[-6:])} exited with {code}:\n" + "\n".join(errors[-15:]))


def run_sft(cfg: Config, *, force: bool = False, log: Callable[[str], None] = print) -> Path:
    """Build the SFT reference (reused when one of the same config and data exists)."""
    out = reference_dir(cfg)
    if not cfg.sft.enabled:
        return out
    if (out / "config.json").exists() and (out / "sft_summary.json").exists() and not force:
        log(f"SFT reference cache hit: {out}")
        return out
    base = base_model_dir(cfg)
    if _distributed(cfg):
        cfg_path = write_config(cfg, out.with_name(out.name + "_config.yaml"))
        run_subprocess(launcher_command(cfg, "sft", cfg_path, "--base", str(base)), log)
    else:
        from grpo.data.sets import training_sets
        from grpo.engine.sft import train_sft

        summary = train_sft(cfg, base, out, training_sets(cfg))
        (out / "sft_summary.json").write_text(json.dumps(summary, indent=2))
    return out


def run_grpo(
    cfg: Config,
    policy_dir: Path,
    out_dir: Path,
    *,
    resume: bool = False,
    log: Callable[[str], None] = print,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """GRPO from policy_dir into out_dir (policy/, checkpoints/, metrics.jsonl)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = write_config(cfg, out_dir / "config.yaml")
    args = ["--policy", str(policy_dir), "--out", str(out_dir)] + (["--resume"] if resume else [])
    run_subprocess(
        launcher_command(cfg, "train", cfg_path, *args)
        if _distributed(cfg)
        else [
            sys.executable,
            "-m",
            "grpo.launch.worker",
            "train",
            "--config",
            str(cfg_path),
            *args,
        ],
        log,
        env,
    )
    return json.loads((out_dir / "train_summary.json").read_text())
