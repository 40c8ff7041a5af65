"""SFT build of the reference policy: worked solutions, loss on the completion tokens only.

Trained until the validation loss on held-back worked solutions stops improving, also after the
learning rate has been cut (`PlateauLR`), and the best checkpoint is kept: the reference is as
good as its data allows, so that any later gain is GRPO's and not an undertrained starting
point's. The control run is SFT simply continued for the GRPO stage's wall time: given in seconds
(`max_seconds`, after GRPO) or by following GRPO's pace file while it trains (`follow`).
"""

from __future__ import annotations

import itertools
import json
import math
import random
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from grpo.config import Config
from grpo.engine.deepspeed_setup import build_engine, gathered, save_policy
from grpo.engine.distributed import all_reduce_sum, init_distributed
from grpo.engine.pace import control_budget, read_pace
from grpo.engine.schedules import PlateauLR, paced_cosine
from grpo.eval.run import generate_for_rows
from grpo.eval.selection import Selection, last_dir
from grpo.models.loading import device_for, load_model, load_tokenizer
from grpo.models.prompts import render_prompt
from grpo.progress import progress_bar


def _encode(tokenizer: Any, rows: list[dict], cfg: Config) -> list[tuple[list[int], list[int]]]:
    """(prompt + solution + EOS token ids, 1 where the loss counts) per row: the solution's
    tokens. With tools, a demonstration is laid out as an episode is (its tool responses
    rendered by the chat format, out of the loss: grpo.models.episodes.encode_demos)."""
    if cfg.tools.active:
        from grpo.models.episodes import encode_demos

        return encode_demos(tokenizer, rows, cfg)
    out = []
    for r in rows:
        p = tokenizer(render_prompt(tokenizer, r["prompt"], cfg), add_special_tokens=False)
        s = tokenizer(r["worked_solution"], add_special_tokens=False)
        seq = p["input_ids"] + s["input_ids"] + [tokenizer.eos_token_id]
        out.append((seq, [0] * len(p["input_ids"]) + [1] * (len(s["input_ids"]) + 1)))
    return out


