"""The files a GRPO run writes as it goes: metrics.jsonl (one line per step), completions.jsonl
(samples every K steps), checkpoints/ (engine state plus step and RNG states) and snapshots/
(the evaluated checkpoints as model directories).

Only rank 0 writes the JSONL files. On resume, both files keep only the steps up to the
checkpoint (a line torn by a kill is dropped), rewritten atomically, so a resumed run has exactly
one metrics line per step and no duplicated completions.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from grpo.engine import checkpoint
from grpo.engine.scoring import Scores

SNAPSHOTS = "snapshots"  # evaluated checkpoints as model directories (grpo.checkpoint_models)


class RunFiles:
    def __init__(self, out: Path, rank: int, keep_checkpoints: int) -> None:
        self.out, self.rank, self.keep = out, rank, keep_checkpoints
        self.ckpt_root = out / "checkpoints"
        self.metrics_path = out / "metrics.jsonl"
        self._metrics: Any = None
        self._samples: Any = None

    def open(self, engine: Any, resume: bool) -> int:
        """Restore the latest checkpoint when resuming; returns the step to start from."""
        start = 0
        if resume:
            client = checkpoint.load(engine, self.ckpt_root)
            if client is not None:
                start = int(client["step"])
                checkpoint.set_rng_state(client["rng"])
        if self.rank == 0:
            samples_path = self.out / "completions.jsonl"
            for path in (self.metrics_path, samples_path):
                trim_jsonl(path, start)
            self._metrics = self.metrics_path.open("a")
            self._samples = samples_path.open("a")
        return start

    def log_metrics(self, m: dict[str, Any]) -> None:
        if self._metrics:
            self._metrics.write(json.dumps(m) + "\n")
            self._metrics.flush()

    def log_completions(
        self, step: int, rows: list[dict], texts: list[str], scores: Scores, group_size: int
    ) -> None:
        """The first completion of every group: prompt, completion, reward, gold answer, and
        the columns reward functions added with log_extra."""
        if not self._samples:
            return
        for i in range(0, len(texts), group_size):
            rec = {"step": step, "prompt": rows[i]["prompt"], "completion": texts[i],
                   "reward": float(scores.rewards[i]), "answer": rows[i]["answer"]}  # fmt: skip
            rec.update({k: v[i] for k, v in scores.extra.items() if k not in rec})
            self._samples.write(json.dumps(rec, default=str) + "\n")
        self._samples.flush()

    def save_checkpoint(self, engine: Any, step: int, rank_state: Any = None) -> None:
        """Engine, step and RNG states; rank_state: this rank's own (rollouts sampled ahead)."""
        client = {"step": step, "rng": checkpoint.rng_state()}
        checkpoint.save(engine, self.ckpt_root, step, client, self.rank, self.keep, rank_state)

    def rank_state(self) -> Any:
        """The rank_state saved with the checkpoint `open` resumed from (None if none)."""
        return checkpoint.load_rank_state(self.ckpt_root, self.rank)

    def save_snapshot(self, engine: Any, tok: Any, step: int, zero_stage: int) -> None:
        """The policy at `step` as a model directory (snapshots/step-NNNNNN), for MLflow to log
        as a model of the run; the oldest beyond keep_checkpoints are removed, as checkpoints
        are."""
        import shutil

        from grpo.engine.deepspeed_setup import save_policy

        root = self.out / SNAPSHOTS
        save_policy(engine, tok, root / f"step-{step:06d}", self.rank, zero_stage)
        if self.rank == 0:
            for old in sorted(root.glob("step-*"))[: -self.keep]:
                shutil.rmtree(old)

    def close(self) -> None:
        for f in (self._metrics, self._samples):
            if f:
                f.close()


def trim_jsonl(path: Path, max_step: int) -> int:
    """Keep the whole lines of `path` whose "step" is at most max_step; returns how many.

    A line is whole when a newline ends it: the last one may be torn by a kill mid-write, and a
    line that does not parse is dropped too. The file is replaced atomically (a kill during the
    rewrite leaves the old file).
    """
    kept: list[bytes] = []
    if path.exists():
        *whole, _torn = path.read_bytes().split(b"\n")
        for line in whole:
            try:
                step = json.loads(line)["step"]
            except (ValueError, KeyError, TypeError):
                continue
            if isinstance(step, int) and step <= max_step:
                kept.append(line + b"\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(b"".join(kept))
    os.replace(tmp, path)
    return len(kept)
