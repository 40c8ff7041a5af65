"""`grpo compare`'s tables from two runs' logged values, by hand (the end-to-end comparison of
two real pipelines is in tests/integration/test_pipeline.py)."""

from types import SimpleNamespace

import pytest

from tasks.compare import differing_params, metric_rows, print_tables, sections


def _run(params: dict, metrics: dict, tags: dict | None = None) -> SimpleNamespace:
    return SimpleNamespace(data=SimpleNamespace(params=params, metrics=metrics, tags=tags or {}))


A = _run({"grpo.steps": "1", "grpo.lr": "0.001"},
         {"grpo/eval/synthetic/accuracy": 0.5, "grpo/eval/synthetic/sampled_pass_at_8": 0.7,
          "reference/eval/synthetic/accuracy": 0.4, "grpo/steps": 1.0,
          "grpo/eval/synthetic/accuracy_ci_low": 0.3},
         {"data_hash": "d1", "mlflow.source.git.commit": "c1"})  # fmt: skip
B = _run({"grpo.steps": "2", "grpo.lr": "0.001", "grpo.beta": "0.04"},
         {"grpo/eval/synthetic/accuracy": 0.625, "reference/eval/synthetic/accuracy": 0.4},
         {"data_hash": "d1", "mlflow.source.git.commit": "c2"})  # fmt: skip


def test_only_what_differs_is_listed_with_a_dash_for_a_missing_value():
    assert differing_params(A, B) == [
        {"key": "grpo.beta", "A": "-", "B": "0.04"},
        {"key": "grpo.steps", "A": "1", "B": "2"},
        {"key": "mlflow.source.git.commit", "A": "c1", "B": "c2"},
    ]


def test_held_out_metrics_side_by_side_reference_first():
    rows = metric_rows(A, B)
    keys = [(r["model"], r["metric"]) for r in rows]
    # the reference before GRPO; intervals and step counts are not compared here
    assert keys == [("reference", "accuracy"), ("grpo", "accuracy"),
                    ("grpo", "sampled_pass_at_8")]  # fmt: skip
    acc = rows[1]
    assert (acc["A"], acc["B"]) == (0.5, 0.625) and acc["B - A"] == pytest.approx(0.125)
    assert rows[2]["B"] is None and rows[2]["B - A"] is None  # B did not sample
    result = {"A": {"run_id": "a"}, "B": {"run_id": "b"}, "params": differing_params(A, B),
              "metrics": rows, "paired": [], "unpaired": [], "costs": []}  # fmt: skip
    table = dict(sections(result))["held-out metrics"]
    assert table[1]["B - A"] == "+0.125" and table[2]["B"] == "-"


@pytest.mark.parametrize("width", [80, 60, 200])
def test_tables_fit_the_terminal_and_run_ids_are_never_cut(width):
    """An 80-column terminal (or a pipe) once folded the runs table's columns to nothing and cut
    the ids a user copies from it."""
    import io

    from rich.console import Console

    ids = {"A": "0123456789abcdef0123456789abcdef", "B": "fedcba9876543210fedcba9876543210"}
    side = {s: {"run_id": i, "name": f"smollm2-135m-rg-{s}", "status": "FINISHED",
                "started": "2026-12-07 05:06 UTC", "registered_version": "12"}
            for s, i in ids.items()}  # fmt: skip
    rows = metric_rows(A, B)
    costs = [{"what": "grpo seconds", "A": 12.5, "B": 14.0}]
    result = {**side, "params": differing_params(A, B), "metrics": rows, "paired": [],
              "unpaired": [], "costs": costs}  # fmt: skip
    out = io.StringIO()
    print_tables(result, Console(file=out, width=width, color_system=None))
    lines = out.getvalue().splitlines()
    assert max(len(x) for x in lines) <= width
    text = out.getvalue()
    for i in ids.values():  # whole, on one line
        assert any(i in x for x in lines), (i, text)
    assert "smollm2-135m-rg-B" in text and "+0.125" in text
    if width == 200:  # room for one row a run
        assert sum(ids["A"] in x and "FINISHED" in x for x in lines) == 1
