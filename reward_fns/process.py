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
_PROBLEM = re.compile(r"^\s*(\d+)\+(\d+)=\s*$")


def column_steps_of(a: int, b: int) -> list[tuple[list[int], int]]:
    """The true steps of column addition a + b, units first: (terms, sum) per column, the terms
    being the two digits (0 past a number's end) and the carry when there is one.

    >>> column_steps_of(47, 85)
    [([7, 5], 12), ([4, 8, 1], 13)]
    """
    da, db = str(a)[::-1], str(b)[::-1]
    steps, carry = [], 0
    for i in range(max(len(da), len(db))):
        terms = [int(da[i]) if i < len(da) else 0, int(db[i]) if i < len(db) else 0]
        terms += [carry] if carry else []
        total = sum(terms)
        steps.append((terms, total))
        carry = total // 10
    return steps


def _written_steps(text: str) -> list[tuple[list[int], int, int]]:
    """(terms, sum, end character) of each `a+b(+c)=s` written inside <think>."""
    think_end = text.find("</think>")
    region = text if think_end < 0 else text[:think_end]
    return [([int(x) for x in m.group(1).split("+")], int(m.group(2)), m.end() - 1)
            for m in _STEP.finditer(region)]  # fmt: skip


def _with_answer_step(
    text: str, gold: str, rewards: list[float], ends: list[int]
) -> tuple[list[float], list[int]]:
    """The final answer as one more step, ending where the completion ends."""
    return [*rewards, 1.0 if is_correct(text, gold) else 0.0], [*ends, max(len(text) - 1, 0)]


@process_reward("column_steps")
def column_steps(
    completions: Sequence[Any], prompt: Sequence[str], answer: Sequence[str], **kwargs: Any
) -> list[tuple[list[float], list[int]]]:
    """Each `x+y(+c)=s` step inside <think> scores 1 only when it is the problem's own step: the
    k-th step written must add the k-th digits of both operands (units first) plus the carry of
    the column before, and give their sum. A true but irrelevant sum (`1+1=2`) scores 0, and a
    carry error scores 0 at the step where it happens. The final answer is one more step, ending
    where the completion ends, scored by math-verify. Prompts that are not `a+b=` fall back to
    checking the sums alone (arithmetic_steps).

    >>> column_steps(["<think>7+5=12 4+8=12</think><answer>122</answer>"], ["47+85="], ["132"])
    [([1.0, 0.0, 0.0], [12, 19, 47])]
    """
    out = []
    for completion, problem, gold in zip(completions, prompt, answer):
        m = _PROBLEM.match(str(problem))
        if m is None:
            out += arithmetic_steps([completion], [gold])
            continue
        truth = column_steps_of(int(m.group(1)), int(m.group(2)))
        text = completion_text(completion)
        steps = _written_steps(text)
        rewards = [float(k < len(truth) and (terms, total) == truth[k])
                   for k, (terms, total, _) in enumerate(steps)]  # fmt: skip
        out.append(_with_answer_step(text, gold, rewards, [end for *_, end in steps]))
    return out


@process_reward("arithmetic_steps")
def arithmetic_steps(
    completions: Sequence[Any], answer: Sequence[str], **kwargs: Any
) -> list[tuple[list[float], list[int]]]:
    """Each `a+b(+c)=s` step inside <think> scores 1 if the sum is right, else 0; the final
    answer is one more step, ending where the completion ends, scored by math-verify. Whatever
    the numbers are: a policy can earn it with easy true sums (column_steps cannot be gamed so).

    >>> arithmetic_steps(["<think>7+5=12 4+8+1=14</think><answer>142</answer>"], ["132"])
    [([1.0, 0.0, 0.0], [12, 21, 49])]
    """
    out = []
    for completion, gold in zip(completions, answer):
        text = completion_text(completion)
        steps = _written_steps(text)
        rewards = [float(sum(terms) == total) for terms, total, _ in steps]
        out.append(_with_answer_step(text, gold, rewards, [end for *_, end in steps]))
    return out
