"""Our GRPO trainer vs trl.GRPOTrainer on SmolLM2-135M-Instruct, at its config's batch.

    .venv/bin/pip install -e '.[bench,real]'
    .venv/bin/python benchmarks/vs_trl_real.py [--steps 4] [--repeats 1] [--out FILE]

Both start from the instruct model (configs/smollm2-135m.yaml: 8 prompts x 8 completions, at
most 64 tokens, temperature 0.5, lr 2e-5, rewards accuracy + DAPO's soft overlong penalty,
beta 0) on the same prompts in the model's chat template. TRL runs with its own defaults for
everything else, generation included (transformers `generate()` on the CPU). Each run is a
fresh process, alternated; the first step of each is left out. Reports median step seconds,
completions per second and the ratio.
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


CONFIG = ROOT / "configs" / "smollm2-135m.yaml"
WARMUP = 1


def _cfg(steps: int, out: str):  # noqa: ANN202
    from grpo.config import load_config

    return load_config(CONFIG, [
        f"output_dir={out}", f"grpo.steps={steps}", "grpo.eval_every=0",
        "grpo.checkpoint_every=100000", "grpo.log_completions_every=100000",
    ])  # fmt: skip


def _model_dir(cfg) -> Path:  # noqa: ANN001
    from grpo.launch.paths import gguf_model_dir

    return gguf_model_dir(cfg.model.gguf, ROOT / "runs" / "base")


def run_ours(steps: int, out: str) -> dict:
    from grpo.engine.loop import Trainer

    cfg = _cfg(steps, out)
    t = Trainer(cfg, _model_dir(cfg), Path(out) / "ours")
    t.train(progress=False)
    rows = [json.loads(x) for x in (Path(out) / "ours" / "metrics.jsonl").open() if x.strip()]
    rows = [r for r in rows if "step_time" in r][WARMUP:]
    return {"step_time": [r["step_time"] for r in rows],
            "mean_length": statistics.mean(r["completions/mean_length"] for r in rows)}  # fmt: skip


def run_trl(steps: int, out: str) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpo.data.sets import training_sets
    from reward_fns import accuracy
    from reward_fns.format import soft_overlong_penalty

    cfg = _cfg(steps, out)
    g = cfg.grpo
    model = str(_model_dir(cfg))
    tok = AutoTokenizer.from_pretrained(model)
    tok.padding_side = "left"
    rows = training_sets(cfg)["train"]
    data = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
         for r in rows]
    )  # fmt: skip
    marks: list[float] = []
    lengths: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001, ANN201
            marks.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):  # noqa: ANN001, ANN201
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    args = GRPOConfig(
        output_dir=str(Path(out) / "trl"), use_cpu=True, bf16=False,
        per_device_train_batch_size=g.prompts_per_step * g.num_generations,
        num_generations=g.num_generations, max_completion_length=g.max_completion_length,
        temperature=g.temperature, beta=g.beta, learning_rate=g.lr, loss_type=g.loss_type,
        max_steps=steps, logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, seed=0, lr_scheduler_type="constant",
    )  # fmt: skip
    overlong = soft_overlong_penalty(g.max_completion_length, g.overlong_cache)
    trainer = GRPOTrainer(
        model=model, reward_funcs=[accuracy, overlong], args=args, train_dataset=data,
        processing_class=tok, callbacks=[Clock()],
    )  # fmt: skip
    start = time.perf_counter()
    trainer.train()
    times = [b - a for a, b in zip([start, *marks[:-1]], marks, strict=True)][WARMUP:]
    return {"step_time": times, "mean_length": statistics.mean(lengths[WARMUP:])}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--work", default=None)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "RESULTS_SMOLLM2.md"))
    a = p.parse_args()
    if a.child:
        res = run_trl(a.steps, a.work) if a.child == "trl" else run_ours(a.steps, a.work)
        print("RESULT " + json.dumps(res), flush=True)
        return
    work = Path(a.work or tempfile.mkdtemp(prefix="grpo-vs-trl-real-"))
    batch = _cfg(a.steps, str(work)).grpo
    n = batch.prompts_per_step * batch.num_generations
    results: dict[str, list[dict]] = {"ours": [], "trl": []}
    for r in range(a.repeats):
        for which in ("ours", "trl"):
            cmd = [sys.executable, __file__, "--child", which, "--steps", str(a.steps),
                   "--work", str(work / f"{which}-{r}")]  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"{which} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
            results[which].append(json.loads(line[len("RESULT ") :]))
            print(which, r, results[which][-1], flush=True)
    med = {w: statistics.median(t for res in rs for t in res["step_time"])
           for w, rs in results.items()}  # fmt: skip
    lengths = {w: statistics.mean(res["mean_length"] for res in rs) for w, rs in results.items()}
    lines = [
        "# GRPO step speed on SmolLM2-135M-Instruct: ours vs trl.GRPOTrainer (CPU, 2 cores)",
        "",
        f"Command: `python benchmarks/vs_trl_real.py --steps {a.steps} --repeats {a.repeats}`. "
        f"configs/smollm2-135m.yaml's batch: {batch.prompts_per_step} prompts x "
        f"{batch.num_generations} completions, at most {batch.max_completion_length} tokens, "
        f"temperature {batch.temperature}, lr {batch.lr}, beta {batch.beta}, loss "
        f"{batch.loss_type}, rewards accuracy + soft overlong; fp32; TRL's own generation "
        f"defaults. Median step seconds over {a.steps - WARMUP} measured steps per run (the "
        "first left out), fresh processes, alternated.",
        "",
        "| trainer | mean completion length | step s (median) | completions/s | completion "
        "tokens/s |",
        "|---|---|---|---|---|",
    ]
    for w in ("ours", "trl"):
        lines.append(f"| {w} | {lengths[w]:.1f} | {med[w]:.2f} | {n / med[w]:.2f} | "
                     f"{n * lengths[w] / med[w]:.1f} |")  # fmt: skip
    tok_ratio = (lengths["ours"] / med["ours"]) / (lengths["trl"] / med["trl"])
    lines += ["", f"**ours / TRL: {med['trl'] / med['ours']:.2f}x the completions per second, "
              f"{tok_ratio:.2f}x the completion tokens per second**"]  # fmt: skip
    Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