def _collate(items: list[tuple[list[int], list[int]]], pad: int, device: torch.device) -> dict:
    width = max(len(ids) for ids, _ in items)
    ids = torch.full((len(items), width), pad, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for i, (seq, trained) in enumerate(items):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
        # the loss on the solution's tokens only (the model's turns of a demonstration)
        labels[i, : len(seq)] = torch.where(torch.tensor(trained, dtype=torch.bool),
                                            torch.tensor(seq), -100)  # fmt: skip
    return {
        "input_ids": ids.to(device),
        "attention_mask": mask.to(device),
        "labels": labels.to(device),
    }


def _token_loss(model: Any, batch: dict) -> tuple[torch.Tensor, int]:
    """Sum of token cross-entropies and the number of target tokens."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = batch["labels"][:, 1:]
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
        targets.reshape(-1),
        ignore_index=-100,
        reduction="sum",
    )
    return loss, int((targets != -100).sum())


@torch.no_grad()
def _val_loss(engine: Any, data: list, pad: int, device: torch.device, bs: int) -> float:
    engine.eval()
    total, count = 0.0, 0
    for s in range(0, len(data), bs):
        loss, n = _token_loss(engine, _collate(data[s : s + bs], pad, device))
        total, count = total + float(loss), count + n
    engine.train()
    total, count = all_reduce_sum([total, count], device)
    return total / max(count, 1)


class _Budget:
    """The control's budget: seconds from the first call, the progress of a followed run, or a
    number of its own steps (the one budget that does not depend on how fast anything ran)."""

    def __init__(
        self, seconds: float | None, follow: Path | None, steps: int | None = None,
        threads_after: int | None = None,
    ) -> None:  # fmt: skip
        control_budget(seconds, follow, steps)
        if threads_after is not None and (follow is None or threads_after < 1):
            raise ValueError(
                f"threads_after ({threads_after}) needs a followed run and at least 1 thread"
            )
        self.seconds, self.follow, self.steps = seconds, follow, steps
        self.threads_after = threads_after
        self.t0: float | None = None
        self.done = False
        self.step = 0  # steps taken, set by the training loop

    def fraction(self) -> float:
        """Called by the learning-rate schedule at every optimizer step (warmup included)."""
        if self.steps is not None:
            return self.step / self.steps
        if self.follow is not None:
            # one read per step: `spent` after the step uses the done flag read here
            frac, self.done = read_pace(self.follow)
            if self.done and self.threads_after:
                # the followed run has ended: its cores are free for the last step and the
                # final validation and selection
                torch.set_num_threads(self.threads_after)
                self.threads_after = None
            return frac
        if self.t0 is None:  # the clock starts at the first step
            self.t0 = time.time()
        if not self.seconds:  # a budget of 0 s (GRPO resumed with nothing left): one step
            return 1.0
        return (time.time() - self.t0) / self.seconds

    def spent(self) -> bool:
        if self.steps is not None:
            return self.step >= self.steps
        if self.follow is not None:
            return self.done
        return self.seconds is not None and self.fraction() >= 1.0


# validation batches: the whole validation set at once fits any machine this runs on, and
# the batch only changes speed, not the loss
VAL_BATCH = 256


class _PlateauStop:
    """The reference's stop rules: the learning rate cut on plateaus, a new best validation loss
    keeps its weights (never a smaller gain than min_delta, which is noise), the last plateau
    ends training."""

    def __init__(self, plateau: PlateauLR) -> None:
        self.plateau, self.lr_fn, self.best = plateau, plateau, math.inf
        self.stopped = False

    def before_optimizer_step(self, step: int) -> None:
        pass

    def after_step(self, device: torch.device, world: int) -> bool:
        return False  # only validations end it

    def keep(self, rec: dict[str, float]) -> bool:
        vl = rec["val_loss"]
        better = vl < self.best - self.plateau.min_delta
        self.best = min(self.best, vl)
        self.stopped = self.plateau.report(vl)
        return better

    def cuts(self, total: int) -> str:
        return f"{self.plateau.cuts_made}/{total}"


class _BudgetStop:
    """The control's stop rules: the rate anneals over its budget, which ends training when spent;
    with a selection split it keeps its best step by GRPO's rule (grpo.eval.selection),
    otherwise its last weights."""

    def __init__(self, budget: _Budget, warmup: int, select: Callable[[], float] | None) -> None:
        self.budget, self.select = budget, select
        self.lr_fn = paced_cosine(warmup, budget.fraction)
        self.selection = Selection() if select is not None else None
        self.best, self.stopped = math.inf, False

    def before_optimizer_step(self, step: int) -> None:
        # counted before the optimizer step, which sets the next step's rate: that rate then
        # has this step done, and is zero after a step budget's last step
        self.budget.step = step + 1

    def after_step(self, device: torch.device, world: int) -> bool:
        spent = self.budget.spent()
        if world > 1:  # ranks' clocks differ: all stop at the same step
            spent = all_reduce_sum([float(spent)], device)[0] > 0
        self.stopped = spent
        return spent

    def keep(self, rec: dict[str, float]) -> bool:
        if "val_loss" in rec:
            self.best = min(self.best, rec["val_loss"])
        if self.selection is None:
            return True
        rec["select_accuracy"] = self.select()
        return self.selection.record(int(rec["step"]), rec["select_accuracy"])

    def cuts(self, total: int) -> str:
        return "-"


def train_reference(
    cfg: Config, base_dir: str | Path, out_dir: str | Path, sets: dict[str, list[dict]],
    progress: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """The reference: fine-tune base_dir on sets['sft'] until the validation loss on
    sets['sft_val'] plateaus after its learning-rate cuts (or max_epochs ends it); the best
    validated weights go to out_dir. The last step is always validated, so out_dir is written
    even by a run shorter than one validation interval."""
    s = cfg.sft
    plateau = PlateauLR(s.warmup_steps, s.patience, s.lr_cuts, s.lr_cut_factor)
    return _train(cfg, base_dir, out_dir, sets, range(s.max_epochs),
                  lambda _select: _PlateauStop(plateau), lr=s.lr, progress=progress)  # fmt: skip


def train_control(
    cfg: Config, policy_dir: str | Path, out_dir: str | Path, sets: dict[str, list[dict]],
    *, max_seconds: float | None = None, follow: Path | None = None,
    max_steps: int | None = None, threads_after: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The control: SFT continued from policy_dir for GRPO's wall time, given in seconds
    (max_seconds) or by following GRPO's pace file (follow), or for max_steps steps
    (sft.control_steps), its learning rate (sft.control_lr, else sft.lr) annealed over that
    budget whatever the plateaus; its last weights go to out_dir. threads_after: with follow,
    the CPU threads to use once the followed run is done (its cores are then free)."""
    budget = _Budget(max_seconds, follow, max_steps, threads_after)

    def rules(select: Callable[[], float] | None) -> _BudgetStop:
        return _BudgetStop(budget, cfg.sft.warmup_steps, select if sets.get("select") else None)

    lr = cfg.sft.control_lr if cfg.sft.control_lr is not None else cfg.sft.lr
    return _train(cfg, policy_dir, out_dir, sets, itertools.count(), rules, lr=lr,
                  progress=False)  # fmt: skip


def train_fixed_steps(
    cfg: Config, policy_dir: str | Path, out_dir: str | Path, sets: dict[str, list[dict]],
    steps: int, *, lr: float, progress: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """SFT from policy_dir for exactly `steps` steps over sets['sft'] (epochs as needed), the
    rate `lr` annealed over them (sft.warmup_steps first); the last weights go to out_dir.
    Each RFT round's fine-tuning (grpo.engine.rft)."""
    budget = _Budget(None, None, steps)

    def rules(_select: Callable[[], float] | None) -> _BudgetStop:
        return _BudgetStop(budget, cfg.sft.warmup_steps, None)

    return _train(cfg, policy_dir, out_dir, sets, itertools.count(), rules, lr=lr,
                  progress=progress)  # fmt: skip


def _train(
    cfg: Config, base_dir: str | Path, out_dir: str | Path, sets: dict[str, list[dict]],
    epochs: Iterable[int], make_rules: Callable[[Callable[[], float]], Any], *, lr: float,
    progress: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """The SFT loop both runs share; `make_rules(select_accuracy)` gives the stop rules, what
    differs between them (the learning rate, which weights to keep, what ends training):
    _PlateauStop for the reference, _BudgetStop for the control."""
    rank, world = init_distributed(cfg.deepspeed.timeout_s)
    device = device_for(cfg)
    torch.manual_seed(cfg.seed)
    tok = load_tokenizer(base_dir)
    model = load_model(base_dir, cfg.model.dtype).to(device)
    s = cfg.sft
    if s.batch_size % world:
        raise ValueError(f"sft.batch_size ({s.batch_size}) must be divisible by {world} ranks")
    train = _encode(tok, sets["sft"], cfg)
    val = _encode(tok, sets["sft_val"], cfg)[rank::world]
    select_rows = sets.get("select", [])
    steps_per_epoch = math.ceil(len(train) / s.batch_size)
    engine: Any = None

    def select_accuracy() -> float:
        """Greedy accuracy on the selection split, sharded over ranks."""
        engine.eval()
        with gathered(engine.module, cfg.deepspeed.zero_stage):
            recs = generate_for_rows(engine.module, tok, select_rows[rank::world], cfg, device,
                                     batch_size=cfg.eval.batch_size)  # fmt: skip
        engine.train()
        correct, total = all_reduce_sum([sum(r["correct"] for r in recs), len(recs)], device)
        return correct / max(total, 1)

    rules = make_rules(select_accuracy)
    engine, _ = build_engine(
        model, cfg, micro_batch=s.batch_size // world, grad_accum=1, lr=lr,
        weight_decay=s.weight_decay, max_grad_norm=s.max_grad_norm, lr_fn=rules.lr_fn,
    )  # fmt: skip
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    log_path = out_dir.with_name(out_dir.name + "_metrics.jsonl")
    log = log_path.open("w") if rank == 0 else None
    step, t0 = 0, time.time()
    history: list[dict[str, float]] = []
    rng = random.Random(cfg.seed)
    # no total: the plateau, not max_epochs, ends training, so a bar to the cap would mislead
    bar = progress_bar(None, "sft", "step", enabled=progress and not rank)
    loss_sum, n = torch.zeros(()), 0

    def record(rec: dict[str, float]) -> None:
        """A validation (or the start's selection): kept weights saved, the record logged."""
        if rules.keep(rec):
            save_policy(engine, tok, out_dir, rank, cfg.deepspeed.zero_stage)
        history.append(rec)
        if log:
            log.write(json.dumps(rec) + "\n")
            log.flush()

    if getattr(rules, "selection", None) is not None:  # the start is a candidate, as in GRPO
        record({"step": 0, "elapsed_s": 0.0})

    def validate() -> None:
        vl = _val_loss(engine, val, tok.pad_token_id, device, VAL_BATCH)
        record({"step": step, "train_loss": float(loss_sum.detach()) / max(n, 1),
                "val_loss": vl, "elapsed_s": time.time() - t0,
                "lr": float(engine.get_lr()[0])})  # fmt: skip
        bar.set_postfix(val_loss=f"{vl:.4f}", best=f"{rules.best:.4f}",
                        lr_cuts=rules.cuts(s.lr_cuts), refresh=False)  # fmt: skip

    for _epoch in epochs:
        order = list(range(len(train)))
        rng.shuffle(order)
        for b in range(steps_per_epoch):
            idx = order[b * s.batch_size : (b + 1) * s.batch_size][rank::world]
            batch = _collate([train[i] for i in idx], tok.pad_token_id, device)
            loss_sum, n = _token_loss(engine, batch)
            engine.backward(loss_sum / max(n, 1))
            rules.before_optimizer_step(step)
            engine.step()
            step += 1
            bar.update(1)
            spent = rules.after_step(device, world)
            if step % s.eval_every == 0 or spent:
                validate()
            if rules.stopped:
                break
        if rules.stopped:
            break
    if not history or history[-1]["step"] != step:
        validate()  # max_epochs ended it between validations: the last step counts too
    bar.close()
    if log:
        log.close()
    extra: dict[str, Any] = {}
    if getattr(rules, "selection", None) is not None:  # the last weights too, evaluated beside
        save_policy(engine, tok, last_dir(out_dir), rank,
                    cfg.deepspeed.zero_stage)  # fmt: skip
        extra["selection"] = rules.selection.summary(step)
    plateau = getattr(rules, "plateau", None)
    return {
        **extra,
        "best_val_loss": rules.best,
        "steps": step,
        "epochs": step / steps_per_epoch,
        "early_stopped": isinstance(rules, _PlateauStop) and rules.stopped,
        "lr_cuts": plateau.cuts_made if plateau else 0,
        "seconds": time.time() - t0,
        "history": history,
    }
