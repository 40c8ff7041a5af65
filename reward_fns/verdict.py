"""The verifier's verdict on a completion, strict and lenient, whatever the task's source."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from reward_fns.accuracy import accuracy, last_number_matches
from reward_fns.reasoning_gym import lenient_entry, score_entry


def verdicts(texts: Sequence[str], rows: Sequence[dict[str, Any]]) -> list[tuple[bool, bool]]:
    """(correct, correct_lenient) of each completion text against its row: a reasoning-gym row
    (with `rg_entry`) by its generator's checker (correct: a score of 1.0), any other by
    math-verify on the extracted answer and, leniently, by the last number written.

    Args:
        texts: the completions, plain text.
        rows: the problem row of each completion (one per text).
    """
    out: list[tuple[bool, bool] | None] = [None] * len(texts)
    math_idx = []
    for i, (t, r) in enumerate(zip(texts, rows, strict=True)):
        if r.get("rg_entry") is not None:
            out[i] = (score_entry(t, r["rg_entry"]) == 1.0, lenient_entry(t, r["rg_entry"]))
        else:
            math_idx.append(i)
    if math_idx:
        scores = accuracy([texts[i] for i in math_idx], [rows[i]["answer"] for i in math_idx])
        for i, s in zip(math_idx, scores, strict=True):
            out[i] = (bool(s), last_number_matches(texts[i], rows[i]["answer"]))
    return [v for v in out if v is not None]
