"""reasoning-gym's own answer checkers as a reward function, with TRL's calling convention.

The text a generator's `score_answer` sees is our answer extraction's (reward_fns.accuracy
.extract_answer): the last <answer>...</answer> block when there is one, else what follows
</think>, else the whole completion, stripped. A generator scores that string against its
entry (the row's `rg_entry` column): 1.0 for its answer, partial credit where the generator
gives it (the default checker: len(answer) / len(text) when the answer is inside a longer
text), 0 otherwise. Correct, for evaluation and rejection sampling, is a score of 1.0.

Two rewards: `reasoning_gym` is the checker's score as the library gives it, partial credit
included; `reasoning_gym_exact` is 1.0 where the checker says correct and 0 otherwise, the
verdict evaluation and rejection sampling use. Partial credit can be gamed: the default
checker pays 0.5 for "55" against the answer 5, so a group-relative advantage ranks a padded
answer above a wrong one, and a policy learns to pad.

The completion is never evaluated: checkers compare strings or parse numbers (sympy for the
algebra generators), as their library writes them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from reward_fns.accuracy import extract_answer
from reward_fns.registry import reward_function
from reward_fns.text import completion_text


@functools.cache
def _checker(generator: str) -> Callable[[str | None, dict[str, Any]], float]:
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(generator)


def score_entry(text: str, entry: dict[str, Any]) -> float:
    """The generator's score of a completion's extracted answer against its entry, in [0, 1].

    Args:
        text: the completion (plain text).
        entry: the reasoning-gym entry (question, answer, metadata with source_dataset).
    """
    generator = entry["metadata"]["source_dataset"]
    return float(_checker(generator)(extract_answer(text), entry))


def lenient_entry(text: str, entry: dict[str, Any]) -> bool:
    """The lenient reading: the generator's checker accepts the completion's last non-empty
    line, tags removed, even where no <answer> block holds it."""
    lines = [ln for ln in text.replace("<answer>", "").replace("</answer>", "").splitlines()
             if ln.strip()]  # fmt: skip
    if not lines:
        return False
    generator = entry["metadata"]["source_dataset"]
    return float(_checker(generator)(lines[-1].strip(), entry)) == 1.0


@reward_function("reasoning_gym")
def reasoning_gym_reward(
    completions: Sequence[Any], rg_entry: Sequence[dict[str, Any] | None], **kwargs: Any
) -> list[float | None]:
    """The row's generator scores each completion (None for a row with no reasoning-gym
    entry: a task mix with other sources)."""
    return [
        None if entry is None else score_entry(completion_text(c), entry)
        for c, entry in zip(completions, rg_entry, strict=True)
    ]


@reward_function("reasoning_gym_exact")
def reasoning_gym_exact_reward(
    completions: Sequence[Any], rg_entry: Sequence[dict[str, Any] | None], **kwargs: Any
) -> list[float | None]:
    """1.0 where the row's generator scores the completion 1.0 (correct), else 0.0: no partial
    credit (None for a row with no reasoning-gym entry)."""
    scores = reasoning_gym_reward(completions, rg_entry)
    return [None if s is None else float(s == 1.0) for s in scores]
