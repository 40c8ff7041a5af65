"""Asynchronous rollouts (grpo.async_rollouts) against the synchronous loop, side by side.

speed: `grpo train` at a config's shape, synchronous and asynchronous runs alternating
(`--repeats` each), every run from the same policy; per run the median step time after the
first step (the first has nothing to overlap), the whole command's wall time, and where a step's
time goes (learner waiting for the sampler, the update, the sampler's own sampling time).

learning: the default tiny task from its SFT reference, synchronous and asynchronous GRPO per
seed for the config's steps, each evaluated greedy on the held-out set, with the paired
difference (async - sync) on the same problems.

    python benchmarks/async_rollouts.py speed --config configs/smollm2-135m.yaml --steps 6 \
        --repeats 2 --work /tmp/async
    python benchmarks/async_rollouts.py learning --seeds 0 1 2 --work /tmp/async_tiny
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_env import prepare

ROOT = prepare()

MODES = {"sync": [], "async": ["grpo.async_rollouts=true"]}
# no in-run evaluation or selection split: the speed of steps alone
SPEED_SETS = ["grpo.eval_every=0", "data.num_select=0"]


def _train(cfg_path: str | None, policy: Path, out: Path, sets: list[str]) -> float:
    """`grpo train` into out (replaced); its wall seconds."""
    cmd = [sys.executable, "-m", "cli.main", "train", "--policy", str(policy), "--out", str(out),
           "--overwrite"]  # fmt: skip
    cmd += ["--config", cfg_path] if cfg_path else []
    for s in sets:
        cmd += ["--set", s]
    t = time.time()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"{out}: grpo train failed:\n{p.stderr[-3000:]}")
    return time.time() - t


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").open()]


def _policy(cfg_path: str | None, sets: list[str]) -> Path:
    """The config's starting policy: a real model's converted base, or the SFT reference."""
    from grpo.config import load_config
    from grpo.launch.paths import gguf_model_dir, reference_dir

    cfg = load_config(cfg_path, sets)
    if cfg.model.gguf:
        return gguf_model_dir(cfg.model.gguf, ROOT / "runs" / "base")
    ref = reference_dir(cfg)
    if not (ref / "model.safetensors").exists():
        cmd = [sys.executable, "-m", "cli.main", "sft"]
        cmd += ["--config", cfg_path] if cfg_path else []
        for s in sets:
            cmd += ["--set", s]
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    return ref


def speed(a: argparse.Namespace) -> None:
    sets = [*SPEED_SETS, f"grpo.steps={a.steps}", f"grpo.checkpoint_every={a.steps}", *a.set]
    policy = _policy(a.config, a.set)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(a.repeats):
        for mode, extra in MODES.items():
            out = Path(a.work) / f"{mode}{r}"
            wall = _train(a.config, policy, out, [*sets, *extra])
            rows = _rows(out)[1:]  # the first step has nothing to overlap
            get = lambda k, rows=rows: statistics.median(x.get(k, 0.0) for x in rows)  # noqa: E731
            runs[mode].append({
                "wall_s": wall, "step_s": get("step_time"), "wait_s": get("time/sampling"),
                "update_s": get("time/training"), "sampler_s": get("time/sampler"),
                "completions_per_s": get("completions_per_second"),
            })  # fmt: skip
            print(mode, r, json.dumps(runs[mode][-1]), flush=True)
    med = {m: {k: statistics.median(x[k] for x in v) for k in v[0]} for m, v in runs.items()}
    print(f"\n{a.config or 'configs/tiny.yaml'}, {a.steps} steps, {a.repeats} runs of each, "
          "medians (steps after the first):\n")  # fmt: skip
    print("| mode | step (s) | steps/hour | completions/s | waiting for samples (s) | update (s) "
          "| sampler's sampling (s) | command wall (s) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for m, x in med.items():
        print(f"| {m} | {x['step_s']:.2f} | {3600 / x['step_s']:.0f} | "
              f"{x['completions_per_s']:.2f} | {x['wait_s']:.2f} | {x['update_s']:.2f} | "
              f"{x['sampler_s']:.2f} | {x['wall_s']:.0f} |")  # fmt: skip
    ratios = [s["step_s"] / x["step_s"] for s, x in zip(runs["sync"], runs["async"], strict=True)]
    print(
        f"\nsteps per hour, async / sync, run pair by run pair: "
        f"{', '.join(f'{r:.2f}x' for r in ratios)} (median {statistics.median(ratios):.2f}x)"
    )


def learning(a: argparse.Namespace) -> None:
    from grpo.config import load_config
    from grpo.eval.metrics import format_paired, paired_difference
    from grpo.eval.run import evaluate_model

    for seed in a.seeds:
        sets = [f"seed={seed}", *a.set]
        cfg = load_config(a.config, sets)
        policy = _policy(a.config, sets)
        recs, walls = {}, {}
        for mode, extra in MODES.items():
            out = Path(a.work) / f"seed{seed}" / mode
            walls[mode] = _train(a.config, policy, out, [*sets, *extra])
            report = out / "eval"
            evaluate_model(cfg, str(out / "policy"), [cfg.eval.sets[0]], str(report))
            recs[mode] = [json.loads(x) for x in (report / "samples.jsonl").open()]
        acc = {m: sum(r["correct"] for r in v) / len(v) for m, v in recs.items()}
        diff = paired_difference(recs["sync"], recs["async"])
        print(f"seed {seed}: sync {acc['sync']:.3f} ({walls['sync']:.0f} s), async "
              f"{acc['async']:.3f} ({walls['async']:.0f} s), async - sync "
              f"{format_paired(diff)}", flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["speed", "learning"])
    p.add_argument("--config", help="default: the embedded tiny run")
    p.add_argument("--set", action="append", default=[], help="config override, KEY=VALUE")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--work", required=True)
    a = p.parse_args()
    (speed if a.what == "speed" else learning)(a)


if __name__ == "__main__":
    main()
