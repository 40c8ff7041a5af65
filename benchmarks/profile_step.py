"""Where a GRPO step's time goes: torch.profiler tables for sampling and for the update.

    .venv/bin/python benchmarks/profile_step.py [--model DIR] [--engine fast|hf] [--rows 20]

Runs 3 warm-up steps of the trainer on the tiny default (or --model), then profiles one
sampling call and one update and prints the top operators by self CPU time. Profiling adds
overhead per op: read the tables for proportions, not absolute times.
"""

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from grpo.advantages import group_advantages
    from grpo.config import load_config
    from grpo.stages import base_model_dir
    from grpo.trainer import Trainer

    p = argparse.ArgumentParser()
    p.add_argument("--model", help="model directory (default: the untrained tiny model)")
    p.add_argument("--engine", default="auto", choices=["auto", "fast", "hf"])
    p.add_argument("--rows", type=int, default=20)
    a = p.parse_args()
    out = Path(tempfile.mkdtemp(prefix="grpo-profile-"))
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [
        f"output_dir={out}", "grpo.eval_every=0", "grpo.prompts_per_step=4",
        f"model.generation_engine={a.engine}",
    ])  # fmt: skip
    t = Trainer(cfg, a.model or base_model_dir(cfg), out / "grpo")
    for step in range(3):
        ro, rows, texts = t.sample(step)
        adv = group_advantages(t.score(ro, rows, texts)[0], cfg.grpo.num_generations)
        t.update(ro, adv, None)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        ro, rows, texts = t.sample(3)
    print(f"sampling: {tuple(ro.completion_ids.shape)} completions x tokens")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows))
    adv = group_advantages(t.score(ro, rows, texts)[0], cfg.grpo.num_generations)
    trained = t.trained_rows(adv, adv.shape[0]).numel()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t.update(ro, adv, None)
    print(f"update: {trained} of {adv.shape[0]} completions have a non-zero advantage")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
