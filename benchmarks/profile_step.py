"""Where a GRPO step's time goes: torch.profiler tables for sampling and for the update.

    .venv/bin/python benchmarks/profile_step.py [--model DIR] [--engine fast|hf] [--rows 20]

Runs 3 warm-up steps of the trainer on the tiny default (or --model), then profiles one
sampling call and one update and prints the top operators by self CPU time. Profiling adds
overhead per op: read the tables for proportions, not absolute times.
"""

import argparse
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
import bench_env  # noqa: E402

bench_env.prepare()  # the CLI's kernels and threads, before torch loads


def main() -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from grpo.config import load_config
    from grpo.engine.loop import Trainer
    from grpo.engine.sampling import keep_groups, sample_step
    from grpo.engine.scoring import token_advantages
    from grpo.engine.update import trained_rows
    from grpo.launch.paths import base_model_dir

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

    def sample(step: int):  # noqa: ANN202
        """(rollout, advantages) of one step: sampling and scoring, then the advantages."""
        sampled = sample_step(t.engine.module, t.tok, cfg, t.train_rows, t.scorer, step=step,
                              rank=0, world=1, device=t.device, eos_ids=t.eos_ids)  # fmt: skip
        ro, scores, texts, rows = keep_groups(sampled, t.local_prompts, cfg.grpo)
        return ro, token_advantages(cfg.grpo, ro, scores.rewards, rows, texts, t.tok)

    for step in range(3):
        t.update(*sample(step), None)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        ro, adv = sample(3)
    print(f"sampling: {tuple(ro.completion_ids.shape)} completions x tokens")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows))
    trained = trained_rows(cfg.grpo, adv, ro.completion_mask).numel()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t.update(ro, adv, None)
    print(f"update: {trained} of {adv.shape[0]} completions have a non-zero advantage")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
