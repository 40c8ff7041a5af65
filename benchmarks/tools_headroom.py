"""The rule of benchmarks/TOOLS_SMOLLM2.md, measured: which task size leaves GRPO room with
the calculator tool: the digit count D of a sum (--family sums), or the number K of kinds of
animal in reasoning-gym's leg_counting (--family legs, the second family, measured when the
first ends with no candidate). For each candidate (a size, N demonstrations), in the rule's
order, the SFT reference is built by the pipeline's SFT stage (cached under the same key as `grpo
pipeline` would use), then evaluated greedily on the selection split (never a held-out set)
with its tools and without them. A candidate meets the rule when without tools it scores under
0.05, with them between 0.2 and 0.8, and it calls the tool in at least half of its episodes.

    python benchmarks/tools_headroom.py --config configs/smollm2-135m-calculator.yaml
    python benchmarks/tools_headroom.py --family legs \
        --config configs/smollm2-135m-legs-calculator.yaml \
        --out benchmarks/tools_headroom_legs.jsonl

The first candidate that meets the rule ends the search. The sizes are measured in
order at 48 demonstrations; when none meets the rule, the demonstrations move the way it failed
(`next_demos`): fewer when the tooled reference was above the range at every digit count, more
when below it or calling the tool too rarely. One JSON line per candidate goes to --out, with
the SFT's steps and time.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import bench_env  # noqa: E402

bench_env.prepare()  # the CLI's kernels and threads: the reference is the pipeline's, cached

from grpo.config import load_config  # noqa: E402
from grpo.data.sets import training_sets  # noqa: E402
from grpo.eval.metrics import summarize  # noqa: E402
from grpo.eval.run import generate_for_rows  # noqa: E402
from grpo.launch.runner import run_sft  # noqa: E402
from grpo.models.loading import device_for, load_model, load_tokenizer  # noqa: E402

# each family's sizes in the rule's order, and what the size is called in a record
SIZES = {"sums": (4, 5, 6), "legs": (2, 3, 4)}
SIZE_NAME = {"sums": "digits", "legs": "kinds"}
FIRST_DEMOS = 48
FEWER, MORE = (24, 12), (96,)  # tried in order, the way the rule failed
UNTOOLED_MAX, TOOLED_RANGE, TOOL_USE_MIN = 0.05, (0.2, 0.8), 0.5


def meets_rule(untooled: float, tooled: float, tool_use_rate: float) -> bool:
    """The three conditions of the rule, on selection-split greedy pass@1 and tool use."""
    lo, hi = TOOLED_RANGE
    return untooled < UNTOOLED_MAX and lo <= tooled <= hi and tool_use_rate >= TOOL_USE_MIN


def next_demos(demos: int, records: list[dict]) -> int | None:
    """The demonstrations to try after every digit count at `demos` failed the rule: fewer when
    the tooled reference was too reliable at all of them, more when too unreliable (below the
    range, or calling the tool too rarely) at all of them; None when the failures disagree (the
    range lies between two digit counts) or that direction is spent.

    >>> too_good = {"tooled_pass@1": 0.95, "tool_use_rate": 1.0}
    >>> too_bad = {"tooled_pass@1": 0.1, "tool_use_rate": 0.3}
    >>> next_demos(48, [too_good] * 3), next_demos(24, [too_good] * 3), next_demos(12, [too_good])
    (24, 12, None)
    >>> next_demos(48, [too_bad] * 3), next_demos(96, [too_bad])
    (96, None)
    >>> next_demos(48, [too_good, too_bad]) is None
    True
    """
    lo, hi = TOOLED_RANGE
    if all(r["tooled_pass@1"] > hi for r in records):
        way = (FIRST_DEMOS, *FEWER)
    elif all(r["tooled_pass@1"] < lo or r["tool_use_rate"] < TOOL_USE_MIN for r in records):
        way = (FIRST_DEMOS, *MORE)
    else:
        return None
    i = way.index(demos) if demos in way else len(way)
    return way[i + 1] if i + 1 < len(way) else None


def candidate_overrides(family: str, demos: int, size: int, extra: list[str]) -> list[str]:
    """The config overrides of one candidate: its demonstrations, its size, its set beyond it.

    >>> candidate_overrides("sums", 48, 5, [])
    ['data.num_sft=48', 'data.min_digits=5', 'data.max_digits=5', 'data.ood_digits=7']
    >>> candidate_overrides("legs", 24, 3, ["seed=1"])[1:]
    ['data.generators=[{name: leg_counting, config: {min_animals: 3, max_animals: 3}}]', 'seed=1']
    """
    if family == "sums":
        sized = [f"data.min_digits={size}", f"data.max_digits={size}",
                 f"data.ood_digits={size + 2}"]  # fmt: skip
    else:  # the set beyond is the config's rg:defaults:leg_counting (3 to 10 kinds)
        sized = ["data.generators=[{name: leg_counting, config: "
                 f"{{min_animals: {size}, max_animals: {size}}}}}]"]  # fmt: skip
    return [f"data.num_sft={demos}", *sized, *extra]


def measure(config: str, family: str, demos: int, size: int, extra: list[str]) -> dict:
    """Build (or reuse) the candidate's reference and measure it with and without its tools."""
    overrides = candidate_overrides(family, demos, size, extra)
    cfg = load_config(config, overrides)
    t0 = time.time()
    ref = run_sft(cfg)
    sft_s = time.time() - t0
    summary = json.loads((ref / "sft_summary.json").read_text())
    rows = training_sets(cfg)["select"]
    tok, device = load_tokenizer(ref), device_for(cfg)
    model = load_model(ref, cfg.model.dtype, trainable=False).to(device).eval()
    kw = {"batch_size": cfg.eval.batch_size, "max_new_tokens": cfg.eval.max_new_tokens,
          "seed": cfg.seed}  # fmt: skip
    bare = cfg.model_copy(update={"tools": type(cfg.tools)()})
    tooled = summarize(generate_for_rows(model, tok, rows, cfg, device, **kw))
    bare_records = generate_for_rows(model, tok, rows, bare, device, **kw)
    untooled = summarize(bare_records)
    return {
        "demonstrations": demos,
        SIZE_NAME[family]: size,
        "overrides": overrides,
        "problems": len(rows),
        "sft_steps": summary["steps"],
        "sft_best_val_loss": summary["best_val_loss"],
        "sft_s": round(sft_s),
        "tooled_pass@1": tooled["accuracy"],
        "untooled_pass@1": untooled["accuracy"],
        # what the model writes without its tool: an answer of its own, or a call nobody runs
        "untooled_answered": sum(bool(r["extracted"]) for r in bare_records) / len(rows),
        "untooled_wrote_call": sum("<tool_call>" in r["completion"] for r in bare_records)
        / len(rows),
        "tool_use_rate": tooled["tool_use_rate"],
        "tool_errors_mean": tooled["tool_errors_mean"],
        "tooled_truncated": tooled["truncation_rate"],
        "meets_rule": meets_rule(
            untooled["accuracy"], tooled["accuracy"], tooled["tool_use_rate"]
        ),  # fmt: skip
    }


