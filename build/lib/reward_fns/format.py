"""Format reward for the project's reasoning template and the DAPO soft overlong penalty.

Template: `<think>reasoning</think><answer>final answer</answer>` and nothing after it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from reward_fns.registry import reward_builder, reward_function
from reward_fns.text import completion_text

# exactly one think block then exactly one answer block: repeating tags cannot earn more
_TEMPLATE = re.compile(
    r"^\s*<think>(?:(?!</?think>|</?answer>).)*</think>\s*"
    r"<answer>(?:(?!</?think>|</?answer>).)+</answer>\s*$",
    re.DOTALL,
)


@reward_function("format")
def format_reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """1.0 when the completion follows the template exactly once, else 0.0.

    >>> format_reward(["<think>2+2=4</think><answer>4</answer>", "<think></think><think>"])
    [1.0, 0.0]
    """
    return [1.0 if _TEMPLATE.match(completion_text(c)) else 0.0 for c in completions]


@reward_builder("soft_overlong")
def soft_overlong_penalty(
    max_completion_length: int, overlong_cache: int, **settings: Any
) -> Callable[..., list[float]]:
    """DAPO's soft overlong punishment (arXiv:2503.14476, eq. 13) as a reward function.

    0 up to L_max - L_cache tokens, then linearly down to -1 at L_max, -1 beyond. Reads the
    `completion_ids` column the trainer passes (TRL does the same).
    """
    if not 0 < overlong_cache <= max_completion_length:
        raise ValueError(
            f"overlong_cache: must be in (0, {max_completion_length}], got {overlong_cache}"
        )
    free = max_completion_length - overlong_cache

    def soft_overlong(
        completions: Sequence[Any], completion_ids: Sequence[Sequence[int]], **kwargs: Any
    ) -> list[float]:
        out = []
        for ids in completion_ids:
            n = len(ids)
            if n <= free:
                out.append(0.0)
            elif n <= max_completion_length:
                out.append((free - n) / overlong_cache)
            else:
                out.append(-1.0)
        return out

    return soft_overlong
