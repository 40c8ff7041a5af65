"""Memory at real size: GRPO steps of a Qwen2.5-0.5B-shaped model (random weights) on the CPU.

    .venv/bin/python benchmarks/memory.py [--steps 3] [--out benchmarks/MEMORY.md]

For 1 rank ZeRO-0, 2 ranks ZeRO-2 and 2 ranks ZeRO-3 it runs the real stage (`run_grpo`, the
DeepSpeed launcher for 2 ranks) with small groups, samples the resident memory of every rank
process every 0.2 s, and reports the peak per rank and the median seconds per step (first step
left out). fp32 (bf16 matmuls are slow on most CPUs); the model has Qwen2.5-0.5B's dimensions
and vocabulary; the tokenizer is the embedded character one (the benchmark measures memory and
time, not text). Every completion is trained on (skip_zero_advantage off), as the worst case.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
import bench_env  # noqa: E402

bench_env.prepare()  # the CLI's kernels and threads, before torch loads


CASES = [("1 rank, ZeRO-0", 1, 0), ("2 ranks, ZeRO-2", 2, 2), ("2 ranks, ZeRO-3", 2, 3)]


def build_model(out: Path) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from benchmarks.gpu_check import QWEN05B
    from grpo.models.tiny import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen2Config(**QWEN05B, bos_token_id=None, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)  # fmt: skip
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


class PeakRSS:
    """Peak resident memory of each process under a parent pid, sampled in a thread."""

    def __init__(self, interval: float = 0.2) -> None:
        self.interval, self.peaks = interval, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import psutil

        me = psutil.Process()
        while not self._stop.wait(self.interval):
            for p in me.children(recursive=True):
                try:
                    cmd = " ".join(p.cmdline())
                    if "grpo.launch.worker" in cmd:
                        self.peaks[p.pid] = max(self.peaks.get(p.pid, 0), p.memory_info().rss)
                except psutil.Error:
                    continue

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    from grpo.config import load_config
    from grpo.launch.runner import StageError, run_grpo

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "MEMORY.md"))
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="grpo-memory-"))
    model = build_model(work / "model")
    rows = []
    for name, nproc, zero in CASES:
        cfg = load_config(None, [
            f"output_dir={work}", f"deepspeed.nproc={nproc}", f"deepspeed.zero_stage={zero}",
            f"grpo.steps={a.steps}", "grpo.prompts_per_step=2", "grpo.num_generations=4",
            "grpo.max_completion_length=32", "grpo.micro_batch_size=8", "grpo.eval_every=0",
            "grpo.checkpoint_every=1000", "grpo.skip_zero_advantage=false",
            "grpo.lr_schedule=constant", "model.generation_engine=hf", "device=cpu",
        ])  # fmt: skip
        out = work / f"zero{zero}-n{nproc}"
        t0 = time.time()
        with PeakRSS() as mon:
            try:
                run_grpo(cfg, model, out, log=lambda s: None)
            except StageError as e:  # e.g. a rank killed for memory: a result, not a crash
                peaks = sorted(mon.peaks.values(), reverse=True)[:nproc]
                rows.append((name, [b / 2**30 for b in peaks], None, time.time() - t0))
                print(f"{name}: failed: {e}", flush=True)
                continue
        wall = time.time() - t0
        steps = [json.loads(x) for x in (out / "metrics.jsonl").open() if x.strip()]
        times = [r["step_time"] for r in steps[1:]] or [steps[0]["step_time"]]
        peaks = sorted(mon.peaks.values(), reverse=True)[:nproc]
        rows.append((name, [b / 2**30 for b in peaks], statistics.median(times), wall))
        print(rows[-1], flush=True)
    lines = [
        "# GRPO at Qwen2.5-0.5B size on the CPU: peak memory per rank and step time",
        "",
        "`.venv/bin/python benchmarks/memory.py` (random weights with Qwen2.5-0.5B's dimensions "
        "and 151,936-token vocabulary, 494M parameters, fp32, AdamW; 2 prompts x 4 completions "
        f"per step, completions up to 32 tokens, every completion trained on; {a.steps} steps, "
        "the first left out of the median; 2 CPU cores shared by all ranks).",
        "",
        "| ranks, ZeRO stage | peak resident memory per rank (GiB) | seconds per step (median) "
        "| stage wall time (s) |",
        "|---|---|---|---|",
    ]
    for name, peaks, step, wall in rows:
        took = f"{step:.1f}" if step is not None else "failed: a rank was killed"
        lines.append(f"| {name} | {', '.join(f'{x:.1f}' for x in peaks)} (peak seen) | {took} "
                     f"| {wall:.0f} |")  # fmt: skip
    lines += [
        "",
        "Resident memory includes the rank's Python, torch and DeepSpeed. On a GPU the weights, "
        "gradients and optimizer states move to GPU memory; "
        "`benchmarks/gpu_check.py` measures that.",
        "",
    ]
    Path(a.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
