"""Checkpoint selection: the rule by hand, and a selection split no other set shares."""

import json

import pytest

from grpo.config import load_config
from grpo.data.synthetic import make_sets
from grpo.eval.selection import Selection, best_of


def test_the_best_step_is_the_highest_accuracy_and_the_earliest_on_ties():
    assert best_of([(0, 0.40), (10, 0.55), (20, 0.55), (30, 0.50)]) == (10, 0.55)
    # a run that never beats its start selects its start
    assert best_of([(0, 0.60), (10, 0.55), (20, 0.60)]) == (0, 0.60)
    with pytest.raises(ValueError, match="no checkpoint"):
        best_of([])


def test_record_says_when_to_keep_the_weights():
    s = Selection()
    kept = [s.record(step, acc) for step, acc in [(0, 0.4), (10, 0.5), (20, 0.5), (30, 0.7),
                                                   (40, 0.6)]]  # fmt: skip
    assert kept == [True, True, False, True, False]  # a tie keeps the earlier weights
    assert s.summary(last_step=40)["selected_step"] == 30
    assert s.summary(last_step=40)["last_step"] == 40
    with pytest.raises(ValueError, match="must increase"):
        s.record(40, 0.9)


def test_a_resumed_run_keeps_the_curve_up_to_its_checkpoint(tmp_path):
    s = Selection()
    for step, acc in [(0, 0.4), (10, 0.6), (20, 0.5), (30, 0.7)]:
        s.record(step, acc)
    s.save(tmp_path / "selection.json")
    again = Selection.resumed(tmp_path / "selection.json", 20)
    assert again.curve == [(0, 0.4), (10, 0.6), (20, 0.5)]
    assert again.record(30, 0.7)  # the redone step 30 is the best again: its weights rewritten
    assert Selection.resumed(tmp_path / "selection.json", 0).curve == []
    assert json.loads((tmp_path / "selection.json").read_text())["curve"][-1] == [30, 0.7]


def test_the_selection_split_shares_no_problem_and_moves_no_other_set():
    cfg = load_config(None, ["data.num_select=300", "data.num_train=2000"])
    sets = make_sets(cfg.data)
    pairs = {name: {tuple(sorted(map(int, r["prompt"].rstrip("=").split("+")))) for r in rows}
             for name, rows in sets.items()}  # fmt: skip
    assert len(sets["select"]) == len(pairs["select"]) == 300
    for name, other in pairs.items():
        if name != "select":
            assert not pairs["select"] & other, name  # a+b and b+a are the same problem
    assert all("worked_solution" not in r for r in sets["select"])  # answers only
    without = make_sets(load_config(None, ["data.num_train=2000"]).data)
    assert without["select"] == []
    assert all(without[k] == sets[k] for k in without if k != "select")


def test_selection_needs_its_cadence_and_the_synthetic_task():
    with pytest.raises(Exception, match="data.num_select .* grpo.eval_every > 0"):
        load_config(None, ["data.num_select=50", "grpo.eval_every=0"])
    with pytest.raises(Exception, match="synthetic task; with files"):
        load_config(None, ["data.num_select=50", "data.task=files", "data.train_path=x.jsonl"])
