"""Which task leaves GRPO room on the real model? For each candidate, the SFT reference trained
to its own validation plateau (the pipeline's SFT stage, cached), then its greedy pass@1 and its
pass@8 / maj@8 at the training temperature on the validation split (never the test set).

RL mostly turns pass@k into pass@1, so a candidate whose pass@8 - pass@1 gap is wide has room.

    python benchmarks/real_model_headroom.py --config configs/smollm2-135m.yaml --split select \
        --candidate "3digit-300:" --candidate "3digit-100:data.num_sft=100"

Results are appended to --out (one JSON line per candidate, with the SFT's steps and time).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import bench_env  # noqa: E402

bench_env.prepare()  # the CLI's kernels and threads: the reference is the pipeline's, cached

from grpo.config import load_config  # noqa: E402
from grpo.data.synthetic import make_sets  # noqa: E402
from grpo.eval.metrics import summarize  # noqa: E402
from grpo.eval.run import generate_for_rows  # noqa: E402
from grpo.launch.runner import run_sft  # noqa: E402
from grpo.models.loading import device_for, load_model, load_tokenizer  # noqa: E402


def measure(config: str, name: str, overrides: list[str], samples: int, split: str) -> dict:
    cfg = load_config(config, overrides)
    t0 = time.time()
    ref = run_sft(cfg)
    sft_s = time.time() - t0
    summary = json.loads((ref / "sft_summary.json").read_text())
    rows = make_sets(cfg.data)[split]
    tok, device = load_tokenizer(ref), device_for(cfg)
    model = load_model(ref, cfg.model.dtype, trainable=False).to(device).eval()
    kw = {"batch_size": cfg.eval.batch_size, "max_new_tokens": cfg.eval.max_new_tokens}
    greedy = summarize(generate_for_rows(model, tok, rows, cfg, device, **kw))
    sampled = summarize(
        generate_for_rows(
            model,
            tok,
            rows,
            cfg,
            device,
            samples=samples,
            temperature=cfg.grpo.temperature,
            seed=1,
            **kw,
        )
    )
    return {
        "candidate": name,
        "overrides": overrides,
        "split": split,
        "problems": len(rows),
        "sft_steps": summary["steps"],
        "sft_best_val_loss": summary["best_val_loss"],
        "sft_s": round(sft_s),
        "greedy_pass@1": greedy["accuracy"],
        "temperature": cfg.grpo.temperature,
        "sampled_mean": sampled["mean_accuracy"],
        f"pass@{samples}": sampled[f"pass@{samples}"],
        f"maj@{samples}": sampled[f"maj@{samples}"],
        "greedy_length": greedy["mean_length"],
        "greedy_truncated": greedy["truncation_rate"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", required=True)
    ap.add_argument("--candidate", action="append", required=True, metavar="NAME:K=V,K=V")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--split", default="select", help="a validation split: select or sft_val")
    ap.add_argument("--out", default="benchmarks/real_model_headroom.jsonl")
    a = ap.parse_args()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    for c in a.candidate:
        name, _, ov = c.partition(":")
        rec = measure(a.config, name, [o for o in ov.split(",") if o], a.samples, a.split)
        print(json.dumps(rec), flush=True)
        with open(a.out, "a") as f:
            f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
