"""Rejection-sampling fine-tuning (RFT; expert iteration, STaR): the cheap baseline GRPO must
beat, or the method where it wins.

From the same reference, on GRPO's own answer-only prompts (the same prompt stream, in the
same order), with the same verifier: in each of rft.rounds rounds, sample k completions per
prompt at GRPO's temperature (and top-k/top-p), keep the distinct ones the verifier marks
correct (at most rft.max_per_prompt a prompt), and fine-tune on them, the loss on the
completion tokens only. The next round samples from the model the last one trained.

Compute is matched by sampled completions: RFT samples exactly as many as GRPO did (its
configured steps x prompts x group, or what its metrics say it sampled with dynamic sampling's
extra rounds), because sampling is most of a step's cost and the count does not depend on
the machine or on what else runs; RFT's fine-tuning on the kept completions costs less than
GRPO's update on all of them, so RFT never gets more compute than GRPO.

The checkpoint is chosen as GRPO's is (grpo.eval.selection): the highest greedy accuracy on the
selection split among the reference (round 0) and every round's model, the earliest on ties.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

from grpo.config import Config
from grpo.data.order import prompt_indices
from grpo.engine.loop import replace_dir
from grpo.eval.run import generate_for_rows
from grpo.eval.selection import RULE, Selection, last_dir
from grpo.models.loading import device_for, load_model, load_tokenizer

ROUNDS_DIR = "rft_rounds"


def completion_budget(cfg: Config, sampled_per_step: list[float] | None = None) -> int:
    """The completions RFT may sample: those GRPO sampled, from its per-step metrics when
    given (dynamic sampling draws extra rounds), else its configured steps x prompts x group.

    >>> from grpo.config import load_config
    >>> completion_budget(load_config(None, ["grpo.steps=10"]))  # 10 x 32 prompts x 8
    2560
    >>> completion_budget(load_config(None, ["grpo.steps=2"]), [256.0, 512.0])
    768
    """
    g = cfg.grpo
    if sampled_per_step:
        return int(round(sum(sampled_per_step)))
    return g.steps * g.prompts_per_step * g.num_generations


def round_plan(cfg: Config, budget: int, n_train: int) -> list[list[int]]:
    """The training-row indices of each round: GRPO's prompt stream (grpo.data.order, as one
    rank sees all of it) cut into rft.rounds rounds of budget / (rounds x k) prompts.

    >>> from grpo.config import load_config
    >>> cfg = load_config(None, ["rft.enabled=true", "rft.rounds=2"])
    >>> [len(r) for r in round_plan(cfg, 2560, 4000)]  # 2560 completions / 8 a prompt
    [160, 160]
    """
    r = cfg.rft
    k = r.samples_per_prompt or cfg.grpo.num_generations
    per_round = budget // (r.rounds * k)
    if per_round < 1:
        raise ValueError(
            f"RFT: a budget of {budget} completions is less than one prompt a round "
            f"({r.rounds} rounds x {k} samples); lower rft.rounds or rft.samples_per_prompt"
        )
    pps = cfg.grpo.prompts_per_step
    steps = math.ceil(per_round * r.rounds / pps)
    stream = [i for s in range(steps) for i in prompt_indices(s, 0, pps, 1, n_train, cfg.seed)]
    return [stream[j * per_round : (j + 1) * per_round] for j in range(r.rounds)]


def keep_correct(records: list[dict[str, Any]], max_per_prompt: int) -> list[dict[str, Any]]:
    """The completions to fine-tune on: correct (the verifier's verdict), distinct by text
    within a prompt, at most max_per_prompt a prompt, in the order sampled.

    >>> recs = [{"id": "a", "completion": t, "correct": c}
    ...         for t, c in [("x", True), ("x", True), ("y", False), ("z", True), ("w", True)]]
    >>> [r["completion"] for r in keep_correct(recs, 2)]
    ['x', 'z']
    """
    seen: dict[Any, set[str]] = {}
    out = []
    for r in records:
        texts = seen.setdefault(r["id"], set())
        if r["correct"] and r["completion"] not in texts and len(texts) < max_per_prompt:
            texts.add(r["completion"])
            out.append(r)
    return out


def train_rft(
    cfg: Config, policy_dir: str | Path, out_dir: str | Path, sets: dict[str, list[dict]],
    budget: int, progress: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """RFT from policy_dir, its selected round's weights to out_dir and its last round's to
    grpo.eval.selection.last_dir(out_dir); one record per round in out_dir's _metrics.jsonl, and
    each round's sampled and kept completions beside its weights (rft_rounds/round-N_*.jsonl).

    Args:
        cfg: the run's config (rft, grpo's sampling settings, sft's batch size).
        policy_dir: the reference it starts from.
        out_dir: where the selected weights go.
        sets: the task's sets: train (prompts), sft_val (the fine-tuning's validation loss)
            and select (the selection split; without one the last round is kept).
        budget: the completions it may sample (completion_budget).
        progress: show progress bars.
    """
    from grpo.engine.sft import train_fixed_steps

    r, g = cfg.rft, cfg.grpo
    k = r.samples_per_prompt or g.num_generations
    out_dir = Path(out_dir)
    work = out_dir.parent / ROUNDS_DIR
    work.mkdir(parents=True, exist_ok=True)
    device = device_for(cfg)
    rows = sets["train"]
    plan = round_plan(cfg, budget, len(rows))
    select_rows = sets.get("select") or []
    selection = Selection() if select_rows else None
    log_path = out_dir.with_name(out_dir.name + "_metrics.jsonl")
    log = log_path.open("w")
    current, t0 = Path(policy_dir), time.time()
    history: list[dict[str, Any]] = []

    def select(model_dir: Path, at: int) -> float | None:
        if selection is None:
            return None
        tok, model = load_tokenizer(model_dir), load_model(model_dir, cfg.model.dtype,
                                                            trainable=False).to(device)  # fmt: skip
        recs = generate_for_rows(model, tok, select_rows, cfg, device,
                                 batch_size=cfg.eval.batch_size)  # fmt: skip
        acc = sum(x["correct"] for x in recs) / len(recs)
        selection.record(at, acc)
        return acc

    start = {"round": 0, "select_accuracy": select(current, 0), "elapsed_s": 0.0}
    log.write(json.dumps(start) + "\n")
    history.append(start)
    for i, idx in enumerate(plan, 1):
        tok = load_tokenizer(current)
        model = load_model(current, cfg.model.dtype, trainable=False).to(device)
        prompts = [rows[j] for j in idx]
        recs = generate_for_rows(
            model, tok, prompts, cfg, device, samples=k, temperature=g.temperature,
            batch_size=cfg.eval.batch_size, max_new_tokens=g.max_completion_length,
            seed=cfg.seed * 1000 + i, progress=progress, bar_label=f"rft round {i} sampling",
            top_k=g.top_k, top_p=g.top_p,
        )  # fmt: skip
        del model
        kept = keep_correct(recs, r.max_per_prompt)
        # what each round sampled and learned from, for a person to read
        for name, part in (("samples", recs), ("kept", kept)):
            with (work / f"round-{i}_{name}.jsonl").open("w") as f:
                f.writelines(json.dumps(x) + "\n" for x in part)
        by_id = {row["id"]: row for row in prompts}
        sft_rows = [{**{c: by_id[x["id"]][c] for c in ("id", "prompt", "answer")},
                     "worked_solution": x["completion"]} for x in kept]  # fmt: skip
        rec: dict[str, Any] = {
            "round": i, "prompts": len(prompts), "sampled": len(recs),
            "correct": sum(x["correct"] for x in recs), "kept": len(kept),
            "prompts_with_kept": len({x["id"] for x in kept}),
        }  # fmt: skip
        target = work / f"round-{i}"
        if sft_rows:
            steps = math.ceil(len(sft_rows) * r.epochs / cfg.sft.batch_size)
            lr = r.lr or cfg.sft.control_lr or cfg.sft.lr
            summary = train_fixed_steps(cfg, current, target,
                                        {"sft": sft_rows, "sft_val": sets["sft_val"]}, steps,
                                        lr=lr, progress=progress)  # fmt: skip
            rec |= {"sft_steps": summary["steps"], "val_loss": summary["best_val_loss"]}
        else:  # nothing correct to learn from: the round leaves the model as it was
            shutil.copytree(current, target, dirs_exist_ok=True)
            rec["sft_steps"] = 0
        current = target
        rec["select_accuracy"] = select(current, i)
        rec["elapsed_s"] = time.time() - t0
        log.write(json.dumps(rec) + "\n")
        log.flush()
        history.append(rec)
    log.close()
    chosen = selection.best()[0] if selection is not None else len(plan)
    chosen_dir = Path(policy_dir) if chosen == 0 else work / f"round-{chosen}"
    replace_dir(chosen_dir, out_dir)
    replace_dir(current, last_dir(out_dir))
    sampled = sum(h.get("sampled", 0) for h in history)
    summary = {
        "rounds": len(plan), "budget": budget, "sampled": sampled,
        "kept": sum(h.get("kept", 0) for h in history),
        "sft_steps": sum(h.get("sft_steps", 0) for h in history),
        "seconds": time.time() - t0, "history": history,
    }  # fmt: skip
    if selection is not None:
        summary["selection"] = {**selection.summary(len(plan)), "rule": RULE + " (by round)"}
    return summary
