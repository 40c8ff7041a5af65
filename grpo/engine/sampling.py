"""Steps 1 and 2, sample and score: this rank's prompts of the step, G completions each, with
the sampler's log-probs, scored round by round.

With dynamic sampling (DAPO) rounds of fresh prompts follow until the batch is full of
informative groups (or the round cap), and `select_groups` keeps the informative groups first
(the batch size stays fixed). Whole groups stay on one rank, so advantages need no
communication.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from grpo.config import Config, GRPOConfig
from grpo.data.order import derived_seed, prompt_indices
from grpo.engine.deepspeed_setup import gathered
from grpo.engine.distributed import all_reduce_sum
from grpo.engine.scoring import Scores, flat_groups
from grpo.models.generate import Rollout, generate
from grpo.models.prompts import encode_prompts

SAMPLING_ROUND = 1  # salt of the per-step RNG that draws extra prompts for dynamic sampling


@dataclass
class Sampled:
    """Everything sampled at one step on this rank, scored, before any filtering."""

    rollout: Rollout
    group_rows: list[dict]  # the prompt row of each group
    texts: list[str]
    scores: Scores
    rounds: int  # generation rounds (1 without dynamic sampling)
    tool_metrics: dict[str, float] | None = None  # multi-turn: this rank's sums (tools/*)


def sample_step(
    policy: torch.nn.Module,
    tok: Any,
    cfg: Config,
    train_rows: list[dict],
    scorer: Callable[[Rollout, list[dict], list[str], int], Scores],
    *,
    step: int,
    rank: int,
    world: int,
    device: torch.device,
    eos_ids: list[int],
    alone: bool = False,
    toolbox: Any = None,
    rollout_engine: Any = None,
) -> Sampled:
    """This rank's prompts of `step`, G completions each, scored as they come.

    With dynamic sampling, rounds of fresh prompts follow until this rank holds as many
    informative groups (rewards not all equal) as it has prompts, or grpo.max_sampling_rounds
    is reached. With several ranks the decision is collective (a round runs while any rank
    still needs groups), because ZeRO-3 gathers parameters collectively in every round;
    `alone` (a sampler process, outside the ranks' process group) decides for this rank only.
    With a toolbox (grpo.models.episodes.Toolbox) each completion is a multi-turn episode.
    With a rollout_engine (grpo.models.llamacpp_engine.LlamaCppEngine, its weights synced by
    the caller) the engine samples instead of the policy.
    """
    g = cfg.grpo
    local = g.prompts_per_step // world
    idx = prompt_indices(step, rank, local, world, len(train_rows), cfg.seed)
    rows = [train_rows[i] for i in idx]
    parts, kept_rows, texts, scores = [], [], [], []
    tool_metrics: dict[str, float] | None = None
    informative = 0
    rng = random.Random(derived_seed(cfg.seed, step, rank, SAMPLING_ROUND))
    rounds = g.max_sampling_rounds if g.dynamic_sampling else 1
    for rnd in range(rounds):
        # a seed per (step, rank, round): a resumed run samples exactly what it would have
        torch.manual_seed(derived_seed(cfg.seed, step, rank, rnd))
        if toolbox is not None:
            from grpo.models.episodes import episode_metrics, run_tool_round

            with gathered(policy, cfg.deepspeed.zero_stage):
                batch = run_tool_round(policy, tok, cfg, rows, toolbox, device, eos_ids)
            ro, round_texts = batch.rollout, batch.texts
            sc = scorer(ro, rows, round_texts, step, episodes=batch)
            got = episode_metrics(batch.episodes, batch.responses_cut)
            tool_metrics = {k: (tool_metrics or {}).get(k, 0.0) + v for k, v in got.items()}
        else:
            ids, mask = encode_prompts(tok, [r["prompt"] for r in rows], cfg, device)
            settings = dict(
                num_generations=g.num_generations, max_completion_length=g.max_completion_length,
                eos_token_id=eos_ids, pad_token_id=tok.pad_token_id, temperature=g.temperature,
                top_p=g.top_p, top_k=g.top_k,
            )  # fmt: skip
            if rollout_engine is not None:
                ro = rollout_engine.generate(ids.cpu(), mask.cpu(), **settings).to(device)
            else:
                with gathered(policy, cfg.deepspeed.zero_stage):
                    ro = generate(policy, ids, mask, engine=cfg.model.generation_engine,
                                  **settings)  # fmt: skip
            round_texts = tok.batch_decode(ro.completion_ids, skip_special_tokens=True)
            sc = scorer(ro, rows, round_texts, step)
        parts.append(ro)
        kept_rows.extend(rows)
        texts.extend(round_texts)
        scores.append(sc)
        if rnd + 1 == rounds:  # no round left: whether more are needed does not matter
            break
        informative += int((~flat_groups(g, sc.rewards, round_texts, rows, ro.group_size)).sum())
        if not _needs_more(informative < local, 1 if alone else world, device):
            break
        rows = rng.sample(train_rows, local)
    return Sampled(
        cat_rollouts(parts, tok.pad_token_id),
        kept_rows,
        texts,
        Scores.cat(scores),
        len(parts),
        tool_metrics,
    )


def _needs_more(local_need: bool, world: int, device: torch.device) -> bool:
    if world == 1:
        return local_need
    return all_reduce_sum([float(local_need)], device)[0] > 0


def cat_rollouts(parts: list[Rollout], pad_id: int) -> Rollout:
    """Rollouts of several rounds as one, re-padded to the widest prompt and completion."""

    def pad(ts: list[torch.Tensor], left: bool, value: float) -> torch.Tensor:
        width = max(t.shape[1] for t in ts)
        out = []
        for t in ts:
            extra = width - t.shape[1]
            widths = (extra, 0) if left else (0, extra)
            out.append(torch.nn.functional.pad(t, widths, value=value))
        return torch.cat(out)

    multi = parts[0].model_mask is not None
    return Rollout(
        pad([p.prompt_ids for p in parts], True, pad_id),
        pad([p.prompt_mask for p in parts], True, 0),
        pad([p.completion_ids for p in parts], False, pad_id),
        pad([p.completion_mask for p in parts], False, 0),
        torch.cat([p.truncated for p in parts]),
        pad([p.sampling_logps for p in parts], False, 0.0),
        parts[0].group_size,
        pad([p.model_mask for p in parts], False, 0) if multi else None,
        pad([p.turn for p in parts], False, 0) if multi else None,
    )


def keep_groups(
    s: Sampled, num_prompts: int, g: GRPOConfig
) -> tuple[Rollout, Scores, list[str], list[dict]]:
    """The step's batch of `num_prompts` groups (all of them without dynamic sampling), with
    each completion's prompt row: (rollout, scores, texts, completion_rows)."""
    ro, G = s.rollout, s.rollout.group_size
    keep = torch.arange(ro.completion_ids.shape[0])
    if ro.num_groups > num_prompts:
        flat = flat_groups(g, s.scores.rewards, s.texts, s.group_rows, G)
        keep = select_groups(flat, G, num_prompts)
    idx = keep.tolist()
    return (
        ro.select(keep),
        s.scores.select(idx),
        [s.texts[i] for i in idx],
        [s.group_rows[i // G] for i in idx],
    )


def select_groups(flat_groups: torch.Tensor, group_size: int, keep: int) -> torch.Tensor:
    """Row indices of `keep` groups: informative groups first, in order, then zero-std groups
    (flat_groups [n_groups] True) to fill the fixed batch size when the rounds ran out.

    >>> select_groups(torch.tensor([True, False, False]), 2, 2)
    tensor([2, 3, 4, 5])
    """
    n_groups = flat_groups.numel()
    order = [i for i in range(n_groups) if not flat_groups[i]]
    order += [i for i in range(n_groups) if flat_groups[i]]
    return torch.cat([torch.arange(i * group_size, (i + 1) * group_size) for i in order[:keep]])