def recorded(done: list[dict], overrides: list[str]) -> dict | None:
    """The candidate's record from an earlier, interrupted search, when it has the same overrides.

    >>> rec = {"demonstrations": 48, "digits": 4, "overrides": ["data.num_sft=48",
    ...        "data.min_digits=4", "data.max_digits=4", "data.ood_digits=6"]}
    >>> recorded([rec], candidate_overrides("sums", 48, 4, [])) is rec
    True
    >>> recorded([rec], candidate_overrides("sums", 48, 5, [])), recorded([rec], ["seed=1"])
    (None, None)
    """
    return next((r for r in done if r["overrides"] == overrides), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", required=True)
    ap.add_argument("--family", choices=sorted(SIZES), default="sums")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every candidate")  # fmt: skip
    ap.add_argument("--out", default="benchmarks/tools_headroom.jsonl")
    a = ap.parse_args()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # a search stopped part way goes on: candidates already in --out (same overrides) are read,
    # not trained again
    done = [json.loads(x) for x in out.open()] if out.exists() else []
    demos: int | None = FIRST_DEMOS
    while demos is not None:
        records = []
        for size in SIZES[a.family]:
            rec = recorded(done, candidate_overrides(a.family, demos, size, a.set))
            if rec is None:
                rec = measure(a.config, a.family, demos, size, a.set)
                with open(out, "a") as f:
                    f.write(json.dumps(rec) + "\n")
            records.append(rec)
            print(json.dumps(rec), flush=True)
            if rec["meets_rule"]:
                print(f"the task: {SIZE_NAME[a.family]} {size}, {demos} demonstrations")
                return
        demos = next_demos(demos, records)
    print("no candidate meets the rule")


if __name__ == "__main__":
    main()
