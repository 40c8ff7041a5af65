"""Steps 2 and 3, score and advantages: reward functions over the completions, then one
advantage per completion token, [N, C], whichever the supervision (docs/ALGORITHM.md).

Outcome supervision broadcasts each completion's group-relative advantage over its tokens;
process supervision scores each reasoning step and credits the tokens up to where it ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import TrainerState

from grpo.algo.advantages import (
    PROCESS,
    group_advantages,
    process_advantages,
    process_flat_groups,
    zero_std_groups,
)
from grpo.config import Config, GRPOConfig
from grpo.models.generate import Rollout
from grpo.models.offsets import char_to_token, token_char_ends
from grpo.models.prompts import prompt_messages
from reward_fns import (
    PROCESS_REWARDS,
    REWARD_FUNCS,
    RewardFunctionError,
    resolve,
    score,
    with_time_limit,
)

# the worked solution is SFT's data, never shown to GRPO's reward functions
HIDDEN_COLUMNS = ("worked_solution",)


@dataclass
class Scores:
    """A scored batch: weighted rewards [N], each function's raw scores, log_extra columns."""

    rewards: torch.Tensor
    per_fn: dict[str, list]
    extra: dict[str, list] = field(default_factory=dict)

    def select(self, idx: list[int]) -> Scores:
        pick = lambda d: {k: [v[i] for i in idx] for k, v in d.items()}  # noqa: E731
        return Scores(self.rewards[idx], pick(self.per_fn), pick(self.extra))

    @staticmethod
    def cat(parts: list[Scores]) -> Scores:
        # a column logged in every round is kept; one logged in only some rounds cannot align
        keys = [k for k in parts[0].extra if all(k in p.extra for p in parts)]
        return Scores(
            torch.cat([p.rewards for p in parts]),
            {k: [v for p in parts for v in p.per_fn[k]] for k in parts[0].per_fn},
            {k: [v for p in parts for v in p.extra[k]] for k in keys},
        )


