"""Held-out evaluation runs: generation in length-sorted batches, math-verify scoring, reports.

The metrics themselves are pure functions in grpo.eval.metrics.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import torch

from grpo.config import Config
from grpo.data.sets import eval_set
from grpo.eval.metrics import format_paired, markdown_table, paired_strict_lenient, summarize
from grpo.models.generate import generate
from grpo.models.loading import eos_token_ids
from grpo.models.prompts import (
    encode_prompts,
    eval_prompt_limit,
    left_out_line,
    split_by_prompt_length,
)
from grpo.progress import progress_bar
from reward_fns import extract_answer, verdicts

# a prime larger than any batch count: (seed, batch) pairs never share a seed
SEED_STRIDE = 1_000_003


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
    bar_label: str = "evaluate",
    top_k: int = 0,
    top_p: float = 1.0,
) -> list[dict[str, Any]]:
    """One record per (row, sample): id, sample, prompt, completion, extracted, gold, correct
    (the verifier's, reward_fns.verdicts). samples > 1 draws at `temperature`, truncated by
    top_k/top_p (RFT samples as GRPO does)."""
    max_new = max_new_tokens or cfg.grpo.max_completion_length
    eos_ids = eos_token_ids(tokenizer, model)
    toolbox = None
    if cfg.tools.active:  # a model trained with tools is evaluated with them, episode by episode
        from grpo.models.episodes import Toolbox

        toolbox = Toolbox(cfg)
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["prompt"]))
    per_batch = max(1, batch_size // samples)
    records: list[dict[str, Any]] = []
    bar = progress_bar(len(rows), bar_label, "problem", enabled=progress)
    for b, start in enumerate(range(0, len(order), per_batch)):
        idx = order[start : start + per_batch]
        batch = [rows[i] for i in idx]
        # per-batch seed: the same samples for any model evaluated on the same rows
        torch.manual_seed(seed * SEED_STRIDE + b)
        episodes = None
        if toolbox is not None:
            from grpo.models.episodes import final_answer, run_tool_round, transcript_text

            sampled = run_tool_round(model, tokenizer, cfg, batch, toolbox, device, eos_ids,
                                     samples=samples, max_tokens=max_new,
                                     do_sample=samples > 1)  # fmt: skip
            ro, episodes = sampled.rollout, sampled.episodes
            texts = [final_answer(e) for e in episodes]
        else:
            ids, mask = encode_prompts(tokenizer, [r["prompt"] for r in batch], cfg, device)
            ro = generate(
                model, ids, mask,
                num_generations=samples, max_completion_length=max_new,
                eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id,
                temperature=temperature, do_sample=samples > 1,
                engine=cfg.model.generation_engine, top_k=top_k, top_p=top_p,
            )  # fmt: skip
            texts = tokenizer.batch_decode(ro.completion_ids, skip_special_tokens=True)
        judged = verdicts(texts, [r for r in batch for _ in range(samples)])
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
                    "correct": judged[j][0],
                    "correct_lenient": judged[j][1],
                    "length": int(ro.completion_mask[j].sum()),
                    "truncated": bool(ro.truncated[j]),
                    **{k: row[k] for k in ("subject", "level", "generator") if k in row},
                }
            )
            if episodes is not None:  # the whole episode, for a person to read
                ep = episodes[j]
                records[-1] |= {"transcript": transcript_text(ep), "turns": ep.turns,
                                "tool_calls": len(ep.calls), "tool_errors": ep.tool_errors,
                                "ended_by": ep.ended_by}  # fmt: skip
        bar.update(len(batch))
    bar.close()
    return records


def pass_k_rows(rows: list[dict[str, Any]], limit: int | None, seed: int) -> list[dict[str, Any]]:
    """The problems sampled pass@k is measured on: `limit` of them drawn at random with `seed`,
    in the set's order (all of them for None). Drawn, not the first ones: a set ordered by
    kind (a file sorted by source or difficulty) would otherwise be measured on its first kind
    alone.

    >>> rows = [{"id": i} for i in range(10)]
    >>> [r["id"] for r in pass_k_rows(rows, 4, 0)] == [r["id"] for r in pass_k_rows(rows, 4, 0)]
    True
    >>> len(pass_k_rows(rows, 4, 0)), len(pass_k_rows(rows, None, 0)), len(pass_k_rows(rows, 99, 0))
    (4, 10, 10)
    """
    if limit is None or limit >= len(rows):
        return list(rows)
    picked = sorted(random.Random(seed).sample(range(len(rows)), limit))
    return [rows[i] for i in picked]


def evaluate_model(
    cfg: Config,
    model_dir: str,
    sets: list[str],
    out_dir: str,
    *,
    samples: int = 1,
    limit: int | None = None,
    progress: bool = True,
    base: str | None = None,
    pass_k: int | None = None,
    bar_label: str = "evaluate",
    without_tools: bool = False,
) -> dict[str, Any]:
    """Evaluate a model directory on named sets; writes report.json, samples.jsonl, report.md.

    Args:
        cfg: the run's config (prompts, generation engine, eval settings).
        model_dir: a model directory, or a LoRA adapter directory merged into `base` (default:
            the base its adapter config names).
        sets: eval set names or file paths (grpo.data.sets.eval_set).
        out_dir: where the report and per-sample files go.
        samples: completions per problem (1: greedy).
        limit: the first `limit` problems of each set.
        progress: show a progress bar.
        base: the base model of a LoRA adapter.
        pass_k: sampled completions per problem at grpo.temperature beside the greedy one, for
            sampled_pass@k and sampled_maj@k on eval.pass_k_limit problems of the first set
            drawn by pass_k_rows
            (default: eval.pass_k; their records go to samples_sampled.jsonl).
        bar_label: the progress bar's name.
        without_tools: evaluate without the config's tools (plain completions, prompts that
            list no tools), as a model trained with them would answer alone.
    """
    if without_tools:
        cfg = cfg.model_copy(update={"tools": type(cfg.tools)()})
    from grpo.models import lora
    from grpo.models.loading import device_for, load_model, load_tokenizer

    device = device_for(cfg)
    tok = load_tokenizer(model_dir)
    if lora.is_adapter_dir(model_dir):
        model = lora.load_merged(model_dir, base, cfg.model.dtype).to(device)
    else:
        model = load_model(model_dir, cfg.model.dtype, trainable=False).to(device)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"model": str(model_dir), "sets": {}}
    all_records, sampled_records = [], []
    shots = few_shot_prefix(cfg)
    prompt_limit = eval_prompt_limit(cfg, getattr(model.config, "max_position_embeddings", None))
    for name in sets:
        rows = eval_set(name, cfg)[:limit] if limit else eval_set(name, cfg)
        rows, left_out = split_by_prompt_length(tok, cfg, rows, prompt_limit)
        if left_out:
            ids = [str(r["id"]) for r in left_out]
            print(left_out_line(name, ids, len(rows) + len(left_out), prompt_limit),
                  file=sys.stderr)  # fmt: skip
        if shots:
            rows = [{**r, "prompt": shots + r["prompt"]} for r in rows]
        recs = generate_for_rows(
            model, tok, rows, cfg, device, samples=samples, temperature=cfg.eval.temperature,
            batch_size=cfg.eval.batch_size, max_new_tokens=cfg.eval.max_new_tokens,
            seed=cfg.seed, progress=progress, bar_label=bar_label,
        )  # fmt: skip
        for r in recs:
            r["set"] = name
        report["sets"][name] = summarize(recs)
        k = cfg.eval.pass_k if pass_k is None else pass_k
        if k and samples == 1 and name == sets[0]:  # k samples cost k greedy evaluations
            sampled = generate_for_rows(
                model, tok, pass_k_rows(rows, cfg.eval.pass_k_limit, cfg.seed), cfg, device,
                samples=k,
                temperature=cfg.grpo.temperature, batch_size=cfg.eval.batch_size,
                max_new_tokens=cfg.eval.max_new_tokens, seed=cfg.seed + 1, progress=progress,
                bar_label=f"{bar_label} (pass@{k})",
            )  # fmt: skip
            for r in sampled:
                r["set"] = name
            s = summarize(sampled)
            report["sets"][name].update(
                {f"sampled_{key}": v for key, v in s.items()
                 if key.startswith(("pass@", "maj@")) or key == "mean_accuracy"}
            )  # fmt: skip
            report["sets"][name]["sampled_problems"] = float(len(sampled) // k)
            sampled_records += sampled
        report["sets"][name]["left_out"] = float(len(left_out))
        report["sets"][name]["left_out_ids"] = [str(r["id"]) for r in left_out]
        for key in ("subject", "level", "generator"):
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
    if sampled_records:
        with (out / "samples_sampled.jsonl").open("w") as f:
            for r in sampled_records:
                f.write(json.dumps(r) + "\n")
    (out / "report.md").write_text(markdown_table(report))
    return report


def evaluate_models(
    cfg: Config, jobs: dict[str, dict[str, Any]], workers: int = 1
) -> dict[str, dict[str, Any]]:
    """Several models' evaluate_model, `workers` at a time.

    Args:
        cfg: the run's config.
        jobs: label -> evaluate_model's keyword arguments (model_dir, sets, out_dir, ...).
        workers: evaluations at once. Above 1 each model's sets are evaluated as parts of their
            own, largest first, each in a process with this process's threads shared out
            equally (at least one each), and put back together per model: two single-thread
            generation loops on two cores do more than one loop on both, and gave the same
            completions where measured (benchmarks/REAL_MODEL.md); a different thread count
            may change a matmul's summation order on another CPU. Parts by set keep every
            worker busy to the end, where whole models would leave the last one alone on one
            core.

    Returns: label -> report (as evaluate_model's, and its files in each job's out_dir), in the
    order of `jobs`.
    """
    if workers == 1 or (len(jobs) == 1 and len(next(iter(jobs.values()))["sets"]) == 1):
        return {label: evaluate_model(cfg, **kw, bar_label=label) for label, kw in jobs.items()}
    import multiprocessing
    import shutil

    parts = _parts_by_set(cfg, jobs)
    threads = max(1, torch.get_num_threads() // workers)
    ctx = multiprocessing.get_context("spawn")  # no forked copy of a parent's torch threads
    # leaving the block terminates the pool: a failed evaluation (or Ctrl-C) stops the others
    with ctx.Pool(min(workers, len(parts))) as pool:
        pending = [pool.apply_async(_evaluate_on_threads,
                                    (threads, cfg, f"{label} {kw['sets'][0]}", kw))
                   for label, kw in parts]  # fmt: skip
        while waiting := [r for r in pending if not r.ready()]:
            for r in pending:
                if r.ready() and not r.successful():
                    r.get()  # raises that evaluation's error, not after the others finish
            waiting[0].wait(0.5)
        done = [r.get() for r in pending]
    reports = {}
    for label, kw in jobs.items():
        out = Path(kw["out_dir"])
        mine = {p["sets"][0]: (Path(p["out_dir"]), rep)
                for (lb, p), rep in zip(parts, done, strict=True) if lb == label}  # fmt: skip
        report: dict[str, Any] = {"model": str(kw["model_dir"]), "sets": {}}
        with (out / "samples.jsonl").open("w") as f:
            for s in kw["sets"]:  # in the job's order, as one evaluate_model writes them
                part_dir, rep = mine[s]
                report["sets"][s] = rep["sets"][s]
                f.write((part_dir / "samples.jsonl").read_text())
                if (sampled := part_dir / "samples_sampled.jsonl").exists():
                    shutil.copyfile(sampled, out / "samples_sampled.jsonl")
        (out / "report.json").write_text(json.dumps(report, indent=2))
        (out / "report.md").write_text(markdown_table(report))
        shutil.rmtree(out / "parts")
        reports[label] = report
    return reports


def _parts_by_set(cfg: Config, jobs: dict[str, dict[str, Any]]) -> list[tuple[str, dict]]:
    """Each job as one part per set (the first set's carries the sampled pass@k), written under
    its out_dir's `parts/`, ordered by their generations (problems, times k + 1 with pass@k),
    largest first."""
    sizes: dict[str, int] = {}
    parts = []
    for label, kw in jobs.items():
        out = Path(kw["out_dir"])
        out.mkdir(parents=True, exist_ok=True)
        for i, s in enumerate(kw["sets"]):
            if s not in sizes:
                sizes[s] = len(eval_set(s, cfg))
            n = min(sizes[s], kw.get("limit") or sizes[s])
            k = cfg.eval.pass_k if kw.get("pass_k") is None else kw["pass_k"]
            k = k if i == 0 and kw.get("samples", 1) == 1 else 0
            cost = n * kw.get("samples", 1) + k * min(n, cfg.eval.pass_k_limit or n)
            part = {**kw, "sets": [s], "pass_k": k, "out_dir": str(out / "parts" / str(i))}
            parts.append((cost, len(parts), label, part))
    return [(label, part) for _, _, label, part in sorted(parts, key=lambda x: (-x[0], x[1]))]


def _evaluate_on_threads(
    threads: int, cfg: Config, label: str, kw: dict[str, Any]
) -> dict[str, Any]:
    torch.set_num_threads(threads)
    return evaluate_model(cfg, **kw, bar_label=label)


def few_shot_prefix(cfg: Config) -> str:
    """k worked examples from the SFT set, each prompt + solution, before the real prompt."""
    if not cfg.eval.few_shot:
        return ""
    from grpo.data.files import DataError
    from grpo.data.sets import training_sets

    sft = training_sets(cfg).get("sft", [])
    if len(sft) < cfg.eval.few_shot:
        raise DataError(f"eval.few_shot={cfg.eval.few_shot} but only {len(sft)} SFT examples")
    return "".join(r["prompt"] + r["worked_solution"] + "\n" for r in sft[: cfg.eval.few_shot])


def default_report_dir(cfg: Config, model: str | Path) -> Path:
    """Where `grpo evaluate` writes when not told: under the run directory, named after the
    model directory and a hash of its full path, so that two models both called `policy` (every
    GRPO run's is) never overwrite each other's report."""
    import hashlib

    path = Path(model).resolve()
    return (
        cfg.run_dir() / "eval" / f"{path.name}-{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"
    )


def evaluate_against_baseline(
    cfg: Config, model_dir: str, baseline_dir: str, sets: list[str], out_dir: str, *,
    samples: int = 1, limit: int | None = None, base: str | None = None,
    baseline_cfg: Config | None = None,
) -> tuple[dict[str, Any], str]:  # fmt: skip
    """Evaluate a model and a baseline on the same problems and samples, paired.

    Args:
        cfg: the config (eval settings, prompts).
        model_dir: the model evaluated; its report goes to out_dir.
        baseline_dir: the model it is compared with; its report goes to out_dir + "_baseline".
        sets: the evaluation sets.
        out_dir: where the combined report (report.json) is written.
        samples, limit, base: as evaluate_model.
        baseline_cfg: the baseline's own config (default cfg): the same model without its
            tools, for instance.

    Returns the model's report with the baseline's ("baseline") and the paired differences by
    set ("paired_vs_baseline": strict and lenient), and the lines that print them."""
    report = evaluate_model(cfg, model_dir, sets, out_dir, samples=samples, limit=limit,
                            base=base)  # fmt: skip
    base_out = f"{out_dir}_baseline"
    base_report = evaluate_model(baseline_cfg or cfg, baseline_dir, sets, base_out,
                                 samples=samples, limit=limit, base=base)  # fmt: skip
    mine = [json.loads(x) for x in Path(out_dir, "samples.jsonl").open()]
    theirs = [json.loads(x) for x in Path(base_out, "samples.jsonl").open()]
    lines = [
        markdown_table(report),
        f"baseline\n\n{markdown_table(base_report)}",
        f"{model_dir} - {baseline_dir} (same problems and samples, paired 95% CI):",
    ]
    paired = {}
    for s in sets:
        paired[s] = paired_strict_lenient([r for r in theirs if r["set"] == s],
                                          [r for r in mine if r["set"] == s])  # fmt: skip
        lines.append(f"  {s:16s} {format_paired(paired[s]['strict'])}  "
                     f"lenient {format_paired(paired[s]['lenient'])}")  # fmt: skip
    # one report for both models: the baseline's own numbers, then the differences
    report = {**report, "baseline": base_report, "paired_vs_baseline": paired}
    Path(out_dir, "report.json").write_text(json.dumps(report, indent=2))
    return report, "\n".join(lines)
