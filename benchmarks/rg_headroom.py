"""Which reasoning-gym generators leave GRPO room on SmolLM2? One SFT reference, trained to its
own validation plateau on answer-format examples of every candidate (the pipeline's SFT stage,
cached), then per generator its greedy pass@1 and its pass@8 at the training temperature on the
selection split (never a test set).

The rule, fixed before any number (benchmarks/REASONING_GYM.md): a generator joins the training
mix when the reference's greedy pass@1 is in [0.2, 0.8] and pass@8 - pass@1 >= 0.15.

    python benchmarks/rg_headroom.py --config configs/smollm2-135m-rg.yaml --per-generator 50

Writes one JSON line per generator to --out and prints the table with each verdict.
"""

from __future__ import annotations

import argparse
import json
import time

import bench_env

bench_env.prepare()

# the candidates, each at a difficulty meant for a 135M model, written down before measuring
CANDIDATES = [
    {"name": "chain_sum", "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1,
                                     "max_digits": 2}},
    {"name": "products", "config": {"min_digits": 1, "max_digits": 2}},
    {"name": "leg_counting", "config": {"min_animals": 1, "max_animals": 2, "max_instances": 3}},
    {"name": "letter_counting", "config": {"min_words": 3, "max_words": 5}},
    {"name": "count_bits", "config": {"max_n": 1023}},
    {"name": "gcd", "config": {"max_value": 100}},
    {"name": "spell_backward", "config": {"min_word_len": 3, "max_word_len": 6}},
    {"name": "lcm", "config": {"max_value": 60}},
]  # fmt: skip
PASS1 = (0.2, 0.8)
GAP = 0.15


def verdict(pass1: float, pass_k: float) -> bool:
    """The rule: room to learn (pass@1 in [0.2, 0.8]) that sampling shows (pass@8 - pass@1
    at least 0.15).

    >>> verdict(0.5, 0.7), verdict(0.1, 0.6), verdict(0.5, 0.6)
    (True, False, False)
    """
    return PASS1[0] <= pass1 <= PASS1[1] and pass_k - pass1 >= GAP


def main() -> None:
    from grpo.config import load_config
    from grpo.data.sets import training_sets
    from grpo.eval.metrics import summarize
    from grpo.eval.run import generate_for_rows
    from grpo.launch.runner import run_sft
    from grpo.models.loading import device_for, load_model, load_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--per-generator", type=int, default=50, help="selection problems each")
    ap.add_argument("--sft-per-generator", type=int, default=25, help="answer-format examples")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--out", default="benchmarks/rg_headroom.jsonl")
    a = ap.parse_args()
    n = len(CANDIDATES)
    cfg = load_config(a.config, [
        f"data.generators={json.dumps(CANDIDATES)}", f"data.num_sft={a.sft_per_generator * n}",
        f"data.num_sft_val={10 * n}", f"data.num_select={a.per_generator * n}",
        f"data.num_train={n}", "data.num_heldout=1", "eval.sets=[rg:mix]",
        "tracking.promotion_metric=eval/rg_mix/accuracy",
    ])  # fmt: skip
    t0 = time.time()
    ref = run_sft(cfg)
    summary = json.loads((ref / "sft_summary.json").read_text())
    print(f"reference: {summary['steps']} SFT steps, best validation loss "
          f"{summary['best_val_loss']:.4f}, {time.time() - t0:.0f} s", flush=True)  # fmt: skip
    rows = training_sets(cfg)["select"]
    tok, device = load_tokenizer(ref), device_for(cfg)
    model = load_model(ref, cfg.model.dtype, trainable=False).to(device).eval()
    kw = {"batch_size": cfg.eval.batch_size, "max_new_tokens": cfg.eval.max_new_tokens}
    greedy = generate_for_rows(model, tok, rows, cfg, device, progress=True, **kw)
    sampled = generate_for_rows(model, tok, rows, cfg, device, samples=a.samples,
                                temperature=cfg.grpo.temperature, seed=1, progress=True,
                                top_k=cfg.grpo.top_k, top_p=cfg.grpo.top_p, **kw)  # fmt: skip
    gen_of = {r["id"]: r["generator"] for r in rows}
    lines = ["| generator | config | problems | greedy pass@1 | pass@8 | gap | joins |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for c in CANDIDATES:
        g = [r for r in greedy if gen_of[r["id"]] == c["name"]]
        s = [r for r in sampled if gen_of[r["id"]] == c["name"]]
        p1, pk = summarize(g)["accuracy"], summarize(s)[f"pass@{a.samples}"]
        rec = {"generator": c["name"], "config": c["config"], "problems": len(g),
               "greedy_pass@1": p1, f"pass@{a.samples}": pk, "joins": verdict(p1, pk),
               "sft_steps": summary["steps"],
               "greedy_mean_length": summarize(g)["mean_length"]}  # fmt: skip
        with open(a.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
        joins = "yes" if rec["joins"] else "no"
        lines.append(f"| {c['name']} | `{json.dumps(c['config'])}` | {len(g)} | {p1:.3f} | "
                     f"{pk:.3f} | {pk - p1:+.3f} | {joins} |")  # fmt: skip
    print("\n".join(lines), flush=True)
    print(f"total {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
