"""The GRPO training loop, top to bottom: sample -> score -> advantages -> update -> log.

Same code on one CPU process, N CPU ranks, or GPUs across nodes (DeepSpeed). Each rank samples
its share of prompts (whole groups stay on one rank, so advantages need no communication); the
only collective of the algorithm is the global active-token count of aggregations with a global
normaliser (dapo). pi_old: with mu = 1 it is pi_theta.detach() exactly; with mu > 1 it is the
first pass's own training forward (old_logprobs recompute, the default: that forward runs
anyway) or the sampler's log-probs (sampler). docs/ALGORITHM.md has the formulas and what every
logged metric means.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from grpo.config import Config, prompts_split_error
from grpo.data.sets import eval_set, training_sets
from grpo.engine.async_rollouts import AsyncRollouts, split_threads
from grpo.engine.deepspeed_setup import build_engine, gathered, save_policy
from grpo.engine.distributed import all_reduce_dict, all_reduce_sum, init_distributed
from grpo.engine.reference import Reference
from grpo.engine.rollout_metrics import rollout_metrics
from grpo.engine.run_files import RunFiles
from grpo.engine.sampling import keep_groups, sample_step
from grpo.engine.schedules import lr_lambda
from grpo.engine.scoring import RewardScorer, token_advantages
from grpo.engine.update import UpdatePlan, update_policy
from grpo.eval.run import generate_for_rows
from grpo.eval.selection import INRUN_KEY, SELECT_KEY, SELECTION_FILE, Selection, last_dir
from grpo.models import lora
from grpo.models.generate import Rollout, resolve_engine
from grpo.models.loading import device_for, eos_token_ids, load_model, load_tokenizer
from grpo.progress import progress_bar


def best_dir(out: Path, step: int) -> Path:
    """Where the weights of a selected step are kept: the name records the step they hold."""
    return out / f"best-{step:06d}"


def prune_best(out: Path, keep: set[int]) -> None:
    """Remove the kept best weights of every step but `keep`'s."""
    for d in out.glob("best-*"):
        if d.is_dir() and int(d.name.removeprefix("best-")) not in keep:
            shutil.rmtree(d)


