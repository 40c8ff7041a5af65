"""benchmarks/REAL_MODEL.md from a finished `grpo pipeline --config configs/smollm2-135m.yaml`.

Reads the pipeline's run directory (eval/<model>/samples.jsonl, grpo/metrics.jsonl, the
control's metrics) and writes the held-out table under two answer readings (strict: the reward's
own, math-verify on the <answer> block or the text's last expression; lenient: the last number
in the text), paired 95% intervals, the reward and length curves, and the same problems'
completions before and after. With --speed it also times the fast sampler against transformers'
generate at the config's batch, side by side (medians of --repeats).

    python benchmarks/real_model_report.py --run-dir runs/smollm2-135m/<parent run id> \
        --wall "52 min 10 s" [--speed]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LABELS = ("reference", "grpo", "sft_continued")


def _samples(run_dir: Path, label: str) -> list[dict]:
    path = run_dir / "eval" / label / "samples.jsonl"
    return [json.loads(x) for x in path.open()] if path.exists() else []


def _curves(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(1, 3, figsize=(13, 3.4))
    panels = (
        ("reward", "training reward (accuracy + soft overlong penalty)"),
        ("completions/mean_length", "completion tokens (mean)"),
        ("completions/clipped_ratio", "share hitting the token limit"),
    )
    for a, (key, title) in zip(ax, panels):
        a.plot(steps, [r[key] for r in rows], marker=".")
        a.set_title(title, fontsize=10)
        a.set_xlabel("GRPO step")
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def _speed(cfg_path: Path, repeats: int) -> list[str]:
    """Completions per second of both engines on the same prompts, side by side."""
    import torch

    from grpo.config import load_config
    from grpo.data.sets import training_sets
    from grpo.launch.paths import base_model_dir
    from grpo.models.generate import generate
    from grpo.models.loading import eos_token_ids, load_model, load_tokenizer
    from grpo.models.prompts import encode_prompts

    cfg = load_config(cfg_path)
    g = cfg.grpo
    model_dir = base_model_dir(cfg)
    tok, model = load_tokenizer(model_dir), load_model(model_dir, trainable=False)
    eos = eos_token_ids(tok, model)
    rows = training_sets(cfg)["train"][: g.prompts_per_step]
    ids, mask = encode_prompts(tok, [r["prompt"] for r in rows], cfg, torch.device("cpu"))
    times: dict[str, list[float]] = {"fast": [], "hf": []}
    tokens: dict[str, list[int]] = {"fast": [], "hf": []}
    for rep in range(repeats + 1):
        for engine in ("fast", "hf"):
            torch.manual_seed(rep)
            t0 = time.perf_counter()
            ro = generate(model, ids, mask, num_generations=g.num_generations,
                          max_completion_length=g.max_completion_length, eos_token_id=eos,
                          pad_token_id=tok.pad_token_id, temperature=g.temperature,
                          engine=engine)  # fmt: skip
            if rep:  # the first round warms both up
                times[engine].append(time.perf_counter() - t0)
                tokens[engine].append(int(ro.completion_mask.sum()))
    lines = ["| engine | median seconds | tokens / s |", "|---|---|---|"]
    for e in ("fast", "hf"):
        med = statistics.median(times[e])
        lines.append(f"| {e} | {med:.1f} | {statistics.median(tokens[e]) / med:.0f} |")
    ratio = statistics.median(times["hf"]) / statistics.median(times["fast"])
    lines.append("")
    lines.append(f"The fast sampler is {ratio:.2f}x transformers' generate in time at "
                 f"{g.prompts_per_step} prompts x {g.num_generations} completions x "
                 f"{g.max_completion_length} tokens, {torch.get_num_threads()} threads "
                 f"(medians of {repeats}, the engines alternated in one process).")  # fmt: skip
    return lines


def main() -> None:
    from grpo.eval.metrics import format_paired, paired_difference, summarize

    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--config", default=str(ROOT / "configs" / "smollm2-135m.yaml"))
    p.add_argument("--wall", required=True, help="the pipeline's measured wall time, as text")
    p.add_argument("--speed", action="store_true")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "REAL_MODEL.md"))
    a = p.parse_args()
    run_dir = Path(a.run_dir)
    samples = {label: _samples(run_dir, label) for label in LABELS}
    samples = {k: v for k, v in samples.items() if v}
    lines = [
        "# A real pretrained model on 2 CPU cores: SmolLM2-135M-Instruct",
        "",
        "Reproduce (after `make install-real`, no network):",
        "",
        "```text",
        "grpo pipeline --config configs/smollm2-135m.yaml",
        "python benchmarks/real_model_report.py --run-dir runs/smollm2-135m/<run id> --wall ... "
        "--speed",
        "```",
        "",
        f"Wall time of the whole pipeline: {a.wall} (conversion of the GGUF file, validation, "
        "GRPO and the control side by side, evaluation of three models, registration).",
        "",
        "## Held-out accuracy (synthetic addition, greedy, 64 new tokens)",
        "",
        "strict: the training reward's reading (math-verify on the `<answer>` block, else the "
        "text's final expression); lenient: the last number written anywhere in the text.",
        "",
        "| model | problems | strict | lenient | mean length | truncated |",
        "|---|---|---|---|---|---|",
    ]
    for label, recs in samples.items():
        m = summarize(recs)
        lines.append(
            f"| {label} | {int(m['num_problems'])} | {m['accuracy']:.3f} "
            f"[{m['accuracy_ci_low']:.3f}, {m['accuracy_ci_high']:.3f}] | "
            f"{m['accuracy_lenient']:.3f} | {m['mean_length']:.1f} | {m['truncation_rate']:.3f} |"
        )
    lines += ["", "Paired differences on the same problems (95% normal intervals):", "",
              "| comparison | strict | lenient |", "|---|---|---|"]  # fmt: skip
    for a_, b_ in (
        ("reference", "grpo"),
        ("sft_continued", "grpo"),
        ("reference", "sft_continued"),
    ):
        if a_ in samples and b_ in samples:
            d = paired_difference(samples[a_], samples[b_])
            dl = paired_difference(samples[a_], samples[b_], key="correct_lenient")
            lines.append(f"| {b_} - {a_} | {format_paired(d)} | {format_paired(dl)} |")
    metrics = [json.loads(x) for x in (run_dir / "grpo" / "metrics.jsonl").open()]
    _curves(metrics, ROOT / "benchmarks" / "real_model_curves.png")
    step_times = [r["step_time"] for r in metrics]
    control = run_dir / "sft_continued" / "control_summary.json"
    lines += [
        "",
        "## Training",
        "",
        f"GRPO: {len(metrics)} steps, median {statistics.median(step_times):.0f} s a step on one "
        f"core (the control trained on the other).",
    ]
    if control.exists():
        c = json.loads(control.read_text())
        lines.append(f"The control: {c['steps']} SFT steps in {c['seconds']:.0f} s on the "
                     "worked solutions, from the same instruct model.")  # fmt: skip
    lines += ["", "![curves](real_model_curves.png)", ""]
    if "grpo" in samples and "reference" in samples:
        lines += ["## The same problems before and after", "",
                  "| problem | gold | reference | grpo |", "|---|---|---|---|"]  # fmt: skip
        ref = {r["id"]: r for r in samples["reference"] if r["sample"] == 0}
        shown = 0
        for r in samples["grpo"]:
            if r["sample"] or r["id"] not in ref or shown >= 8:
                continue
            clip = lambda t: t.replace("\n", " ").replace("|", "/")[:110]  # noqa: E731
            lines.append(f"| `{r['prompt']}` | {r['gold']} | {clip(ref[r['id']]['completion'])} "
                         f"| {clip(r['completion'])} |")  # fmt: skip
            shown += 1
    if a.speed:
        lines += ["", "## The fast sampler on this model", ""] + _speed(Path(a.config), a.repeats)
    Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
