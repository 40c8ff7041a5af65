"""Held-out evaluation: generation in length-sorted batches, math-verify scoring, metrics.

Metrics: greedy pass@1 with a Wilson 95% interval; with n samples per problem also mean accuracy,
maj@k and the unbiased pass@k estimator (Chen et al. 2021); mean completion length, truncation.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import torch

from grpo.config import Config
from grpo.distributed import BAR_INTERVAL
from grpo.modeling import encode_prompts
from grpo.rollout import generate
from reward_fns import accuracy, extract_answer

Z95 = 1.959963984540054


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k).

    >>> round(pass_at_k(4, 1, 2), 4)
    0.5
    """
    if k > n:
        raise ValueError(f"k: {k} exceeds the number of samples {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def majority_correct(answers: list[str], correct: list[bool]) -> bool:
    """maj@k: is the most frequent extracted answer correct? Ties go to the first seen."""
    if not answers:
        return False
    counts = Counter(answers)
    top = max(counts.values())
    winner = next(a for a in answers if counts[a] == top)
    return correct[answers.index(winner)]


def wilson_interval(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a proportion."""
    if n == 0:
        return (0.0, 0.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


@torch.no_grad()
def generate_for_rows(
    model: torch.nn.Module,
    tokenizer: Any,
    rows: list[dict[str, Any]],
    cfg: Config,
    device: torch.device,
    *,
    samples: int = 1,
    temperature: float = 1.0,
    batch_size: int = 256,
    max_new_tokens: int | None = None,
    seed: int = 0,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """One record per (row, sample): id, sample, prompt, completion, extracted, gold, correct."""
    from tqdm import tqdm

    max_new = max_new_tokens or cfg.grpo.max_completion_length
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["prompt"]))
    per_batch = max(1, batch_size // samples)
    records: list[dict[str, Any]] = []
    bar = tqdm(
        total=len(rows), desc="evaluate", unit="problem", disable=not progress,
        mininterval=BAR_INTERVAL,
    )  # fmt: skip
    for b, start in enumerate(range(0, len(order), per_batch)):
        idx = order[start : start + per_batch]
        batch = [rows[i] for i in idx]
        ids, mask = encode_prompts(tokenizer, [r["prompt"] for r in batch], cfg, device)
        torch.manual_seed(seed * 1_000_003 + b)  # per-batch seed: same samples for any model
        ro = generate(
            model, ids, mask,
            num_generations=samples, max_completion_length=max_new,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
            temperature=temperature, do_sample=samples > 1,
            zero_stage=cfg.deepspeed.zero_stage, engine=cfg.model.generation_engine,
        )  # fmt: skip
        texts = tokenizer.batch_decode(ro.completion_ids, skip_special_tokens=True)
        golds = [r["answer"] for r in batch for _ in range(samples)]
        scores = accuracy(texts, golds)
        for j, text in enumerate(texts):
            row = batch[j // samples]
            records.append(
                {
                    "id": row["id"],
                    "sample": j % samples,
                    "prompt": row["prompt"],
                    "completion": text,
                    "extracted": extract_answer(text),
                    "gold": row["answer"],
                    "correct": bool(scores[j]),
                    "length": int(ro.completion_mask[j].sum()),
                    "truncated": bool(ro.truncated[j]),
                    **{k: row[k] for k in ("subject", "level") if k in row},
                }
            )
        bar.update(len(batch))
    bar.close()
    return records


def summarize(records: list[dict[str, Any]]) -> dict[str, float]:
    """Metrics recomputable from the per-sample records alone."""
    by_id: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_id.setdefault(r["id"], []).append(r)
    n_problems = len(by_id)
    n = min(len(v) for v in by_id.values()) if by_id else 0
    first = [v[0]["correct"] for v in by_id.values()]
    acc = sum(first) / max(1, n_problems)
    lo, hi = wilson_interval(sum(first), n_problems)
    out = {
        "accuracy": acc,
        "accuracy_ci_low": lo,
        "accuracy_ci_high": hi,
        "num_problems": float(n_problems),
        "samples": float(n),
        "mean_length": sum(r["length"] for r in records) / max(1, len(records)),
        "truncation_rate": sum(r["truncated"] for r in records) / max(1, len(records)),
    }
    if n > 1:
        out["mean_accuracy"] = sum(r["correct"] for r in records) / len(records)
        k = 1
        while k <= n:
            out[f"pass@{k}"] = (
                sum(pass_at_k(n, sum(x["correct"] for x in v[:n]), k) for v in by_id.values())
                / n_problems
            )
            out[f"maj@{k}"] = (
                sum(
                    majority_correct([x["extracted"] for x in v[:k]], [x["correct"] for x in v[:k]])
                    for v in by_id.values()
                )
                / n_problems
            )
            k *= 2
    return out


def paired_difference(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> dict[str, float]:
    """b - a accuracy on the same problems (first sample each), with a 95% normal interval."""
    ca = {r["id"]: r["correct"] for r in a if r["sample"] == 0}
    cb = {r["id"]: r["correct"] for r in b if r["sample"] == 0}
    ids = sorted(set(ca) & set(cb))
    d = [float(cb[i]) - float(ca[i]) for i in ids]
    n = len(d)
    mean = sum(d) / max(n, 1)
    var = sum((x - mean) ** 2 for x in d) / max(n - 1, 1)
    half = Z95 * math.sqrt(var / max(n, 1))
    return {"diff": mean, "ci_low": mean - half, "ci_high": mean + half, "n": float(n)}


def evaluate_model(
    cfg: Config,
    model_dir: str,
    sets: list[str],
    out_dir: str,
    *,
    samples: int = 1,
    limit: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Evaluate a model directory on named sets; writes report.json, samples.jsonl, report.md."""
    import json
    from pathlib import Path

    from grpo.data import eval_set
    from grpo.distributed import device_for
    from grpo.modeling import load_model, load_tokenizer

    device = device_for(cfg)
    tok = load_tokenizer(model_dir)
    model = load_model(model_dir, cfg.model.dtype, trainable=False).to(device)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"model": str(model_dir), "sets": {}}
    all_records = []
    shots = few_shot_prefix(cfg)
    for name in sets:
        rows = eval_set(name, cfg)[:limit] if limit else eval_set(name, cfg)
        if shots:
            rows = [{**r, "prompt": shots + r["prompt"]} for r in rows]
        recs = generate_for_rows(
            model, tok, rows, cfg, device, samples=samples, temperature=cfg.eval.temperature,
            batch_size=cfg.eval.batch_size, max_new_tokens=cfg.eval.max_new_tokens,
            seed=cfg.seed, progress=progress,
        )  # fmt: skip
        for r in recs:
            r["set"] = name
        report["sets"][name] = summarize(recs)
        for key in ("subject", "level"):
            groups = sorted({str(r[key]) for r in recs if key in r})
            if groups:
                report["sets"][name][f"by_{key}"] = {
                    g: summarize([r for r in recs if str(r.get(key)) == g])["accuracy"]
                    for g in groups
                }
        all_records += recs
    (out / "report.json").write_text(json.dumps(report, indent=2))
    with (out / "samples.jsonl").open("w") as f:
        for r in all_records:
            f.write(json.dumps(r) + "\n")
    (out / "report.md").write_text(markdown_table(report))
    return report


def few_shot_prefix(cfg: Config) -> str:
    """k worked examples from the SFT set, each prompt + solution, before the real prompt."""
    if not cfg.eval.few_shot:
        return ""
    from grpo.data import DataError, training_sets

    sft = training_sets(cfg).get("sft", [])
    if len(sft) < cfg.eval.few_shot:
        raise DataError(f"eval.few_shot={cfg.eval.few_shot} but only {len(sft)} SFT examples")
    return "".join(r["prompt"] + r["solution"] + "\n" for r in sft[: cfg.eval.few_shot])


def markdown_table(report: dict[str, Any]) -> str:
    lines = [
        f"Model: `{report['model']}`",
        "",
        "| set | problems | accuracy | 95% CI | mean length | truncated |",
        "|---|---|---|---|---|---|",
    ]
    for name, m in report["sets"].items():
        lines.append(
            f"| {name} | {int(m['num_problems'])} | {m['accuracy']:.3f} | "
            f"[{m['accuracy_ci_low']:.3f}, {m['accuracy_ci_high']:.3f}] | "
            f"{m['mean_length']:.1f} | {m['truncation_rate']:.3f} |"
        )
    return "\n".join(lines) + "\n"
