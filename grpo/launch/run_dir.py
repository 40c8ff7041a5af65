"""A GRPO run directory is never overwritten by accident, and a resume continues its own run.

Checked in the parent before any rank starts: a rerun of `grpo train --out O` without --resume
would truncate O/metrics.jsonl, and a later --resume would then load the old run's checkpoint
beside the new run's metrics, without a word.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from grpo.config import Config
from reward_fns.errors import UserError

# what a run writes (grpo.engine.run_files, grpo.launch.runner.run_grpo)
RUN_FILES = ("metrics.jsonl", "completions.jsonl", "checkpoints", "policy", "train_summary.json",
             "config.yaml")  # fmt: skip
# settings a resumed run may change: how often it saves, evaluates and logs, not what it learns
RESUMABLE = {"grpo.checkpoint_every", "grpo.keep_checkpoints", "grpo.log_completions_every",
             "grpo.eval_every", "grpo.eval_limit", "grpo.reward_timeout_s"}  # fmt: skip
# the sections that decide what a GRPO run learns
SAME_RUN = ("seed", "model.", "data.", "grpo.")
# a full-weight checkpoint holds the weights and AdamW's two moments, each the model's size
CHECKPOINT_COPIES = 3


class RunDirError(UserError, ValueError):
    """The run directory holds another run, or not the run a resume expects."""


def _metric_steps(path: Path) -> list[int]:
    steps = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                steps.append(int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):
                break  # a line torn by a kill: the resume drops it
    return steps


def checkpoint_step(out: Path) -> int | None:
    """The step of the run's latest checkpoint (checkpoints/latest), if any."""
    latest = out / "checkpoints" / "latest"
    if not latest.exists():
        return None
    tag = latest.read_text().strip()
    return int(tag.removeprefix("step")) if tag.startswith("step") else None


def describe(out: Path) -> str:
    steps = _metric_steps(out / "metrics.jsonl")
    ckpt = checkpoint_step(out)
    done = "finished" if (out / "train_summary.json").exists() else "unfinished"
    return f"a {done} GRPO run, {len(steps)} steps logged, " + (
        f"last checkpoint at step {ckpt}" if ckpt is not None else "no checkpoint"
    )


def prepare_run_dir(out: Path, cfg: Config, *, resume: bool, overwrite: bool) -> None:
    """Refuse an existing run unless told what to do with it (--resume or --overwrite); with
    --overwrite remove its files; with --resume check that its checkpoint, metrics and config
    are one run and that `cfg` trains the same thing."""
    if resume and overwrite:
        raise RunDirError("--resume continues a run and --overwrite deletes it: choose one")
    held = [n for n in RUN_FILES if (out / n).exists()]
    if not resume:
        if held and not overwrite:
            raise RunDirError(
                f"{out} holds {describe(out)}: add --resume to continue it, or --overwrite to "
                "delete it and start again"
            )
        for name in held if overwrite else []:
            p = out / name
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        return
    _check_resume(out, cfg)


def _check_resume(out: Path, cfg: Config) -> None:
    ckpt = checkpoint_step(out)
    steps = _metric_steps(out / "metrics.jsonl")
    if ckpt is not None and (len(steps) < ckpt or steps[:ckpt] != list(range(1, ckpt + 1))):
        raise RunDirError(
            f"{out}: the checkpoint is at step {ckpt} but metrics.jsonl holds steps "
            f"{_span(steps)}: they are not one run; --overwrite starts it again"
        )
    saved = out / "config.yaml"
    if ckpt is None or not saved.exists():
        return
    from grpo.config import load_config

    before = load_config(str(saved), []).flat()
    now = cfg.flat()
    changed = sorted(k for k in before.keys() | now.keys()
                     if k.startswith(SAME_RUN) and k not in RESUMABLE
                     and before.get(k) != now.get(k))  # fmt: skip
    if changed:
        diffs = ", ".join(f"{k} {before.get(k)!r} -> {now.get(k)!r}" for k in changed[:4])
        more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
        raise RunDirError(
            f"{out}: this config trains another run than the one it resumes ({diffs}{more}); "
            f"resume with the run's own config ({saved}) or start again with --overwrite"
        )


def _span(steps: list[int]) -> str:
    return f"{steps[0]}..{steps[-1]}" if steps else "none"


def bytes_at_least(model_bytes: int, cfg: Config) -> int:
    """The least a GRPO run from a model whose weight files take `model_bytes` holds on disk at
    once: the checkpoints present when one is written (grpo.keep_checkpoints and the new one, or
    every checkpoint of a shorter run), each CHECKPOINT_COPIES times the model when the full
    weights train (a LoRA checkpoint, the adapter's, counts as nothing), and policy/. Selected
    steps, snapshots and policy_last/ come on top.

    >>> from grpo.config import load_config
    >>> bytes_at_least(100, load_config(None, ["grpo.steps=20", "grpo.checkpoint_every=10"]))
    700
    >>> bytes_at_least(100, load_config(None, ["grpo.steps=95", "grpo.checkpoint_every=10"]))
    1000
    """
    g = cfg.grpo
    saves = len(set(range(g.checkpoint_every, g.steps + 1, g.checkpoint_every)) | {g.steps})
    each = 0 if cfg.model.lora.enabled else CHECKPOINT_COPIES * model_bytes
    return min(g.keep_checkpoints + 1, saves) * each + model_bytes


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_free_space(out: Path, policy_dir: Path, cfg: Config) -> None:
    """Refuse a GRPO run the disk under `out` cannot hold (bytes_at_least), before any rank
    starts: a full disk would otherwise end it at its first checkpoint, after the steps before
    it. What `out` already holds (a resumed run's checkpoints) counts as written."""
    model = sum(f.stat().st_size for f in Path(policy_dir).glob("*.safetensors"))
    held = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) if out.exists() else 0
    need = bytes_at_least(model, cfg) - held
    free = shutil.disk_usage(out if out.exists() else out.parent).free
    if need > free:
        raise RunDirError(
            f"{out}: {_gib(free)} free, and this run writes at least {_gib(need)} more (its "
            f"checkpoints, {CHECKPOINT_COPIES}x the {_gib(model)} model each, "
            f"grpo.keep_checkpoints={cfg.grpo.keep_checkpoints} kept, and its policy): free "
            "space there, or lower grpo.keep_checkpoints"
        )
