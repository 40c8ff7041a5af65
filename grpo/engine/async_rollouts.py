"""Rollouts off the critical path (grpo.async_rollouts): a sampler process per rank samples the
groups of step s + k while the learner updates on step s's, k = grpo.max_staleness.

The schedule is fixed, not a race: step s is sampled with the weights after exactly
max(0, s - k) updates (`weights_version`), whatever the two processes' speeds, and every round
keeps its seed per (step, rank, round). A run is therefore as reproducible as a synchronous one,
and a checkpoint holds the steps already sampled ahead (waited for before it is written), so a
resume trains on the very groups the uninterrupted run trained on.

The learner sends its trainable weights after taking step s's groups and before updating on
them; the sampler loads them when it starts the step they are for. Rollouts sampled with older
weights are off-policy: grpo.rollout_correction (on by default with async) weights each token
by pi_theta / mu, which also corrects a sampler in a lower precision (grpo.sampler_dtype). On
CPU the two processes split the rank's threads (grpo.sampler_threads); on one GPU they share
it.
"""

from __future__ import annotations

import os
import queue
import signal
import time
from pathlib import Path
from typing import Any

import torch

from grpo.config import Config
from grpo.engine.sampling import Sampled
from reward_fns.errors import UserError

POLL_S = 0.5  # how often a waiting process checks that the other is still alive


class RolloutSamplerError(UserError, RuntimeError):
    """The sampler process failed (its own error, in one line) or died."""


def weights_version(step: int, staleness: int) -> int:
    """How many updates the weights that sample `step` have had: step - staleness, and 0 for
    the first steps (there are no older weights).

    >>> [weights_version(s, 2) for s in range(5)]
    [0, 0, 0, 1, 2]
    """
    return max(0, step - staleness)


