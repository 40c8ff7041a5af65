"""The files a GRPO run writes as it goes: metrics.jsonl (one line per step), completions.jsonl
(samples every K steps), and checkpoints/ (engine state plus step and RNG states).

Only rank 0 writes the JSONL files. On resume, metrics.jsonl keeps only the steps up to the
checkpoint, so a resumed run has exactly one line per step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from grpo.engine import checkpoint


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
            kept = []
            if start and self.metrics_path.exists():  # drop lines of steps after the checkpoint
                kept = [ln for ln in self.metrics_path.read_text().splitlines()
                        if ln and json.loads(ln)["step"] <= start]  # fmt: skip
            self.metrics_path.write_text("".join(ln + "\n" for ln in kept))
            self._metrics = self.metrics_path.open("a")
            self._samples = (self.out / "completions.jsonl").open("a")
        return start

    def log_metrics(self, m: dict[str, Any]) -> None:
        if self._metrics:
            self._metrics.write(json.dumps(m) + "\n")
            self._metrics.flush()

    def log_completions(
        self, step: int, rows: list[dict], texts: list[str], rewards: torch.Tensor, group_size: int
    ) -> None:
        """The first completion of every group: prompt, completion, reward, gold answer."""
        if not self._samples:
            return
        for i in range(0, len(texts), group_size):
            rec = {"step": step, "prompt": rows[i]["prompt"], "completion": texts[i],
                   "reward": float(rewards[i]), "answer": rows[i]["answer"]}  # fmt: skip
            self._samples.write(json.dumps(rec) + "\n")
        self._samples.flush()

    def save_checkpoint(self, engine: Any, step: int) -> None:
        client = {"step": step, "rng": checkpoint.rng_state()}
        checkpoint.save(engine, self.ckpt_root, step, client, self.rank, self.keep)

    def close(self) -> None:
        for f in (self._metrics, self._samples):
            if f:
                f.close()
