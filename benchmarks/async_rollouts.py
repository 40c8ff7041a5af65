"""Asynchronous rollouts (grpo.async_rollouts) against the synchronous loop, side by side.

speed: `grpo train` at a config's shape, synchronous and asynchronous runs alternating
(`--repeats` each), every run from the same policy; per run the median step time after the
first step (the first has nothing to overlap), the whole command's wall time, and where a step's
time goes (learner waiting for the sampler, the update, the sampler's own sampling time).

resources: one async run of --steps steps; the learner's and the sampler's open file
descriptors and /dev/shm's use after every step, first half against second half (flat when the
weights' buffers are reused).

learning: the config's task (the default tiny one unless --config) from its SFT reference, GRPO
in each mode per seed for the config's steps (equal steps), and with --equal-time one mode
again for as many steps as fit in the first mode's time (equal wall time), each evaluated
greedy on the first held-out set, with the paired difference to the first mode on the same
problems.

    python benchmarks/async_rollouts.py speed --config configs/smollm2-135m.yaml --steps 6 \
        --repeats 2 --work /tmp/async
    python benchmarks/async_rollouts.py resources --steps 100 --work /tmp/async_res
    python benchmarks/async_rollouts.py learning --seeds 0 1 --modes sync async \
        --equal-time async --work /tmp/async_tiny
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

MODES = {
    "sync": [],
    "async": ["grpo.async_rollouts=true"],
}
# what learning prints per run: a step's time and what the correction saw
MISMATCH = ("step_time", "logprob_gap/mean", "mismatch/kl_k3",
            "rollout_correction/over_threshold_frac", "rollout_correction/weight_mean")  # fmt: skip
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


def _policy(cfg_path: str | None, sets: list[str], reference: bool = False) -> Path:
    """The config's starting policy: a real model's converted base (for speed, unless
    `reference`), or the SFT reference, built by `grpo sft` when not cached."""
    from grpo.config import load_config
    from grpo.launch.paths import gguf_model_dir, reference_dir

    cfg = load_config(cfg_path, sets)
    if cfg.model.gguf and not reference:
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
    policy = _policy(a.config, a.set, reference=a.reference)
    runs: dict[str, list[dict]] = {m: [] for m in a.modes}
    for r in range(a.repeats):
        for mode in a.modes:
            extra = MODES[mode]
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
    for mode in a.modes[1:]:
        pairs = zip(runs[a.modes[0]], runs[mode], strict=True)
        ratios = [s["step_s"] / x["step_s"] for s, x in pairs]
        print(
            f"\nsteps per hour, {mode} / {a.modes[0]}, run pair by run pair: "
            f"{', '.join(f'{r:.2f}x' for r in ratios)} (median {statistics.median(ratios):.2f}x)"
        )


def _trained_and_evaluated(
    a: argparse.Namespace, cfg: object, policy: Path, sets: list[str], out: Path
) -> tuple[float, list[dict]]:
    """Train into out (a finished run there is kept) and evaluate greedy on the first held-out
    set: the steps' own seconds (startup and the final save are the same in every mode) and
    the per-problem records."""
    from grpo.eval.run import evaluate_model

    if not (out / "policy").exists():
        _train(a.config, policy, out, sets)
    secs = sum(r["step_time"] for r in _rows(out) if "step_time" in r)
    report = out / "eval"
    # greedy only: the comparison uses nothing else (pass@k would cost k greedy passes)
    evaluate_model(cfg, str(out / "policy"), [cfg.eval.sets[0]], str(report), pass_k=0)
    return secs, [json.loads(x) for x in (report / "samples.jsonl").open()]


def learning(a: argparse.Namespace) -> None:
    from grpo.config import load_config
    from grpo.eval.metrics import format_paired, paired_difference
    from grpo.eval.run import evaluate_model

    for seed in a.seeds:
        sets = [f"seed={seed}", *a.set]
        cfg = load_config(a.config, sets)
        policy = _policy(a.config, sets, reference=True)
        recs, secs = {}, {}
        runs = [(mode, MODES[mode]) for mode in a.modes]
        first = a.modes[0]
        for label, extra in runs:
            out = Path(a.work) / f"seed{seed}" / label
            secs[label], recs[label] = _trained_and_evaluated(a, cfg, policy, [*sets, *extra], out)
        if a.equal_time:  # as many steps as fit in the first mode's training time
            steps = round(cfg.grpo.steps * secs[first] / secs[a.equal_time])
            label = f"{a.equal_time}@{steps}"
            out = Path(a.work) / f"seed{seed}" / label
            extra = [*sets, *MODES[a.equal_time], f"grpo.steps={steps}"]
            secs[label], recs[label] = _trained_and_evaluated(a, cfg, policy, extra, out)
        ref_report = Path(a.work) / f"seed{seed}" / "reference_eval"
        evaluate_model(cfg, str(policy), [cfg.eval.sets[0]], str(ref_report), pass_k=0)
        ref = [json.loads(x) for x in (ref_report / "samples.jsonl").open()]
        for label in recs:  # medians over the steps after the first
            rows = [r for r in _rows(Path(a.work) / f"seed{seed}" / label) if "step_time" in r]
            med = {k: statistics.median(r.get(k, 0.0) for r in rows[1:]) for k in MISMATCH}
            print(f"seed {seed} {label}: " + ", ".join(f"{k} {v:.4g}" for k, v in med.items()))
        acc = {m: sum(r["correct"] for r in v) / len(v) for m, v in recs.items()}
        line = f"seed {seed}: reference {sum(r['correct'] for r in ref) / len(ref):.3f}; "
        line += f"{first} {acc[first]:.3f} ({secs[first]:.0f} s of steps)"
        for m in list(recs)[1:]:
            diff = format_paired(paired_difference(recs[first], recs[m]))
            line += f"; {m} {acc[m]:.3f} ({secs[m]:.0f} s), {m} - {first} {diff}"
        print(line, flush=True)


def resources(a: argparse.Namespace) -> None:
    """An async run in this process for --steps steps: after every step the open file
    descriptors of the learner and of its sampler process, and the bytes used in /dev/shm."""
    import os
    import shutil

    from grpo.config import load_config
    from grpo.engine.loop import Trainer

    sets = [*a.set, "grpo.async_rollouts=true", f"grpo.steps={a.steps}", "grpo.eval_every=0",
            "data.num_select=0", f"output_dir={a.work}"]  # fmt: skip
    cfg = load_config(a.config, sets)
    trainer = Trainer(cfg, _policy(a.config, a.set), Path(a.work) / "grpo")
    seen: list[tuple[int, int, int]] = []

    def record(done: int, _steps: int, finished: bool) -> None:
        if finished or trainer.rollouts is None:
            return
        pid = trainer.rollouts.proc.pid
        seen.append((len(os.listdir("/proc/self/fd")), len(os.listdir(f"/proc/{pid}/fd")),
                     shutil.disk_usage("/dev/shm").used))  # fmt: skip

    trainer.train(progress=False, on_step=record)
    half = len(seen) // 2
    for name, i in (("learner fds", 0), ("sampler fds", 1), ("/dev/shm bytes", 2)):
        first, second = [x[i] for x in seen[:half]], [x[i] for x in seen[half:]]
        print(
            f"{name}: steps 1-{half} min {min(first)} max {max(first)}; steps "
            f"{half + 1}-{len(seen)} min {min(second)} max {max(second)}",
            flush=True,
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["speed", "learning", "resources"])
    p.add_argument("--config", help="default: the embedded tiny run")
    p.add_argument("--set", action="append", default=[], help="config override, KEY=VALUE")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=["sync", "async"],
                   help="the first is the baseline of the ratios and differences")  # fmt: skip
    p.add_argument("--equal-time", choices=list(MODES),
                   help="learning: this mode again, for as many steps as fit in the first "
                   "mode's time")  # fmt: skip
    p.add_argument("--work", help="where the runs go (speed, learning)")
    p.add_argument("--reference", action="store_true", help="speed: from the SFT reference")
    a = p.parse_args()
    if not a.work:
        p.error(f"{a.what} needs --work")
    {"speed": speed, "learning": learning, "resources": resources}[a.what](a)


if __name__ == "__main__":
    main()
