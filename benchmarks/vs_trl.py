"""Our GRPO trainer vs trl.GRPOTrainer on the same tiny model, prompts and settings.

    .venv/bin/pip install -e '.[bench]'   # TRL is a benchmark-only dependency
    .venv/bin/python benchmarks/vs_trl.py [--steps 30] [--repeats 2] [--prompts 32 --results F]

Each measurement is a fresh subprocess (peak RSS is that process's own), run alternately
A B A B. Reports medians with min-max and writes benchmarks/RESULTS.md.
Two regimes: "short" (the SFT reference: completions stop at EOS after ~25 tokens) and "long"
(the randomly initialised model: completions mostly run to max_completion_length).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
import bench_env  # noqa: E402

bench_env.prepare()  # the CLI's kernels and threads, before torch loads

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SETTINGS = {
    "num_generations": 8,
    # 4 by default (32 completions: the regime where per-op overhead dominates); --prompts 32
    # is the default run's 32 x 8 (the child processes read it from BENCH_PROMPTS)
    "prompts_per_step": int(os.environ.get("BENCH_PROMPTS", "4")),
    "max_completion_length": 48,
    "temperature": 1.0,
    "beta": 0.0,
    "lr": 1e-4,
    "loss_type": "dapo",
}
# "ours-all" trains on every completion as TRL does (grpo.skip_zero_advantage=false): it
# separates the faster sampler from the skipped zero-advantage completions. "trl-defaults" is
# TRL as a user gets it: its own GRPOConfig defaults for bf16 (CPU autocast) and gradient
# checkpointing, both on, where "trl" turns them off to match our fp32 step
TRAINERS = ("ours", "ours-all", "trl")
ALL_TRAINERS = (*TRAINERS, "trl-defaults")
WARMUP = 3  # steps left out of the medians (first-step allocations, lazy imports)


def _prompts(n: int) -> list[dict]:
    from grpo.config import DataConfig
    from grpo.data.synthetic import make_sets

    return make_sets(DataConfig(num_train=max(n, 1)))["train"][:n]


def run_ours(model: str, steps: int, out: str, beta: float, train_all: bool = False) -> dict:
    from grpo.config import load_config
    from grpo.engine.loop import Trainer

    s = SETTINGS
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [
        f"output_dir={out}", f"grpo.steps={steps}", f"grpo.num_generations={s['num_generations']}",
        f"grpo.prompts_per_step={s['prompts_per_step']}", f"grpo.lr={s['lr']}",
        f"grpo.max_completion_length={s['max_completion_length']}", f"grpo.beta={beta}",
        f"grpo.temperature={s['temperature']}", f"grpo.loss_type={s['loss_type']}",
        "grpo.eval_every=0", "grpo.checkpoint_every=100000", "grpo.warmup_steps=0",
        "grpo.reward_funcs=[accuracy]", "grpo.reward_weights=[1.0]",
        f"grpo.skip_zero_advantage={not train_all}",
    ])  # fmt: skip
    t = Trainer(cfg, model, Path(out) / "ours")
    start = time.perf_counter()
    t.train(progress=False)
    wall = time.perf_counter() - start
    rows = [json.loads(x) for x in (Path(out) / "ours" / "metrics.jsonl").open()][WARMUP:]
    return {
        "step_time": [r["step_time"] for r in rows],
        # sampling plus scoring and advantages: what TRL's generation phase also covers
        "generation": [r["time/sampling"] + r["time/advantages"] for r in rows],
        "reference": [r["time/reference"] for r in rows],
        "training": [r["time/training"] for r in rows],
        "tokens": [r["completions/mean_length"] * _batch() for r in rows],
        "reward": [r["reward"] for r in rows],
        "mean_length": statistics.mean(r["completions/mean_length"] for r in rows),
        "plain_generate_ratio": _plain_generate_ratio(t),
        "wall": wall,
    }


def _plain_generate_ratio(trainer) -> list[float]:
    """Our grpo.models.generate vs a plain transformers generate() on the same batch."""
    import torch

    from grpo.models.generate import generate
    from grpo.models.prompts import encode_prompts

    s, model, tok = SETTINGS, trainer.engine.module, trainer.tok
    rows = _prompts(s["prompts_per_step"])
    ids, mask = encode_prompts(tok, [r["prompt"] for r in rows], trainer.cfg, trainer.device)
    ratios = []
    for _ in range(5):
        torch.manual_seed(0)
        t0 = time.perf_counter()
        generate(model, ids, mask, num_generations=s["num_generations"],
                 max_completion_length=s["max_completion_length"],
                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
        t1 = time.perf_counter()
        torch.manual_seed(0)
        with torch.no_grad():
            model.generate(
                input_ids=ids.repeat_interleave(s["num_generations"], 0),
                attention_mask=mask.repeat_interleave(s["num_generations"], 0),
                do_sample=True, temperature=1.0, max_new_tokens=s["max_completion_length"],
                pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
            )  # fmt: skip
        t2 = time.perf_counter()
        ratios.append((t1 - t0) / (t2 - t1))
    return ratios


def run_trl(model: str, steps: int, out: str, beta: float, defaults: bool = False) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from reward_fns import accuracy

    s = SETTINGS
    tok = AutoTokenizer.from_pretrained(model)
    tok.padding_side = "left"
    data = Dataset.from_list(
        [{"prompt": r["prompt"], "answer": r["answer"]} for r in _prompts(4000)]
    )
    marks: list[float] = []
    rewards: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001, ANN201
            marks.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):  # noqa: ANN001, ANN201
            if logs and "reward" in logs:
                rewards.append(logs["reward"])

    # matched to our step (fp32, no recomputation) unless TRL's own defaults are asked for
    matched = {} if defaults else {"bf16": False, "gradient_checkpointing": False}
    args = GRPOConfig(
        output_dir=str(Path(out) / "trl"), use_cpu=True, **matched,
        per_device_train_batch_size=_batch(),
        num_generations=s["num_generations"], max_completion_length=s["max_completion_length"],
        temperature=s["temperature"], beta=beta, learning_rate=s["lr"],
        loss_type=s["loss_type"], max_steps=steps, logging_steps=1, report_to=[],
        save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0,
        lr_scheduler_type="constant", warmup_steps=0,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=model, reward_funcs=[accuracy], args=args, train_dataset=data,
        processing_class=tok, callbacks=[Clock()],
    )  # fmt: skip
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    times = [b - a for a, b in zip([start, *marks[:-1]], marks)][WARMUP:]
    hist = [h for h in trainer.state.log_history if "completions/mean_length" in h][WARMUP:]
    lengths = [h["completions/mean_length"] for h in hist]
    return {
        "step_time": times,
        "tokens": [n * _batch() for n in lengths],
        "reward": rewards[WARMUP:],
        "mean_length": statistics.mean(lengths) if lengths else float("nan"),
        "wall": wall,
        "bf16": bool(args.bf16),
        "gradient_checkpointing": bool(args.gradient_checkpointing),
    }


def child(which: str, model: str, steps: int, out: str, beta: float) -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    if which.startswith("trl"):
        res = run_trl(model, steps, out, beta, defaults=which == "trl-defaults")
    else:
        res = run_ours(model, steps, out, beta, train_all=which == "ours-all")
    res["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(res), flush=True)


def _measure(which: str, model: str, steps: int, out: Path, beta: float, nproc: int = 1) -> dict:
    cmd = [sys.executable, __file__, "--child", which, "--model", model, "--steps", str(steps),
           "--out", str(out), "--beta", str(beta)]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if p.returncode != 0 or line is None:
        raise RuntimeError(f"{which} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(line[7:])


def _batch() -> int:
    """Completions per step."""
    return SETTINGS["prompts_per_step"] * SETTINGS["num_generations"]


def _med(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def _fmt(xs: list[float], digits: int = 1) -> str:
    m, lo, hi = _med(xs)
    return f"{m:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child")
    p.add_argument("--model")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "runs" / "bench"))
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--reference", help="SFT reference dir for the 'short' regime")
    p.add_argument("--prompts", type=int, help="prompts per step (default 4; 32 = the default run)")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    p.add_argument("--trainers", default=",".join(TRAINERS),
                   help=f"comma-separated, from {', '.join(ALL_TRAINERS)}")  # fmt: skip
    a = p.parse_args()
    a.trainers = a.trainers.split(",")
    unknown = [t for t in a.trainers if t not in ALL_TRAINERS]
    if unknown or "trl" not in a.trainers:
        p.error(f"--trainers: {unknown or 'trl is missing'}: expected trl and any of "
                f"{', '.join(ALL_TRAINERS)}")  # fmt: skip
    if a.prompts:
        os.environ["BENCH_PROMPTS"] = str(a.prompts)  # the child processes read it at import
        SETTINGS["prompts_per_step"] = a.prompts
    if a.child:
        child(a.child, a.model, a.steps, a.out, a.beta)
        return

    from grpo.config import load_config
    from grpo.launch.paths import base_model_dir
    from grpo.launch.runner import run_sft

    cfg = load_config(ROOT / "configs" / "tiny.yaml", [f"output_dir={a.out}"])
    long_model = str(base_model_dir(cfg))
    short_model = a.reference or str(run_sft(cfg))
    results: dict[tuple[str, str], list[dict]] = {}
    for regime, model in (("short", short_model), ("long", long_model)):
        for r in range(a.repeats):
            for which in a.trainers:  # A B C A B C
                res = _measure(which, model, a.steps, Path(a.out) / f"{regime}-{which}-{r}", a.beta)
                results.setdefault((regime, which), []).append(res)
                print(regime, which, r, _fmt(res["step_time"], 3), flush=True)
    lines = _report(results, a)
    Path(a.results).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _report(results: dict, a: argparse.Namespace) -> list[str]:
    s = SETTINGS
    lines = [
        "# GRPO step speed: ours vs trl.GRPOTrainer (CPU, 2 threads)",
        "",
        f"Command: `python benchmarks/vs_trl.py --steps {a.steps} --repeats {a.repeats}"
        + (f" --prompts {a.prompts} --results {Path(a.results).name}" if a.prompts else "")
        + (f" --trainers {','.join(a.trainers)}" if a.trainers != list(TRAINERS) else "")
        + "`",
        "",
        f"Settings (both): G={s['num_generations']}, {s['prompts_per_step']} prompts/step "
        f"({_batch()} completions), max_completion_length={s['max_completion_length']}, "
        f"temperature={s['temperature']}, beta={a.beta}, lr={s['lr']}, loss_type={s['loss_type']}, "
        f"{a.steps} steps ({WARMUP} warm-up steps left out), fp32, same tiny Qwen2 and prompts, "
        "reward = reward_fns.accuracy. Medians over all measured steps of all repeats "
        "(min-max in brackets); each run a fresh process, alternated. `ours` skips the "
        "forward/backward of completions whose advantage is zero (exact with beta 0 + dapo); "
        "`ours-all` trains on every completion, as TRL does. `trl-defaults` leaves bf16 and "
        "gradient checkpointing at TRL's own defaults (both on) where `trl` turns them off. "
        "'whole run' is every step, warm-up included, over the time of the whole `train()` call.",
        "",
        "| regime | trainer | mean completion length | step time s | completions/s "
        "| completion tokens/s | whole run completions/s | peak RSS MiB "
        "| final reward (median of last 10) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    ratio_rows = []
    others = [t for t in a.trainers if not t.startswith("trl")]
    trls = [t for t in a.trainers if t.startswith("trl")]
    for regime in ("short", "long"):
        meds = {}
        for which in a.trainers:
            runs = results[(regime, which)]
            st = [x for r in runs for x in r["step_time"]]
            cps = [_batch() / x for x in st]
            tps = [t / x for r in runs for t, x in zip(r["tokens"], r["step_time"])]
            rss = [r["peak_rss_mib"] for r in runs]
            rew = [statistics.median(r["reward"][-10:]) for r in runs if r["reward"]]
            length = statistics.mean(r["mean_length"] for r in runs)
            whole = [a.steps * _batch() / r["wall"] for r in runs]
            meds[which] = (statistics.median(cps), statistics.median(rss),
                           statistics.median(whole))  # fmt: skip
            lines.append(
                f"| {regime} | {which} | {length:.1f} | {_fmt(st, 3)} | {_fmt(cps)} | "
                f"{_fmt(tps, 0)} | {_fmt(whole)} | {_fmt(rss, 0)} | {statistics.median(rew):.3f} |"
            )
        for o in others:
            for t in trls:
                ratio_rows.append(
                    f"| {regime} | {o}/{t} | {meds[o][0] / meds[t][0]:.2f}x | "
                    f"{meds[o][2] / meds[t][2]:.2f}x | {meds[o][1] / meds[t][1]:.2f}x |"
                )
    lines += [
        "",
        "| regime | trainers | completions/s (measured steps) | completions/s (whole run) "
        "| peak RSS |",
        "|---|---|---|---|---|",
    ]
    lines += ratio_rows
    split = []
    for regime in ("short", "long"):
        for which in others:
            runs = results[(regime, which)]
            g = [x for r in runs for x in r["generation"]]
            tr = [x for r in runs for x in r["training"]]
            pg = [x for r in runs for x in r["plain_generate_ratio"]]
            split.append(f"| {regime} | {which} | {_fmt(g, 3)} | {_fmt(tr, 3)} | {_fmt(pg, 2)} |")
    lines += [
        "",
        "Our step split (seconds) and our generation vs a plain transformers `generate()` "
        f"on the same {_batch()}-completion batch (time ratio, < 1 is faster):",
        "",
        "| regime | trainer | generation | training | ours/plain generate |",
        "|---|---|---|---|---|",
    ]
    return lines + split


if __name__ == "__main__":
    main()
