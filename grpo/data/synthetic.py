"""The embedded synthetic task: multi-digit addition with worked, digit-by-digit solutions.

Why this task: a character-level model can learn it from a few hundred worked solutions only
partly (carries are where it slips), so the SFT reference samples right answers some of the time
and GRPO has within-group disagreement to learn from, on thousands of answer-only prompts.

Sets (disjoint by construction: every (a, b) pair is drawn once from one RNG):
sft (worked solutions), sft_val (early stopping), train (answer-only RL prompts),
heldout (same digit range), heldout_ood (more digits: harder, never trained on) and select
(answer-only, the checkpoints of GRPO and the control are chosen on it: never the test sets).
"""

from __future__ import annotations

import random

from grpo.config import DataConfig
from grpo.data.demonstrations import calculator_demo
from reward_fns.process import column_steps_of


def worked_solution(a: int, b: int) -> str:
    """Column addition from the units up, as the model is taught to write it.

    >>> worked_solution(47, 85)
    '<think>7+5=12 4+8+1=13 1</think><answer>132</answer>'
    """
    columns = column_steps_of(a, b)  # the steps reward_fns' column_steps checks
    steps = ["+".join(map(str, terms)) + f"={total}" for terms, total in columns]
    if columns[-1][1] >= 10:
        steps.append("1")  # the carry out of the last column
    return f"<think>{' '.join(steps)}</think><answer>{a + b}</answer>"


def calculator_solution(a: int, b: int) -> str:
    """The same sum worked by calling the calculator tool (grpo.env).

    >>> calculator_solution(47, 85)  # doctest: +NORMALIZE_WHITESPACE
    '<tool_call>{"name": "calculator", "arguments": {"expression": "47+85"}}</tool_call>\
<tool_response>132</tool_response><think>132</think><answer>132</answer>'
    """
    return calculator_demo(f"{a}+{b}", str(a + b))


def _number(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)


def make_sets(cfg: DataConfig) -> dict[str, list[dict]]:
    """All synthetic sets as lists of {id, prompt, answer, solution, worked_solution, digits}
    rows. `solution` is the gold answer, as open-r1 and TRL's accuracy_reward read it."""
    rng = random.Random(cfg.seed)
    seen: set[tuple[int, int]] = set()
    solve = calculator_solution if cfg.worked_solutions == "calculator" else worked_solution

    def draw(n: int, lo: int, hi: int, name: str) -> list[dict]:
        rows = []
        while len(rows) < n:
            da, db = rng.randint(lo, hi), rng.randint(lo, hi)
            a, b = _number(rng, da), _number(rng, db)
            if (a, b) in seen or (b, a) in seen:
                continue  # each pair (either order) belongs to exactly one set
            seen.add((a, b))
            rows.append(
                {
                    "id": f"{name}-{len(rows):06d}",
                    "prompt": f"{a}+{b}=",
                    "answer": str(a + b),
                    "solution": str(a + b),
                    "worked_solution": solve(a, b),
                    "digits": max(da, db),
                }
            )
        return rows

    lo, hi = cfg.min_digits, cfg.max_digits
    # held-out sets first, so that their contents do not depend on the training set sizes
    sets = {
        "heldout": draw(cfg.num_heldout, lo, hi, "heldout"),
        "heldout_ood": draw(cfg.num_heldout_ood, cfg.ood_digits, cfg.ood_digits, "ood"),
        "sft_val": draw(cfg.num_sft_val, lo, hi, "sftval"),
        "sft": draw(cfg.num_sft, lo, hi, "sft"),
        "train": draw(cfg.num_train, lo, hi, "train"),
        # last: no other set changes with its size (none drawn when 0)
        "select": draw(cfg.num_select, lo, hi, "select"),
    }
    for name in ("train", "select"):
        for row in sets[name]:
            row.pop("worked_solution")  # answers only: GRPO's gain must come from RL
    return sets