class RewardScorer:
    """The configured reward functions, weighted, called with TRL's keyword arguments
    (reward_fns/__init__.py); user functions are bounded in time."""

    def __init__(self, cfg: Config) -> None:
        g = cfg.grpo
        self.cfg, self.weights = cfg, g.reward_weights
        self.funcs = {}
        for name in g.reward_funcs:
            fn = resolve(
                name, max_completion_length=g.max_completion_length, overlong_cache=g.overlong_cache
            )
            key = name.rpartition(":")[2]
            # built-in functions bound their own time (math-verify limits)
            self.funcs[key] = (
                fn if name in REWARD_FUNCS else with_time_limit(key, fn, g.reward_timeout_s)
            )
        self.metrics: dict[str, list[float]] = {}  # log_metric calls since the last take_metrics

    def __call__(
        self, ro: Rollout, group_rows: list[dict], texts: list[str], step: int,
        episodes: Any = None,
    ) -> Scores:  # fmt: skip
        """Score the completions `texts` of the prompts `group_rows` (one row per group).
        episodes (grpo.models.episodes.EpisodeBatch): multi-turn episodes, whose completions
        are their whole conversations after the prompt (message lists with the chat template,
        else the text), with `environments` (one instance per episode, or None each) and
        `tool_calls` (each episode's calls: name, arguments, result or error) beside them."""
        G, conversational = ro.group_size, self.cfg.model.chat_template
        columns: dict[str, list[Any]] = {
            k: [r.get(k) for r in group_rows for _ in range(G)]
            for k in group_rows[0]
            if k not in HIDDEN_COLUMNS
        }
        problems = columns["prompt"]
        columns["prompts"] = (
            [prompt_messages(p, self.cfg) for p in problems] if conversational else problems
        )
        columns["completion_ids"] = [
            ids[: int(n)].tolist() for ids, n in zip(ro.completion_ids, ro.lengths)
        ]
        completions: list[Any] = (
            [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
        )
        if episodes is not None:
            completions = episodes.completions
            columns["environments"] = [e.env for e in episodes.episodes]
            columns["tool_calls"] = [list(e.calls) for e in episodes.episodes]
        extra: dict[str, list] = {}

        def log_extra(column: str, values: list) -> None:
            extra.setdefault(column, []).extend(values)

        def log_metric(name: str, value: float) -> None:
            self.metrics.setdefault(name, []).append(float(value))

        state = TrainerState(global_step=step, max_steps=self.cfg.grpo.steps)
        shared = {"trainer_state": state, "log_extra": log_extra, "log_metric": log_metric}
        rewards, per_fn = score(self.funcs, self.weights, completions, columns, shared)
        for k, v in extra.items():
            if len(v) != len(texts):
                raise RewardFunctionError(
                    f"log_extra({k!r}): {len(v)} values for {len(texts)} completions"
                )
        totals = torch.tensor(rewards, dtype=torch.float32)
        if not torch.isfinite(totals).all():
            # each score was finite (reward_fns.scoring checks), but not in float32: a reward
            # of 1e308 became inf here, its group's std NaN, and no step updated anything
            i = int((~torch.isfinite(totals)).nonzero()[0])
            raise RewardFunctionError(
                f"completion {i}: weighted reward {rewards[i]:g} is beyond float32's range "
                f"(3.4e38); scores by function: "
                + ", ".join(f"{k}={v[i]!r}" for k, v in per_fn.items())
            )
        return Scores(totals, per_fn, extra)

    def take_metrics(self) -> dict[str, float]:
        """The mean of each log_metric name since the last call (then forgotten)."""
        out = {k: sum(v) / len(v) for k, v in self.metrics.items()}
        self.metrics = {}
        return out


def token_advantages(
    g: GRPOConfig, ro: Rollout, rewards: torch.Tensor, rows: list[dict], texts: list[str], tok: Any
) -> torch.Tensor:
    """Advantages [N, C]: outcome ones broadcast over tokens, or process-supervised ones."""
    n, c = ro.completion_ids.shape
    if g.advantage_mode != PROCESS:
        adv = group_advantages(rewards, ro.group_size, g.advantage_mode)  # [N]
        return adv.unsqueeze(1).expand(n, c)
    steps = _process_steps(g, texts, rows)
    step_rewards = [r for r, _ in steps]
    step_ends = [
        step_token_ends(tok, ro.completion_ids[i], int(ro.lengths[i]), char_ends)
        for i, (_, char_ends) in enumerate(steps)
    ]
    adv = process_advantages(step_rewards, step_ends, ro.group_size, c,
                             reduce=g.process_advantage)  # fmt: skip
    if g.process_outcome_weight:
        outcome = group_advantages(rewards, ro.group_size, "zscore")  # [N]
        adv = adv + g.process_outcome_weight * outcome.unsqueeze(1) * ro.completion_mask
    return adv


def flat_groups(
    g: GRPOConfig, rewards: torch.Tensor, texts: list[str], group_rows: list[dict], group_size: int
) -> torch.Tensor:
    """Boolean [P]: True where a group has no learning signal, by the advantages the step will
    use (dynamic sampling keeps the others first). Outcome mode: its rewards are all equal.
    Process mode: its step rewards are all equal, and, when the outcome advantage is added
    (process_outcome_weight > 0), its outcome rewards too. group_rows: one row per group."""
    outcome = zero_std_groups(rewards, group_size)
    if g.advantage_mode != PROCESS:
        return outcome
    rows = [r for r in group_rows for _ in range(group_size)]
    process = process_flat_groups([r for r, _ in _process_steps(g, texts, rows)], group_size)
    return process & outcome if g.process_outcome_weight else process


def _process_steps(g: GRPOConfig, texts: list[str], rows: list[dict]) -> list:
    """The process reward's (step rewards, step end characters) per completion; rows: one per
    completion."""
    return PROCESS_REWARDS[g.process_reward](
        completions=texts, prompt=[r["prompt"] for r in rows], answer=[r["answer"] for r in rows]
    )


def step_token_ends(tok: Any, ids: torch.Tensor, length: int, char_ends: list[int]) -> list[int]:
    """The token index at which each step's last character is complete; the last step runs to
    the completion's last token.

    The text after the last reasoning step (the answer, and EOS) belongs to that step, as the
    final step of DeepSeekMath's process supervision ends with the answer: otherwise the answer
    and stopping would get advantage 0 with process_outcome_weight 0, and stopping would never
    be reinforced. ids: [C] one completion; length: its real tokens (EOS included).
    """
    ends = token_char_ends(tok, ids[:length].tolist())
    out = [max(char_to_token(ends, e), 0) for e in char_ends]
    if out:
        out[-1] = max(length - 1, 0)
    return out
