"""How our GRPO step time grows with G, completion length, beta > 0 and a second CPU rank,
and what the fast sampler, the skipped zero-advantage completions and the update's length
buckets save (the chunked LM head only matters at a real vocabulary:
benchmarks/update_forward.py measures it on SmolLM2).

    .venv/bin/python benchmarks/scaling.py [--steps 8]

Each configuration is one fresh `grpo.launch.worker train` process (1 rank) or a DeepSpeed launch
(2 ranks) on the tiny model; medians of the per-step times after 2 warm-up steps.
Writes benchmarks/SCALING.md.
"""

import argparse
import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
import bench_env  # noqa: E402

bench_env.prepare()  # the CLI's kernels and threads, before torch loads


from grpo.config import load_config  # noqa: E402
from grpo.launch.paths import base_model_dir  # noqa: E402
from grpo.launch.runner import run_grpo, run_sft  # noqa: E402

CASES = [
    ("baseline: G=8, 4 prompts, beta=0, 1 rank", []),
    ("sampling with transformers generate() (engine hf)", ["model.generation_engine=hf"]),
    ("training on every completion (skip_zero_advantage off)", ["grpo.skip_zero_advantage=false"]),
    ("beta=0.04 (reference loaded, KL)", ["grpo.beta=0.04"]),
    ("2 CPU ranks (ZeRO-2), same global batch", ["deepspeed.nproc=2", "deepspeed.zero_stage=2"]),
    ("G=4", ["grpo.num_generations=4"]),
    ("G=16", ["grpo.num_generations=16"]),
    ("long completions (random model, length 48)", ["LONG"]),
    ("long completions (random model, length 96)", ["LONG", "grpo.max_completion_length=96"]),
    ("32 prompts, training on every completion", ["grpo.prompts_per_step=32", "ALL"]),
    (
        "32 prompts, every completion, length buckets off (grpo.bucket_tokens=0)",
        ["grpo.prompts_per_step=32", "ALL", "grpo.bucket_tokens=0"],
    ),
]
# "ALL": trained on every completion, so that the update's work does not depend on how many
# groups happened to be informative
ALL = "grpo.skip_zero_advantage=false"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", default=str(ROOT / "runs" / "scaling"))
    a = p.parse_args()
    base_cfg = load_config(ROOT / "configs" / "tiny.yaml", [f"output_dir={a.out}"])
    ref, rnd = run_sft(base_cfg), base_model_dir(base_cfg)
    lines = [
        "# GRPO step time scaling (ours, CPU, 2 cores)",
        "",
        f"Command: `python benchmarks/scaling.py --steps {a.steps}`; medians after 2 warm-up "
        "steps; 4 prompts per step, max_completion_length 48 unless stated.",
        "",
        "| case | completions/step | mean length | step s | generation s | reference s "
        "| training s | completions/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, (name, sets) in enumerate(CASES):
        model = rnd if "LONG" in sets else ref
        sets = [ALL if x == "ALL" else x for x in sets if x != "LONG"]
        cfg = load_config(ROOT / "configs" / "tiny.yaml", [
            f"output_dir={a.out}", f"grpo.steps={a.steps}", "grpo.prompts_per_step=4",
            "grpo.eval_every=0", "grpo.checkpoint_every=1000", *sets,
        ])  # fmt: skip
        out = Path(a.out) / f"case{i}"
        run_grpo(cfg, Path(model), out, log=lambda s: None)
        rows = [json.loads(x) for x in (out / "metrics.jsonl").open() if x.strip()][2:]

        def med(k: str, rows: list = rows) -> float:
            return statistics.median(r[k] for r in rows)

        for r in rows:  # the table's "generation" column: sampling plus scoring
            r["generation"] = r["time/sampling"] + r["time/advantages"]

        n = cfg.grpo.prompts_per_step * cfg.grpo.num_generations
        lines.append(
            f"| {name} | {n} | {med('completions/mean_length'):.1f} | {med('step_time'):.3f} | "
            f"{med('generation'):.3f} | {med('time/reference'):.3f} | "
            f"{med('time/training'):.3f} | {med('completions_per_second'):.1f} |"
        )
        print(lines[-1], flush=True)
    (ROOT / "benchmarks" / "SCALING.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
