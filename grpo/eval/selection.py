"""Checkpoint selection on a split that no test set shares (data.num_select).

The rule, the same for GRPO and for its SFT control: the checkpoint with the highest greedy
accuracy on the selection split, the earliest step on ties, the starting policy (step 0)
included, so that a run that never improves on its start selects its start. A choice made on
the test problems themselves would bias every paired test run on them afterwards.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

RULE = (
    "highest greedy accuracy on the selection split (data.num_select problems, disjoint from "
    "every test set); earliest step on ties; step 0 (the starting policy) included"
)
SELECTION_FILE = "selection.json"
# the in-run accuracy's metric: on the selection split when there is one (the best step is
# kept), else on a subset of the first held-out set (a curve only; the last step is kept)
SELECT_KEY = "select/accuracy"
INRUN_KEY = "eval/inrun_subset_accuracy"
# the same accuracy linked to each checkpoint's logged model
CHECKPOINT_KEYS = {SELECT_KEY: "checkpoint/select_accuracy",
                   INRUN_KEY: "checkpoint/inrun_subset_accuracy"}  # fmt: skip


def last_dir(selected: Path) -> Path:
    """Where a run with a selection split keeps its last step's weights, beside the selected
    step's (policy/ -> policy_last/), for both to be evaluated.

    >>> last_dir(Path("run/grpo/policy")).as_posix()
    'run/grpo/policy_last'
    """
    return selected.with_name(selected.name + "_last")


def curve_key(rows: list[dict]) -> str:
    """Which in-run accuracy a run's metric rows carry: SELECT_KEY when any row has it.

    >>> curve_key([{"step": 0, "select/accuracy": 0.5}]), curve_key([{"step": 0}])
    ('select/accuracy', 'eval/inrun_subset_accuracy')
    """
    return SELECT_KEY if any(SELECT_KEY in r for r in rows) else INRUN_KEY


def best_of(curve: list[tuple[int, float]]) -> tuple[int, float]:
    """(step, accuracy) the rule selects from a curve of (step, accuracy).

    >>> best_of([(0, 0.5), (10, 0.7), (20, 0.7), (30, 0.6)])
    (10, 0.7)
    """
    if not curve:
        raise ValueError("no checkpoint was evaluated on the selection split")
    top = max(acc for _, acc in curve)
    return min(step for step, acc in curve if acc == top), top


@dataclass
class Selection:
    """The selection curve of one run; `record` says whether a step is the new best."""

    curve: list[tuple[int, float]] = field(default_factory=list)

    def record(self, step: int, accuracy: float) -> bool:
        """Add (step, accuracy); True when it is strictly better than every earlier step (so
        its weights are the ones to keep)."""
        if self.curve and step <= self.curve[-1][0]:
            raise ValueError(f"selection steps must increase: {step} after {self.curve[-1][0]}")
        new_best = not self.curve or accuracy > best_of(self.curve)[1]
        self.curve.append((step, float(accuracy)))
        return new_best

    def best(self) -> tuple[int, float]:
        return best_of(self.curve)

    def summary(self, last_step: int) -> dict:
        step, acc = self.best()
        return {"rule": RULE, "selected_step": step, "selected_accuracy": acc,
                "last_step": last_step, "curve": [list(p) for p in self.curve]}  # fmt: skip

    def save(self, path: Path) -> None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"curve": self.curve}))
        tmp.replace(path)

    @classmethod
    def resumed(cls, path: Path, step: int) -> Selection:
        """The curve a run resumed at `step` had up to that step (later points are redone)."""
        if step == 0 or not path.exists():
            return cls()
        curve = [(int(s), float(a)) for s, a in json.loads(path.read_text())["curve"]]
        return cls([p for p in curve if p[0] <= step])
