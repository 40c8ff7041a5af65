"""What the update's length buckets and chunked LM head save, on the tiny default and on
SmolLM2-135M: update seconds and peak memory with each turned off.

    .venv/bin/python benchmarks/update_forward.py [--repeats 2] [--out FILE]

Each setting runs in a fresh process (so that its peak RSS is its own): the trainer samples one
seeded rollout (the same in every process), then runs the update `--repeats` times on it, with
every completion trained on (no zero-advantage skipping), so the work is fixed; one warm-up
update first. The tiny model starts from the default run's SFT reference (built under runs/ if
`make run` has not left it there), SmolLM2 from the instruct model, as their configs do. Reports
the median update seconds, the peak RSS of the process, and the ratio to the setting with both on.
SmolLM2 needs `make install-real`.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
import bench_env  # noqa: E402

bench_env.prepare()  # the CLI's kernels and threads, before torch loads


SETTINGS = [
    ("both on (the default)", []),
    ("length buckets off", ["grpo.bucket_tokens=0"]),
    ("chunked head off", ["grpo.logits_budget_mib=0"]),
    ("both off", ["grpo.bucket_tokens=0", "grpo.logits_budget_mib=0"]),
]
MODELS = {"tiny": None, "smollm2": "configs/smollm2-135m.yaml"}  # model -> its config


def child(model: str, sets: list[str], repeats: int) -> dict:
    import torch

    from grpo.config import load_config
    from grpo.engine.loop import Trainer
    from grpo.engine.sampling import keep_groups, sample_step
    from grpo.engine.scoring import token_advantages
    from grpo.launch.paths import gguf_model_dir
    from grpo.launch.runner import run_sft

    config = MODELS[model]
    tmp = Path(tempfile.mkdtemp(prefix="grpo-upd-"))
    cfg = load_config(ROOT / config if config else None, [
        f"output_dir={tmp}", "grpo.eval_every=0", "grpo.skip_zero_advantage=false", *sets,
    ])  # fmt: skip
    if cfg.model.gguf:  # the instruct model is its config's reference as it is
        policy = gguf_model_dir(cfg.model.gguf, ROOT / "runs" / "base")
    else:  # the default run's SFT reference (cached under runs/ as `make run` leaves it)
        policy = run_sft(cfg.model_copy(update={"output_dir": str(ROOT / "runs")}))
    t = Trainer(cfg, policy, tmp / "grpo")
    sampled = sample_step(t.engine.module, t.tok, cfg, t.train_rows, t.scorer, step=0, rank=0,
                          world=1, device=t.device, eos_ids=t.eos_ids)  # fmt: skip
    ro, scores, texts, rows = keep_groups(sampled, t.local_prompts, cfg.grpo)
    adv = token_advantages(cfg.grpo, ro, scores.rewards, rows, texts, t.tok)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t.update(ro, adv, None)  # warm-up: first-call allocations and kernel choices
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        t.update(ro, adv, None)
        times.append(time.perf_counter() - t0)
    cm, pm = ro.completion_mask, ro.prompt_mask
    padded = cm.shape[0] * (int(cm.sum(1).max()) + pm.shape[1])
    torch.distributed.destroy_process_group()
    return {
        "seconds": statistics.median(times), "all": times,
        "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "peak_before_gib": rss_before / 2**20, "rows": cm.shape[0],
        "tokens": int(cm.sum() + pm.sum()), "padded": padded,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child", nargs=2, metavar=("MODEL", "SETTING"))
    p.add_argument("--models", default="tiny,smollm2")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "UPDATE_FORWARD.md"))
    a = p.parse_args()
    if a.child:
        model, i = a.child[0], int(a.child[1])
        print("RESULT " + json.dumps(child(model, SETTINGS[i][1], a.repeats)))
        return
    lines = [
        "# The update's forward: length buckets and the chunked LM head "
        "(benchmarks/update_forward.py)",
        "",
        f"Command: `python benchmarks/update_forward.py --repeats {a.repeats}`. One seeded "
        "rollout per model (the same in every process), every completion trained on; median "
        f"of {a.repeats} updates after a warm-up one; peak RSS of a fresh process per setting "
        "(model, sampling and update together). Ratios: against the first row of its model.",
        "",
        "| model | setting | rows | real / padded tokens | update s | x of default | peak RSS "
        "GiB before / after the updates |",
        "|---|---|---|---|---|---|---|",
    ]
    for model in a.models.split(","):
        base = None
        for i, (name, _) in enumerate(SETTINGS):
            cmd = [sys.executable, __file__, "--child", model, str(i), "--repeats",
                   str(a.repeats)]  # fmt: skip
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            found = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
            if not found:
                sys.exit(
                    f"{model} / {name}: no result (exit {out.returncode})\n{out.stderr[-2000:]}"
                )
            r = json.loads(found[-1][len("RESULT ") :])
            base = base or r["seconds"]
            lines.append(
                f"| {model} | {name} | {r['rows']} | {r['tokens']} / {r['padded']} | "
                f"{r['seconds']:.3f} | {r['seconds'] / base:.2f} | {r['peak_before_gib']:.2f} / "
                f"{r['peak_gib']:.2f} |"
            )
            print(lines[-1], flush=True)
    Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