def replace_dir(src: Path, dst: Path) -> None:
    """dst becomes a copy of src; a reader never finds dst half written."""
    tmp = dst.with_name(dst.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(src, tmp)
    if dst.exists():
        shutil.rmtree(dst)
    tmp.rename(dst)


class Trainer:
    """Holds what lives across steps; `train()` is the loop."""

    def __init__(self, cfg: Config, policy_dir: str | Path, out_dir: str | Path) -> None:
        self.cfg, g = cfg, cfg.grpo
        self.rank, self.world = init_distributed(cfg.deepspeed.timeout_s)
        self.device = device_for(cfg)
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(cfg.seed)
        self.tok = load_tokenizer(policy_dir)
        self.policy_dir = policy_dir
        self.rollouts: AsyncRollouts | None = None
        self.sampler_threads = 0
        if g.async_rollouts and g.max_staleness == 0:
            # one process runs at a time: each keeps every thread, as the synchronous loop does
            self.sampler_threads = g.sampler_threads or torch.get_num_threads()
        elif g.async_rollouts:  # the sampler process takes its share of the rank's threads
            learner, self.sampler_threads = split_threads(torch.get_num_threads(),
                                                          g.sampler_threads)  # fmt: skip
            torch.set_num_threads(learner)
        # a hostfile or launcher can start other ranks than deepspeed.nproc said
        if error := prompts_split_error(g.prompts_per_step, self.world, "the world size"):
            raise ValueError(error)
        self.local_prompts = g.prompts_per_step // self.world
        local_batch = self.local_prompts * g.num_generations
        micro = min(g.micro_batch_size, local_batch)
        n_micro = math.ceil(local_batch / micro)
        model = load_model(policy_dir, cfg.model.dtype).to(self.device)
        if cfg.model.lora.enabled:  # after the seed: every rank draws the same adapters
            model = lora.wrap(model, cfg.model.lora)
        self.params = lora.parameter_counts(model)
        self.eos_ids = eos_token_ids(self.tok, model)
        self.engine, ds_config = build_engine(
            model, cfg, micro_batch=micro, grad_accum=n_micro, lr=g.lr,
            weight_decay=g.weight_decay, max_grad_norm=g.max_grad_norm,
            lr_fn=lr_lambda(g.warmup_steps, g.steps * g.mu, g.lr_schedule),
        )  # fmt: skip
        buckets, budget = cfg.forward_layout()
        self.plan = UpdatePlan(micro=micro, n_micro=n_micro, world=self.world,
                               zero_stage=cfg.deepspeed.zero_stage, device=self.device,
                               bucket_tokens=buckets, logits_budget_mib=budget)  # fmt: skip
        if self.rank == 0 and (buckets, budget) != (g.bucket_tokens, g.logits_budget_mib):
            print(
                "ZeRO-3: grpo.bucket_tokens and grpo.logits_budget_mib are off (every rank "
                "must make the same module calls); one padded forward per micro-batch"
            )
        # beta = 0: no KL term, and the reference is never loaded
        self.reference = None
        if g.uses_reference and cfg.model.lora.enabled:
            self.reference = Reference.of_lora_policy(self.engine.module, cfg)
        elif g.uses_reference:
            self.reference = Reference.load(cfg, policy_dir, self.device)
        self.scorer = RewardScorer(cfg)
        self.toolbox = None
        if cfg.tools.active:  # multi-turn episodes
            from grpo.models.episodes import Toolbox

            self.toolbox = Toolbox(cfg)
        sets = training_sets(cfg)
        self.train_rows = sets["train"]
        self.eval_rows: list[dict] = []
        # with a selection split, the in-run curve is on it and the best step is kept; without
        # one, it is a subset of the first held-out set, a curve only (the last step is kept)
        self.eval_key = SELECT_KEY if sets["select"] else INRUN_KEY
        self.selection: Selection | None = None
        if g.eval_every and sets["select"]:
            rows = sets["select"]
            self.eval_rows = rows[: len(rows) - len(rows) % self.world]
        elif g.eval_every and cfg.eval.sets:
            limit = g.eval_limit - g.eval_limit % self.world
            self.eval_rows = eval_set(cfg.eval.sets[0], cfg)[:limit]
        self.files = RunFiles(self.out, self.rank, g.keep_checkpoints)
        if self.rank == 0:
            (self.out / "deepspeed_config.json").write_text(json.dumps(ds_config, indent=2))
        # llama.cpp samples in a process of its own (with async rollouts: the sampler's)
        self.llama = None
        if g.rollout_engine == "llama_cpp" and not g.async_rollouts:
            from grpo.models.llamacpp_engine import LlamaCppEngine

            with gathered(self.engine.module, cfg.deepspeed.zero_stage):
                self.llama = LlamaCppEngine(self.engine.module, self.tok, dtype=g.llama_cpp_dtype,
                                            threads=torch.get_num_threads())  # fmt: skip

    def train(
        self, resume: bool = False, progress: bool = True,
        on_step: Callable[[int, int, bool], None] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """Steps from the last checkpoint (resume) to grpo.steps. on_step(done_steps, steps,
        finished) is called on rank 0 after every step and once at the end (the launcher uses it
        to pace a control run beside this one)."""
        g = self.cfg.grpo
        report = on_step if on_step is not None and self.rank == 0 else lambda *_: None
        start = self.files.open(self.engine, resume)
        self.checkpointed = start
        if self.eval_key == SELECT_KEY:
            self.selection = Selection.resumed(self.out / SELECTION_FILE, start)
            if self.rank == 0:
                self._reconcile_best(start)
        bar = progress_bar(g.steps, "grpo", "step", enabled=progress and not self.rank,
                           initial=start)  # fmt: skip
        if start == 0 and self.eval_rows:
            acc = self.heldout_accuracy()
            self.files.log_metrics({"step": 0, self.eval_key: acc})
            self._select(0, acc)
        t_start = time.time()
        if g.async_rollouts:
            self.rollouts = AsyncRollouts(
                self.cfg, self.policy_dir, self.engine.module, rank=self.rank, world=self.world,
                threads=self.sampler_threads, start=start,
                ahead=self.files.rank_state() if start else None,
            )  # fmt: skip
        try:
            last = self._steps(start, bar, report)
        finally:
            if self.rollouts is not None:
                self.rollouts.close()
            if self.llama is not None:
                self.llama.close()
        bar.close()
        self.files.close()
        report(g.steps, g.steps, True)  # a control running beside this run stops here
        summary = {
            "final": last, "seconds": time.time() - t_start, "start_step": start,
            "generation_engine": "llama_cpp" if g.rollout_engine == "llama_cpp" else
            resolve_engine(self.engine.module, self.cfg.model.generation_engine),
            "parameters": self.params, "inrun_subset_size": len(self.eval_rows),
        }  # fmt: skip
        if self.selection is None:
            save_policy(self.engine, self.tok, self.out / "policy", self.rank,
                        self.cfg.deepspeed.zero_stage)  # fmt: skip
            return summary
        # policy/ is the selected step's weights (what is evaluated, registered and served);
        # policy_last/ the last step's, evaluated beside it
        save_policy(self.engine, self.tok, last_dir(self.out / "policy"), self.rank,
                    self.cfg.deepspeed.zero_stage)  # fmt: skip
        if self.rank == 0:
            replace_dir(best_dir(self.out, self.selection.best()[0]), self.out / "policy")
            summary["selection"] = self.selection.summary(g.steps)
            (self.out / "selection_summary.json").write_text(
                json.dumps(summary["selection"], indent=1)
            )
        return summary

    def _steps(self, start: int, bar: Any, report: Callable[..., None]) -> dict[str, float]:
        """Steps start..grpo.steps with their evaluations and checkpoints; the last metrics."""
        g, last = self.cfg.grpo, {}
        for step in range(start, g.steps):
            m = self.step(step)
            # the selection also sees the last step, whatever eval_every
            due = (step + 1) % g.eval_every == 0 if g.eval_every else False
            if due or (self.selection is not None and step + 1 == g.steps):
                m[self.eval_key] = self.heldout_accuracy()
                self._select(step + 1, m[self.eval_key])
            # a checkpoint with an in-run accuracy becomes a model of the run (not the last:
            # that is policy/, logged as the run's model)
            evaluated = bool(self.eval_rows) and self.eval_key in m
            self.files.log_metrics(m)
            if (step + 1) % g.checkpoint_every == 0 or step + 1 == g.steps:
                ahead = self.rollouts.ahead() if self.rollouts is not None else None
                self.files.save_checkpoint(self.engine, step + 1, ahead)
                self.checkpointed = step + 1
                self._prune_best()
                if evaluated and g.checkpoint_models and step + 1 < g.steps:
                    self.files.save_snapshot(self.engine, self.tok, step + 1,
                                             self.cfg.deepspeed.zero_stage)  # fmt: skip
            report(step + 1, g.steps, False)
            bar.update(1)
            bar.set_postfix(reward=f"{m['reward']:.3f}", kl=f"{m.get('kl', 0):.4f}", refresh=False)
            last = m
        return last

    def _select(self, step: int, accuracy: float) -> None:
        """Record a selection-split accuracy; a new best's weights go to best-<step>/."""
        if self.selection is None:
            return
        new_best = self.selection.record(step, accuracy)
        if new_best:
            save_policy(self.engine, self.tok, best_dir(self.out, step), self.rank,
                        self.cfg.deepspeed.zero_stage)  # fmt: skip
        if self.rank == 0:  # after the weights: a resume never trusts a best not yet written
            self.selection.save(self.out / SELECTION_FILE)
            self._prune_best()

    def _prune_best(self) -> None:
        """Keep the weights of the current best and of the best a resume from the last
        checkpoint would select (its curve is trimmed to that step, so a best selected after
        it may be redone differently); remove the others."""
        if self.selection is None or self.rank != 0 or not self.selection.curve:
            return
        resumable = Selection([p for p in self.selection.curve if p[0] <= self.checkpointed])
        keep = {self.selection.best()[0]}
        if resumable.curve:
            keep.add(resumable.best()[0])
        prune_best(self.out, keep)

    def _reconcile_best(self, start: int) -> None:
        """On resume: the kept weights are those of the step the trimmed curve selects; any
        best selected after the checkpoint is removed (its step is redone)."""
        assert self.selection is not None
        if not self.selection.curve:
            prune_best(self.out, set())
            return
        step = self.selection.best()[0]
        if not best_dir(self.out, step).is_dir():
            raise RuntimeError(
                f"{self.out}: resuming at step {start}, the selection curve selects step {step} "
                f"but {best_dir(self.out, step).name}/ is missing; start the run again without "
                "--resume"
            )
        prune_best(self.out, {step})

    def step(self, step: int) -> dict[str, float]:
        """One GRPO step on this rank; returns its metrics (reduced over ranks)."""
        g = self.cfg.grpo
        t0 = time.time()
        # 1-2. sample G completions for each of this rank's prompts, scoring each round (with
        # async rollouts, sampled ahead by the sampler process: here only waited for)
        sync: dict[str, float] = {}
        if self.rollouts is not None:
            sampled, reward_metrics, staleness = self.rollouts.get(step, self.engine.module)
        else:
            if self.llama is not None:  # the engine samples with this step's weights
                with gathered(self.engine.module, self.cfg.deepspeed.zero_stage):
                    self.llama.sync(self.engine.module)
                sync = self.llama.sync_metrics()
            sampled = sample_step(
                self.engine.module, self.tok, self.cfg, self.train_rows, self.scorer, step=step,
                rank=self.rank, world=self.world, device=self.device, eos_ids=self.eos_ids,
                toolbox=self.toolbox, rollout_engine=self.llama,
            )  # fmt: skip
        t1 = time.time()
        # dynamic sampling keeps informative groups first
        ro, scores, texts, completion_rows = keep_groups(sampled, self.local_prompts, g)
        # 3. advantages, one per completion token [N, C]
        adv = token_advantages(g, ro, scores.rewards, completion_rows, texts, self.tok)
        t2 = time.time()
        ref_logps = self.reference.logps(ro, self.plan.micro) if self.reference else None
        t3 = time.time()
        # 4. update: mu clipped policy-gradient passes
        m = self.update(ro, adv, ref_logps)
        t4 = time.time()
        # 5. log
        m.update(rollout_metrics(ro, scores.rewards, scores.per_fn, self.device))
        if g.dynamic_sampling:  # the same, before filtering: what the policy really sampled
            before = rollout_metrics(sampled.rollout, sampled.scores.rewards, {}, self.device)
            m.update({f"sampled/{k}": v for k, v in before.items()})
            m["sampling/rounds"] = all_reduce_sum([sampled.rounds], self.device)[0] / self.world
        if self.rollouts is not None:
            m.update(reward_metrics)
            m["async/staleness"] = float(staleness)
        else:
            m.update(self.scorer.take_metrics())
        if sampled.tool_metrics is not None:
            from grpo.models.episodes import reduce_episode_metrics

            m.update(reduce_episode_metrics(all_reduce_dict(sampled.tool_metrics, self.device)))
        n_tok = all_reduce_sum([float(ro.completion_mask.sum())], self.device)[0]
        n_sampled = all_reduce_sum([len(sampled.texts)], self.device)[0]
        m.update(sync)
        m.update({
            "step": step + 1, "time/sampling": t1 - t0 - sync.get("time/weight_sync", 0.0),
            "time/advantages": t2 - t1,
            "time/reference": t3 - t2, "time/training": t4 - t3, "step_time": t4 - t0,
            "tokens_per_second": n_tok / max(t4 - t0, 1e-9),
            "completions_per_second": n_sampled / max(t4 - t0, 1e-9),
        })  # fmt: skip
        if step % g.log_completions_every == 0:
            self.files.log_completions(step + 1, completion_rows, texts, scores, ro.group_size)
        return m

    def update(
        self, ro: Rollout, adv: torch.Tensor, ref_logps: torch.Tensor | None
    ) -> dict[str, float]:
        return update_policy(self.engine, self.cfg.grpo, self.plan, ro, adv, ref_logps)

    def heldout_accuracy(self) -> float:
        """Greedy accuracy on the in-run held-out problems, sharded over ranks."""
        if not self.eval_rows:
            return float("nan")
        shard = self.eval_rows[self.rank :: self.world]
        with gathered(self.engine.module, self.cfg.deepspeed.zero_stage):
            recs = generate_for_rows(
                self.engine.module, self.tok, shard, self.cfg, self.device,
                batch_size=self.cfg.eval.batch_size,
            )  # fmt: skip
        correct, n = all_reduce_sum([sum(r["correct"] for r in recs), len(recs)], self.device)
        return correct / max(n, 1)


def train_grpo(
    cfg: Config, policy_dir: str | Path, out_dir: str | Path, resume: bool = False,
    on_step: Callable[[int, int, bool], None] | None = None,
) -> dict[str, Any]:  # fmt: skip
    return Trainer(cfg, policy_dir, out_dir).train(resume=resume, on_step=on_step)
