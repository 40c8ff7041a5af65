"""The rule of benchmarks/TOOLS_SMOLLM2.md, measured: which digit count D leaves GRPO room with
the calculator tool. For each candidate (D digits, N demonstrations), in the rule's order, the
SFT reference is built by the pipeline's SFT stage (cached under the same key as `grpo
pipeline` would use), then evaluated greedily on the selection split (never a held-out set)
with its tools and without them. A candidate meets the rule when without tools it scores under
0.05, with them between 0.2 and 0.8, and it calls the tool in at least half of its episodes.

    python benchmarks/tools_headroom.py --config configs/smollm2-135m-calculator.yaml

The first candidate that meets the rule ends the search (--all measures every one). One JSON
line per candidate goes to --out, with the SFT's steps and time.
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

# (demonstrations, digits) in the order the rule measures them
CANDIDATES = [(n, d) for n in (48, 24, 96) for d in (4, 5, 6)]
UNTOOLED_MAX, TOOLED_RANGE, TOOL_USE_MIN = 0.05, (0.2, 0.8), 0.5


def meets_rule(untooled: float, tooled: float, tool_use_rate: float) -> bool:
    """The three conditions of the rule, on selection-split greedy pass@1 and tool use."""
    lo, hi = TOOLED_RANGE
    return untooled < UNTOOLED_MAX and lo <= tooled <= hi and tool_use_rate >= TOOL_USE_MIN


def measure(config: str, demos: int, digits: int, extra: list[str]) -> dict:
    """Build (or reuse) the candidate's reference and measure it with and without its tools."""
    overrides = [f"data.num_sft={demos}", f"data.min_digits={digits}",
                 f"data.max_digits={digits}", f"data.ood_digits={digits + 2}", *extra]  # fmt: skip
    cfg = load_config(config, overrides)
    t0 = time.time()
    ref = run_sft(cfg)
    sft_s = time.time() - t0
    summary = json.loads((ref / "sft_summary.json").read_text())
    rows = make_sets(cfg.data)["select"]
    tok, device = load_tokenizer(ref), device_for(cfg)
    model = load_model(ref, cfg.model.dtype, trainable=False).to(device).eval()
    kw = {"batch_size": cfg.eval.batch_size, "max_new_tokens": cfg.eval.max_new_tokens,
          "seed": cfg.seed}  # fmt: skip
    bare = cfg.model_copy(update={"tools": type(cfg.tools)()})
    tooled = summarize(generate_for_rows(model, tok, rows, cfg, device, **kw))
    untooled = summarize(generate_for_rows(model, tok, rows, bare, device, **kw))
    return {
        "demonstrations": demos,
        "digits": digits,
        "overrides": overrides,
        "problems": len(rows),
        "sft_steps": summary["steps"],
        "sft_best_val_loss": summary["best_val_loss"],
        "sft_s": round(sft_s),
        "tooled_pass@1": tooled["accuracy"],
        "untooled_pass@1": untooled["accuracy"],
        "tool_use_rate": tooled["tool_use_rate"],
        "tool_errors_mean": tooled["tool_errors_mean"],
        "tooled_truncated": tooled["truncation_rate"],
        "meets_rule": meets_rule(
            untooled["accuracy"], tooled["accuracy"], tooled["tool_use_rate"]
        ),  # fmt: skip
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every candidate")  # fmt: skip
    ap.add_argument("--all", action="store_true", help="measure every candidate")
    ap.add_argument("--limit", type=int, default=0, help="the first N candidates only")
    ap.add_argument("--out", default="benchmarks/tools_headroom.jsonl")
    a = ap.parse_args()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    for demos, digits in CANDIDATES[: a.limit or None]:
        rec = measure(a.config, demos, digits, a.set)
        print(json.dumps(rec), flush=True)
        with open(a.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if rec["meets_rule"] and not a.all:
            print(f"the task: {digits}-digit sums, {demos} demonstrations")
            return
    print("no candidate meets the rule")


if __name__ == "__main__":
    main()