def split_threads(total: int, sampler_threads: int) -> tuple[int, int]:
    """(learner, sampler) CPU threads of a rank with `total`: the sampler takes
    sampler_threads, or half when 0; each keeps at least 1.

    >>> split_threads(2, 0), split_threads(8, 0), split_threads(8, 2), split_threads(1, 0)
    ((1, 1), (4, 4), (6, 2), (1, 1))
    """
    sampler = sampler_threads or max(1, total // 2)
    return max(1, total - sampler), sampler


def trainable_weights(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Shared-memory buffers for the weights an update changes (a LoRA policy's adapters only),
    filled with their values: the sampler maps them without another copy."""
    out = {}
    for name, p in policy.named_parameters():
        if p.requires_grad:
            t = torch.empty(p.shape, dtype=p.dtype).share_memory_()
            out[name] = t.copy_(p.detach())
    return out


def fill_weights(buffers: dict[str, torch.Tensor], policy: torch.nn.Module) -> None:
    """Copy the policy's current trainable weights into buffers made by trainable_weights."""
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if p.requires_grad:
                buffers[name].copy_(p.detach())


def numeric_gap(model: torch.nn.Module, ro: Any, g: Any) -> float:
    """Mean |log pi_v - log mu| over a rollout's tokens, pi_v the training forward at the very
    weights v that sampled: the kernels' (and dtypes') share of the learner's
    logprob_gap/mean, which adds the policy's movement over the staleness."""
    from grpo.models.forward import completion_logprobs

    trunc = (g.top_k, g.top_p) if g.truncates else None  # the sampler's own distribution
    lp, _ = completion_logprobs(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids,
                                ro.completion_mask, g.temperature, truncation=trunc)  # fmt: skip
    m = ro.completion_mask.float()
    return float(((lp - ro.sampling_logps).abs() * m).sum() / m.sum().clamp(min=1.0))


class AsyncRollouts:
    """The learner's end of one rank's sampler process.

    `get(step, policy)` returns step's groups, asking for step + k's with `policy`'s current
    weights before it returns; `ahead()` is what a checkpoint saves; `close()` ends the sampler
    (the learner always calls it, on an error or Ctrl-C too).
    """

    def __init__(
        self, cfg: Config, policy_dir: str | Path, policy: torch.nn.Module, *, rank: int,
        world: int, threads: int, start: int, ahead: dict[int, Any] | None = None,
    ) -> None:  # fmt: skip
        self.k, self.steps, self.rank = cfg.grpo.max_staleness, cfg.grpo.steps, rank
        self.engine = ("llama.cpp engine" if cfg.grpo.rollout_engine == "llama_cpp"
                       else "the policy's engine")  # fmt: skip
        # at most k steps are in flight (one with k = 0), step s in slot s % len(slots): each
        # slot's shared memory is made and sent to the sampler once, then refilled, so memory
        # and file descriptors stay flat however long the run
        self.slots = [trainable_weights(policy) for _ in range(max(self.k, 1))]
        ctx = torch.multiprocessing.get_context("spawn")  # no forked copy of torch's threads
        self.commands, self.results = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(
            target=sampler_main, name=f"grpo-sampler-rank{rank}", daemon=True,
            args=(cfg, str(policy_dir), rank, world, threads, os.getpid(), self.commands,
                  self.results),
        )  # fmt: skip
        self.proc.start()
        self.commands.put(("slots", self.slots))
        self.ready: dict[int, Any] = dict(ahead or {})
        self.sent: set[int] = set()  # their slots are in use until their step comes back
        for s in range(start, min(start + self.k, self.steps)):
            if s not in self.ready:  # a fresh run, or a checkpoint written without async
                self._request(s, start, policy)

    def _request(self, step: int, version: int, policy: torch.nn.Module) -> None:
        slot = step % len(self.slots)
        fill_weights(self.slots[slot], policy)
        self.sent.add(step)
        self.commands.put((step, version, slot))

    def get(self, step: int, policy: torch.nn.Module) -> tuple[Sampled, dict[str, Any], int]:
        """Step's groups, the reward functions' logged metrics and the weights' staleness
        (updates since they sampled); then step + k is asked for with policy's weights
        (k = 0: step itself is asked for first, with the weights of every update so far)."""
        if self.k == 0 and step not in self.ready and step not in self.sent:
            self._request(step, step, policy)
        while step not in self.ready:
            self._receive(step)
        sampled, metrics, version, seconds = self.ready.pop(step)
        if self.k and step + self.k < self.steps:  # the policy holds weights_version(step + k)
            self._request(step + self.k, weights_version(step + self.k, self.k), policy)
        metrics = {**metrics, "time/sampler": seconds}
        return sampled, metrics, step - version

    def ahead(self) -> dict[int, Any]:
        """Every step asked for and not yet trained on, once sampled: a checkpoint's share of
        the run (waits for the sampler to finish them)."""
        while self.sent:
            self._receive(min(self.sent))
        return dict(self.ready)

    def _receive(self, step: int) -> None:
        try:
            item = self.results.get(timeout=POLL_S)
        except queue.Empty:
            if not self.proc.is_alive():
                raise RolloutSamplerError(
                    f"the rollout sampler of rank {self.rank} ({self.engine}, pid "
                    f"{self.proc.pid}) died with "
                    f"exit code {self.proc.exitcode} while sampling step {step + 1}; the last "
                    "checkpoint is kept (--resume goes on from it)"
                ) from None
            return
        if item[0] == "error":
            raise RolloutSamplerError(item[1])
        _, s, sampled, metrics, version, seconds = item
        self.sent.discard(s)
        self.ready[s] = (sampled, metrics, version, seconds)

    def close(self) -> None:
        """End the sampler: asked to, then terminated if it is still sampling."""
        if self.proc.is_alive():
            self.commands.put(None)
            self.proc.join(timeout=5 * POLL_S)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout=10)
        self.sent.clear()


def sampler_main(
    cfg: Config, policy_dir: str, rank: int, world: int, threads: int, parent: int,
    commands: Any, results: Any,
) -> None:  # fmt: skip
    """The sampler process: its own copy of the policy, loaded with each step's weights."""
    # Ctrl-C reaches the whole process group; the learner ends this process itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    step = -1
    slots: list[dict[str, torch.Tensor]] = []
    try:
        # no DeepSpeed here: the sampler's gathering of weights is ZeRO-3's, refused with async
        sample, close = _sampler(cfg, policy_dir, rank, world, threads)
        try:
            while True:
                try:
                    cmd = commands.get(timeout=POLL_S)
                except queue.Empty:
                    if os.getppid() != parent:  # the learner was killed: nothing will ask again
                        return
                    continue
                if cmd is None:
                    return
                if cmd[0] == "slots":  # the shared buffers, mapped once
                    slots = cmd[1]
                    continue
                step, version, slot = cmd
                t0 = time.time()
                sampled, metrics = sample(step, slots[slot])
                results.put(("done", step, sampled, metrics, version, time.time() - t0))
        finally:
            close()
    except Exception as e:  # noqa: BLE001 - any failure goes to the learner as one line
        results.put(("error", f"rollout sampler of rank {rank}, step {step + 1}: "
                              f"{type(e).__name__}: {e}"))  # fmt: skip
        raise SystemExit(1) from None


def _sampler(cfg: Config, policy_dir: str, rank: int, world: int, threads: int) -> Any:
    """(sample, close): sample(step, weights) -> (Sampled, reward metrics), with this
    process's own model (and with rollout_engine llama_cpp, its engine, synced to it); close()
    ends the engine."""
    from grpo.data.sets import training_sets
    from grpo.engine.sampling import sample_step
    from grpo.engine.scoring import RewardScorer
    from grpo.models import lora
    from grpo.models.loading import device_for, eos_token_ids, load_model, load_tokenizer

    device = device_for(cfg)
    tok = load_tokenizer(policy_dir)
    own = cfg.grpo.sampler_dtype != "model"
    dtype = cfg.grpo.sampler_dtype if own else cfg.model.dtype
    model = load_model(policy_dir, dtype).to(device)  # each step's weights are cast to it
    if cfg.model.lora.enabled:  # the adapters' values come with every step's weights
        model = lora.wrap(model, cfg.model.lora)
    model.eval()
    eos_ids = eos_token_ids(tok, model)
    rows = training_sets(cfg)["train"]
    scorer = RewardScorer(cfg)
    llama = None
    if cfg.grpo.rollout_engine == "llama_cpp":
        from grpo.models.llamacpp_engine import LlamaCppEngine

        # in this process: it is the rollouts' own process already
        llama = LlamaCppEngine(model, tok, dtype=cfg.grpo.llama_cpp_dtype, threads=threads,
                               own_process=False)  # fmt: skip

    def sample(step: int, weights: dict[str, torch.Tensor]) -> tuple[Sampled, dict[str, Any]]:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        if unexpected or trainable & set(missing):
            raise RuntimeError(f"the learner's weights do not fit the sampler's model: "
                               f"unexpected {unexpected[:3]}, missing "
                               f"{sorted(trainable & set(missing))[:3]}")  # fmt: skip
        engine = {}
        if llama is not None:
            llama.sync(model)
            engine = llama.sync_metrics()
        with torch.no_grad():
            sampled = sample_step(
                model, tok, cfg, rows, scorer, step=step, rank=rank, world=world,
                device=device, eos_ids=eos_ids, alone=True, rollout_engine=llama,
            )  # fmt: skip
            gap = numeric_gap(model, sampled.rollout, cfg.grpo)
        return sampled, {**scorer.take_metrics(), "async/numeric_gap/mean": gap, **engine}

    return sample, (llama.close if llama is not None else lambda: None)
