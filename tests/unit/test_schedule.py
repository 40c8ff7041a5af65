"""Learning-rate multipliers by hand."""

import pytest

from grpo.engine.schedules import lr_lambda


def test_warmup_then_cosine_linear_and_constant():
    cos = lr_lambda(10, 110, "cosine")
    assert cos(0) == pytest.approx(0.1) and cos(9) == pytest.approx(1.0)
    assert cos(10) == pytest.approx(1.0)
    assert cos(60) == pytest.approx(0.5)  # half way through the decay
    assert cos(110) == pytest.approx(0.0, abs=1e-12)
    assert lr_lambda(0, 100, "linear")(25) == pytest.approx(0.75)
    assert lr_lambda(5, 100, "constant")(50) == 1.0


def test_plateau_cuts_the_rate_then_stops_by_hand():
    from grpo.engine.schedules import PlateauLR

    p = PlateauLR(warmup=4, patience=2, cuts=2, factor=0.5)
    assert [p(s) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    # 2.0 best; 2.0 and 2.5 are not better (min delta) -> first cut
    assert [p.report(v) for v in (2.0, 2.0, 2.5)] == [False, False, False]
    assert p(100) == 0.5 and p(0) == 0.125  # the cut applies during warmup too
    # an improvement resets the count; a second plateau -> second cut, a third -> stop
    assert [p.report(v) for v in (1.0, 1.5, 1.2)] == [False, False, False]
    assert p(100) == 0.25 and p.cuts_made == 2
    assert [p.report(v) for v in (1.0, 0.99995)] == [False, True]


def test_paced_cosine_follows_any_progress_and_reads_it_every_step():
    from grpo.engine.schedules import paced_cosine

    reads = []
    state = {"p": 0.0}

    def progress():
        reads.append(state["p"])
        return state["p"]

    f = paced_cosine(2, progress)
    assert f(0) == 0.5 and f(1) == 1.0  # warmup by steps
    state["p"] = 0.5
    assert f(7) == pytest.approx(0.5)
    state["p"] = 1.7  # a run that overran its plan: clamped, never negative
    assert f(8) == pytest.approx(0.0, abs=1e-12)
    assert len(reads) == 4  # read during warmup too (a wall clock starts at the first step)


def test_pace_file_round_trip(tmp_path):
    from grpo.engine.pace import mark_done, read_pace, write_pace

    path = tmp_path / "pace.json"
    assert read_pace(path) == (0.0, False)  # the followed run has not begun
    write_pace(path, 3, 12)
    assert read_pace(path) == (0.25, False)
    mark_done(path)  # keeps where it got to
    assert read_pace(path) == (0.25, True)
    other = tmp_path / "sub" / "pace.json"
    mark_done(other)  # a run that failed before writing anything
    assert read_pace(other) == (0.0, True)


def test_the_control_takes_the_followed_runs_cores_once_it_is_done(tmp_path):
    """Beside GRPO the control has part of the cores; the read that finds GRPO done gives it
    threads_after for its last step and final selection, once, and not before."""
    import torch

    from grpo.engine.pace import mark_done, write_pace
    from grpo.engine.sft import _Budget

    path = tmp_path / "pace.json"
    before = torch.get_num_threads()
    target = 1 if before > 1 else 2
    try:
        budget = _Budget(None, path, threads_after=target)
        write_pace(path, 1, 4)
        assert budget.fraction() == 0.25 and torch.get_num_threads() == before
        assert not budget.spent()
        mark_done(path)
        assert budget.fraction() == 0.25 and budget.spent()
        assert torch.get_num_threads() == target and budget.threads_after is None
    finally:
        torch.set_num_threads(before)
    # without a followed run there is no moment to change at: refused
    with pytest.raises(ValueError, match="threads_after"):
        _Budget(10.0, None, threads_after=2)
