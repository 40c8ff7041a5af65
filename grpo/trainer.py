"""The GRPO training loop, top to bottom: sample, score, advantage, mu clipped updates.

Same code on one CPU process, N CPU ranks, or GPUs across nodes (DeepSpeed). Each rank samples
its share of prompts (whole groups stay on one rank, so advantages need no communication); the
only collective of the algorithm is the global active-token count for loss_type "dapo".
Departure from TRL: pi_old's log-probs come from the sampling pass itself (grpo.rollout), so
mu > 1 costs no extra forward; with mu = 1, pi_old = pi_theta.detach() exactly.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import random
import time
from pathlib import Path
from typing import Any

import torch

from grpo import checkpoint
from grpo.advantages import group_advantages, process_advantages, zero_std_groups
from grpo.config import Config
from grpo.data import eval_set, training_sets
from grpo.distributed import (
    BAR_INTERVAL,
    all_reduce_sum,
    build_engine,
    build_frozen,
    device_for,
    init_distributed,
    save_policy,
)
from grpo.evaluate import generate_for_rows
from grpo.logprobs import token_entropy, token_logprobs
from grpo.loss import policy_loss
from grpo.modeling import completion_logits, encode_prompts, load_model, load_tokenizer
from grpo.rollout import Rollout, generate, resolve_engine
from reward_fns import resolve, score
from reward_fns.registry import BUILTIN, with_time_limit

# per-token metrics of policy_loss (plus entropy), token-weighted over the trained rows; "kl"
# joins them when a reference is loaded (beta > 0): a fixed list, so every rank all-reduces the
# same keys even when it skipped all its rows
POLICY_METRICS = (
    "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "ratio_mean",
    "entropy",
)  # fmt: skip


def _seed(*parts: int) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:7], "little")


def prompt_indices(step: int, rank: int, local: int, world: int, n: int, seed: int) -> list[int]:
    """The training rows of one rank at one step: a fresh permutation per epoch.

    Deterministic in (seed, step): resuming at step s sees exactly the prompts it would have.
    """
    out = []
    for j in range(rank * local, (rank + 1) * local):
        epoch, k = divmod(step * local * world + j, n)
        out.append(_epoch_order(seed, epoch, n)[k])
    return out


@functools.lru_cache(maxsize=2)
def _epoch_order(seed: int, epoch: int, n: int) -> tuple[int, ...]:
    """The shuffled row order of one epoch; cached, since every step reads the same one."""
    perm = list(range(n))
    random.Random(_seed(seed, epoch)).shuffle(perm)
    return tuple(perm)


def _cat_rollouts(parts: list[Rollout], pad_id: int) -> Rollout:
    def pad(ts: list[torch.Tensor], left: bool, value: float) -> torch.Tensor:
        width = max(t.shape[1] for t in ts)
        out = []
        for t in ts:
            extra = width - t.shape[1]
            widths = (extra, 0) if left else (0, extra)
            out.append(torch.nn.functional.pad(t, widths, value=value))
        return torch.cat(out)

    return Rollout(
        pad([p.prompt_ids for p in parts], True, pad_id),
        pad([p.prompt_mask for p in parts], True, 0),
        pad([p.completion_ids for p in parts], False, pad_id),
        pad([p.completion_mask for p in parts], False, 0),
        torch.cat([p.truncated for p in parts]),
        pad([p.sampling_logps for p in parts], False, 0.0),
    )


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
        self.local_prompts = g.prompts_per_step // self.world
        local_batch = self.local_prompts * g.num_generations
        self.micro = min(g.micro_batch_size, local_batch)
        self.n_micro = math.ceil(local_batch / self.micro)
        model = load_model(policy_dir, cfg.model.dtype).to(self.device)
        self.engine, self.ds_config = build_engine(
            model, cfg, micro_batch=self.micro, grad_accum=self.n_micro, lr=g.lr,
            weight_decay=g.weight_decay, warmup=g.warmup_steps, total_steps=g.steps * g.mu,
            schedule=g.lr_schedule,
        )  # fmt: skip
        # beta = 0: the reference is never loaded (GRPO.md section 3)
        self.ref = (
            build_frozen(load_model(policy_dir, cfg.model.dtype, False).to(self.device), cfg)
            if g.beta > 0
            else None
        )
        self.reward_funcs = {}
        for name in g.reward_funcs:
            fn = resolve(
                name, max_completion_length=g.max_completion_length, overlong_cache=g.overlong_cache
            )
            key = name.rpartition(":")[2]
            self.reward_funcs[key] = (
                fn if name in BUILTIN else with_time_limit(key, fn, g.reward_timeout_s)
            )
        self.train_rows = training_sets(cfg)["train"]
        self.eval_rows: list[dict] = []
        if g.eval_every and cfg.eval.sets:
            limit = g.eval_limit - g.eval_limit % self.world
            self.eval_rows = eval_set(cfg.eval.sets[0], cfg)[:limit]
        if self.rank == 0:
            (self.out / "deepspeed_config.json").write_text(json.dumps(self.ds_config, indent=2))

    # ---- one step, in the order of GRPO.md section 1 ----
    def sample(self, step: int) -> tuple[Rollout, list[dict], list[str]]:
        g = self.cfg.grpo
        idx = prompt_indices(
            step, self.rank, self.local_prompts, self.world, len(self.train_rows), self.cfg.seed
        )
        rows = [self.train_rows[i] for i in idx]
        parts, kept_rows, texts = [], [], []
        rng = random.Random(_seed(self.cfg.seed, step, self.rank, 1))
        for rnd in range(g.max_sampling_rounds if g.dynamic_sampling else 1):
            torch.manual_seed(_seed(self.cfg.seed, step, self.rank, rnd))
            ids, mask = encode_prompts(self.tok, [r["prompt"] for r in rows], self.cfg, self.device)
            ro = generate(
                self.engine.module, ids, mask,
                num_generations=g.num_generations, max_completion_length=g.max_completion_length,
                eos_token_id=self.tok.eos_token_id, pad_token_id=self.tok.pad_token_id,
                temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                zero_stage=self.cfg.deepspeed.zero_stage, engine=self.cfg.model.generation_engine,
            )  # fmt: skip
            parts.append(ro)
            kept_rows.extend(rows)
            texts.extend(self.tok.batch_decode(ro.completion_ids, skip_special_tokens=True))
            if not g.dynamic_sampling:
                break
            rows = rng.sample(self.train_rows, self.local_prompts)
        return _cat_rollouts(parts, self.tok.pad_token_id), kept_rows, texts

    def score(
        self, ro: Rollout, rows: list[dict], texts: list[str]
    ) -> tuple[torch.Tensor, dict[str, list]]:
        G = self.cfg.grpo.num_generations
        columns: dict[str, list[Any]] = {
            k: [r.get(k) for r in rows for _ in range(G)] for k in rows[0] if k != "solution"
        }
        columns["completion_ids"] = [
            ids[: int(n)].tolist() for ids, n in zip(ro.completion_ids, ro.lengths)
        ]
        weights = self.cfg.grpo.reward_weights
        rewards, per_fn = score(self.reward_funcs, weights, texts, columns)
        return torch.tensor(rewards, dtype=torch.float32), per_fn

    def select_groups(self, rewards: torch.Tensor) -> torch.Tensor:
        """Completion indices of the local batch: with dynamic sampling, informative groups
        first, topped up with zero-std groups when the cap is reached (fixed batch size)."""
        G, P = self.cfg.grpo.num_generations, self.local_prompts
        n_groups = rewards.numel() // G
        if not self.cfg.grpo.dynamic_sampling or n_groups == P:
            return torch.arange(P * G)
        flat = zero_std_groups(rewards, G)
        order = [i for i in range(n_groups) if not flat[i]] + [
            i for i in range(n_groups) if flat[i]
        ]
        return torch.cat([torch.arange(i * G, (i + 1) * G) for i in order[:P]])

    def process_advantages(self, ro: Rollout, rows: list[dict], texts: list[str]) -> torch.Tensor:
        """Per-token advantages from step rewards; character offsets mapped to tokens."""
        from reward_fns.process import PROCESS_REWARDS

        G, C = self.cfg.grpo.num_generations, ro.completion_ids.shape[1]
        fn = PROCESS_REWARDS[self.cfg.grpo.process_reward]
        steps = fn(texts, answer=[r["answer"] for r in rows])
        all_rewards, all_ends = [], []
        for i, (rewards, char_ends) in enumerate(steps):
            n = int(ro.lengths[i])
            # cumulative decoded length after each token: the token holding character c
            pieces = self.tok.batch_decode(ro.completion_ids[i, :n, None], skip_special_tokens=True)
            cum, total = [], 0
            for piece in pieces:
                total += len(piece)
                cum.append(total)
            ends = [min(next((t for t, c in enumerate(cum) if c > e), n - 1), C - 1)
                    for e in char_ends]  # fmt: skip
            all_rewards.append(rewards)
            all_ends.append([max(e, 0) for e in ends])
        return process_advantages(all_rewards, all_ends, G, C)

    @torch.no_grad()
    def reference_logps(self, ro: Rollout) -> torch.Tensor | None:
        if self.ref is None:
            return None
        out = []
        for s in range(0, ro.completion_ids.shape[0], self.micro):
            sl = slice(s, s + self.micro)
            logits = completion_logits(
                self.ref, ro.prompt_ids[sl], ro.prompt_mask[sl],
                ro.completion_ids[sl], ro.completion_mask[sl],
            )  # fmt: skip
            out.append(token_logprobs(logits, ro.completion_ids[sl], self.cfg.grpo.temperature))
        return torch.cat(out)

    def update(
        self, ro: Rollout, adv: torch.Tensor, ref_logps: torch.Tensor | None
    ) -> dict[str, float]:
        """mu passes of clipped updates over the rollout, one optimizer step per pass.

        Entropy and clip metrics are over the completions trained on (see trained_rows).
        """
        g = self.cfg.grpo
        mask = ro.completion_mask
        # dapo: normalise by the active tokens of the whole global batch (all ranks, all micro)
        (num_items,) = all_reduce_sum([float(mask.sum())], self.device)
        # DeepSpeed averages gradients over ranks and accumulation steps; dapo's per-micro loss
        # is already a share of the global mean, so undo that averaging
        scale = self.world * self.n_micro if g.loss_type == "dapo" else 1.0
        if mask.shape[0] > self.n_micro * self.micro:
            raise ValueError(
                f"rollout: {mask.shape[0]} local rows exceed {self.n_micro} micro-batches of "
                f"{self.micro}"
            )
        rows = self.trained_rows(adv, mask.shape[0])
        metric_keys = POLICY_METRICS + (("kl",) if ref_logps is not None else ())
        sums: dict[str, float] = {}
        nonfinite = 0
        grad_norms: list[float] = []
        for _ in range(g.mu):
            # every rank makes n_micro backward calls per pass, whatever it skipped: DeepSpeed's
            # accumulation boundary and the gradient all-reduce count on it
            for j in range(self.n_micro):
                idx = rows[j * self.micro : (j + 1) * self.micro]
                if idx.numel():
                    loss, m = self._micro_loss(ro, adv, ref_logps, idx, num_items)
                else:
                    loss, m = self._zero_gradient_loss(ro, adv, ref_logps, num_items), {}
                if not torch.isfinite(loss):
                    nonfinite += 1
                    loss = self._zero_gradient_loss(ro, adv, ref_logps, num_items)
                self.engine.backward(loss * scale)
                if j == self.n_micro - 1 and self.cfg.deepspeed.zero_stage == 0:
                    grad_norms.append(self._local_grad_norm())
                self.engine.step()
                w = m.pop("_w", 0.0)
                for k in metric_keys:
                    sums[k] = sums.get(k, 0.0) + m.get(k, 0.0) * w
                sums["_w"] = sums.get("_w", 0.0) + w
                sums["loss"] = (
                    sums.get("loss", 0.0) + float(loss.detach()) * scale / self.n_micro / g.mu
                )
        keys = sorted(metric_keys)
        tot = all_reduce_sum([sums[k] for k in keys] + [sums["_w"], sums["loss"], nonfinite],
                             self.device)  # fmt: skip
        out = {k: v / max(tot[-3], 1.0) for k, v in zip(keys, tot)}
        out["loss"] = tot[-2] / self.world
        out["nonfinite_losses"] = tot[-1]
        if tot[-1] and g.on_nonfinite == "stop":
            raise FloatingPointError(
                f"non-finite loss in {int(tot[-1])} micro-batches; stopping (grpo.on_nonfinite="
                "stop); the last checkpoint is kept"
            )
        # ZeRO 1-3 report the global norm; stage 0 does not, and its grads are whole on each rank
        gn = self.engine.get_global_grad_norm()
        out["grad_norm"] = float(gn) if gn is not None else float(grad_norms[-1])
        out["learning_rate"] = float(self.engine.get_lr()[0])
        return out

    def trained_rows(self, adv: torch.Tensor, n: int) -> torch.Tensor:
        """Local rows to run forward/backward on.

        With beta = 0 and the dapo loss, a completion whose advantage is zero at every token adds
        exactly zero to the loss and its gradient (-min(rho*0, clip(rho)*0) = 0), and dapo's
        normaliser (num_items, all tokens of the global batch) does not depend on which rows run;
        skipping them is exact and saves the forward/backward of every group whose rewards were
        all equal. Other loss types divide by per-micro-batch counts, and beta > 0 adds a KL term
        on every row, so they train on all rows.
        """
        g = self.cfg.grpo
        if not (g.skip_zero_advantage and g.beta == 0 and g.loss_type == "dapo"):
            return torch.arange(n)
        per_row = adv.abs() if adv.dim() == 1 else adv.abs().sum(1)  # [N]
        # != rather than >: a NaN advantage is kept, so its loss is seen as non-finite
        return (per_row != 0).nonzero().squeeze(1).cpu()

    def _zero_gradient_loss(
        self, ro: Rollout, adv: torch.Tensor, ref_logps: torch.Tensor | None, num_items: float
    ) -> torch.Tensor:
        """A loss with an exactly zero gradient that still runs the model: one row, advantage 0,
        weight 0. Every rank then makes the same backward calls with gradient hooks firing in
        the same order (ZeRO-2 packs gradients into its reduce buckets in hook order)."""
        one_row = torch.tensor([0])
        loss, _ = self._micro_loss(ro, torch.zeros_like(adv), ref_logps, one_row, num_items)
        if torch.isfinite(loss):
            return loss * 0.0
        # the model's own output is not finite: a zero gradient without a forward pass
        return sum(p.sum() for p in self.engine.parameters()) * 0.0

    def _micro_loss(
        self,
        ro: Rollout,
        adv: torch.Tensor,
        ref_logps: torch.Tensor | None,
        idx: torch.Tensor,
        num_items: float,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss and metrics of the rows idx, with columns that are padding in all of them cut."""
        g = self.cfg.grpo
        mask = ro.completion_mask[idx]
        pmask = ro.prompt_mask[idx]
        # causal attention: trailing completion padding never affects earlier positions, and
        # positions count real tokens, so leading prompt padding can go too
        c = int(mask.sum(1).max())
        p0 = int((pmask.sum(0) > 0).long().argmax())
        mask, pmask, cids = mask[:, :c], pmask[:, p0:], ro.completion_ids[idx, :c]
        logits = completion_logits(self.engine, ro.prompt_ids[idx, p0:], pmask, cids, mask)
        logps = token_logprobs(logits, cids, g.temperature)  # [mb, c]
        old = ro.sampling_logps[idx, :c] if g.mu > 1 else logps.detach()
        a = adv[idx] if adv.dim() == 1 else adv[idx, :c]
        loss, m = policy_loss(
            logps, old, a, mask,
            ref_logps=None if ref_logps is None else ref_logps[idx, :c],
            loss_type=g.loss_type, eps_low=g.eps_low, eps_high=g.eps_high, beta=g.beta,
            importance_level=g.importance_level, max_completion_length=g.max_completion_length,
            num_items=num_items if g.loss_type == "dapo" else None,
        )  # fmt: skip
        with torch.no_grad():
            ent = token_entropy(logits.detach(), g.temperature)
            m["_w"] = float(mask.sum())
            m["entropy"] = float((ent * mask).sum()) / max(m["_w"], 1.0)
        return loss, m

    def _local_grad_norm(self) -> float:
        norms = [
            p.grad.detach().float().norm() for p in self.engine.parameters() if p.grad is not None
        ]
        return float(torch.stack(norms).norm()) if norms else 0.0

    def evaluate_heldout(self) -> float:
        if not self.eval_rows:
            return float("nan")
        shard = self.eval_rows[self.rank :: self.world]
        recs = generate_for_rows(
            self.engine.module, self.tok, shard, self.cfg, self.device,
            batch_size=self.cfg.eval.batch_size,
        )  # fmt: skip
        correct, n = all_reduce_sum([sum(r["correct"] for r in recs), len(recs)], self.device)
        return correct / max(n, 1)

    # ---- the loop ----
    def train(self, resume: bool = False, progress: bool = True) -> dict[str, Any]:
        from tqdm import tqdm

        g, G = self.cfg.grpo, self.cfg.grpo.num_generations
        ckpt_root = self.out / "checkpoints"
        start = 0
        if resume:
            client = checkpoint.load(self.engine, ckpt_root)
            if client is not None:
                start = int(client["step"])
                checkpoint.set_rng_state(client["rng"])
        metrics_path = self.out / "metrics.jsonl"
        if self.rank == 0:
            kept = []
            if start and metrics_path.exists():  # drop lines of steps after the checkpoint
                kept = [ln for ln in metrics_path.read_text().splitlines()
                        if ln and json.loads(ln)["step"] <= start]  # fmt: skip
            metrics_path.write_text("".join(ln + "\n" for ln in kept))
        log = metrics_path.open("a") if self.rank == 0 else None
        samples = (self.out / "completions.jsonl").open("a") if self.rank == 0 else None
        bar = tqdm(
            total=g.steps,
            initial=start,
            desc="grpo",
            unit="step",
            disable=not progress or self.rank,
            mininterval=BAR_INTERVAL,
        )
        if start == 0 and self.eval_rows and g.eval_every:
            acc0 = self.evaluate_heldout()
            if log:
                log.write(json.dumps({"step": 0, "eval/heldout_accuracy": acc0}) + "\n")
        t_start, last = time.time(), {}
        for step in range(start, g.steps):
            t0 = time.time()
            ro, rows, texts = self.sample(step)
            rewards, per_fn = self.score(ro, rows, texts)
            keep = self.select_groups(rewards)
            ro, rewards = ro.select(keep), rewards[keep]
            per_fn = {k: [v[i] for i in keep.tolist()] for k, v in per_fn.items()}
            texts, rows = [texts[i] for i in keep.tolist()], [rows[i // G] for i in keep.tolist()]
            if g.advantage_mode == "process":
                adv = self.process_advantages(ro, rows, texts)  # [N, C]
            else:
                adv = group_advantages(rewards, G, g.advantage_mode)  # [N]
            t1 = time.time()
            ref_logps = self.reference_logps(ro)
            t2 = time.time()
            m = self.update(ro, adv, ref_logps)
            t3 = time.time()
            m.update(self._rollout_metrics(ro, rewards, per_fn))
            n_tok = all_reduce_sum([float(ro.completion_mask.sum())], self.device)[0]
            m.update({
                "step": step + 1, "time/generation": t1 - t0, "time/reference": t2 - t1,
                "time/training": t3 - t2, "step_time": t3 - t0,
                "tokens_per_second": n_tok / max(t3 - t0, 1e-9),
                "completions_per_second": len(texts) * self.world / max(t3 - t0, 1e-9),
            })  # fmt: skip
            if g.eval_every and (step + 1) % g.eval_every == 0:
                m["eval/heldout_accuracy"] = self.evaluate_heldout()
            if log:
                log.write(json.dumps(m) + "\n")
                log.flush()
            if samples and (step % g.log_completions_every == 0):
                for i in range(0, len(texts), G):
                    samples.write(json.dumps({"step": step + 1, "prompt": rows[i]["prompt"],
                                              "completion": texts[i], "reward": float(rewards[i]),
                                              "answer": rows[i]["answer"]}) + "\n")  # fmt: skip
                samples.flush()
            if (step + 1) % g.checkpoint_every == 0 or step + 1 == g.steps:
                client = {"step": step + 1, "data_position": (step + 1) * g.prompts_per_step,
                          "rng": checkpoint.rng_state()}  # fmt: skip
                checkpoint.save(
                    self.engine, ckpt_root, step + 1, client, self.rank, g.keep_checkpoints
                )
            bar.update(1)
            bar.set_postfix(reward=f"{m['reward']:.3f}", kl=f"{m.get('kl', 0):.4f}", refresh=False)
            last = m
        bar.close()
        for f in (log, samples):
            if f:
                f.close()
        save_policy(self.engine, self.tok, self.out / "policy", self.rank,
                    self.cfg.deepspeed.zero_stage)  # fmt: skip
        engine = resolve_engine(self.engine.module, self.cfg.model.generation_engine)
        return {
            "final": last, "seconds": time.time() - t_start, "start_step": start,
            "generation_engine": engine,
        }  # fmt: skip

    def _rollout_metrics(
        self, ro: Rollout, rewards: torch.Tensor, per_fn: dict[str, list]
    ) -> dict[str, float]:
        G = self.cfg.grpo.num_generations
        lengths = ro.lengths.float()
        fn_sums = []
        for name in per_fn:
            vals = [v for v in per_fn[name] if v is not None]
            fn_sums += [sum(vals), sum(v * v for v in vals), len(vals)]
        local = [
            float(rewards.sum()), float((rewards**2).sum()), float(rewards.numel()),
            float(zero_std_groups(rewards, G).sum()), float(rewards.numel() // G),
            float(lengths.sum()), float(ro.truncated.sum()),
        ] + fn_sums  # fmt: skip
        tot = all_reduce_sum(local, self.device)
        neg_min, mx = all_reduce_sum(
            [-float(lengths.min()), float(lengths.max())], self.device, "max"
        )
        n = tot[2]
        out = {
            "reward": tot[0] / n,
            "reward_std": math.sqrt(max(tot[1] / n - (tot[0] / n) ** 2, 0.0)),
            "frac_reward_zero_std": tot[3] / tot[4],
            "completions/mean_length": tot[5] / n,
            "completions/clipped_ratio": tot[6] / n,
            "completions/min_length": -neg_min,
            "completions/max_length": mx,
        }
        for j, name in enumerate(per_fn):
            s, s2, c = tot[7 + 3 * j : 10 + 3 * j]
            out[f"rewards/{name}/mean"] = s / max(c, 1)
            out[f"rewards/{name}/std"] = math.sqrt(max(s2 / max(c, 1) - (s / max(c, 1)) ** 2, 0))
        return out


def train_grpo(
    cfg: Config, policy_dir: str | Path, out_dir: str | Path, resume: bool = False
) -> dict[str, Any]:
    return Trainer(cfg, policy_dir, out_dir).train(resume=resume)
