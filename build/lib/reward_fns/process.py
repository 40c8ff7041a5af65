"""Step-level (process) rewards for process-supervised GRPO (DeepSeekMath section 4.1.3).

A process reward function returns, per completion, (step_rewards, step_end_chars): one reward per
reasoning step and the character offset in the completion where that step ends. The trainer maps
character offsets to token positions and calls grpo.algo.process_advantages.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from reward_fns.accuracy import is_correct
from reward_fns.registry import process_reward
from reward_fns.text import completion_text

_STEP = re.compile(r"(\d+(?:\+\d+)+)=(\d+)")


@process_reward("arithmetic_steps")
def arithmetic_steps(
    completions: Sequence[Any], answer: Sequence[str], **kwargs: Any
) -> list[tuple[list[float], list[int]]]:
    """Each `a+b(+c)=s` step inside <think> scores 1 if the sum is right, else 0; the final
    answer is one more step, ending where the completion ends, scored by math-verify.

    >>> arithmetic_steps(["<think>7+5=12 4+8+1=14</think><answer>142</answer>"], ["132"])
    [([1.0, 0.0, 0.0], [12, 21, 49])]
    """
    out = []
    for completion, gold in zip(completions, answer):
        text = completion_text(completion)
        think_end = text.find("</think>")
        region = text if think_end < 0 else text[:think_end]
        rewards, ends = [], []
        for m in _STEP.finditer(region):
            terms = [int(x) for x in m.group(1).split("+")]
            rewards.append(1.0 if sum(terms) == int(m.group(2)) else 0.0)
            ends.append(m.end() - 1)
        rewards.append(1.0 if is_correct(text, gold) else 0.0)
        ends.append(max(len(text) - 1, 0))
        out.append((rewards, ends))
    return out
