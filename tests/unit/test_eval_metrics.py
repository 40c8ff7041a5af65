"""pass@k, maj@k and intervals against hand-computed values."""

import math

import pytest

from grpo.eval.metrics import (
    majority_correct,
    paired_difference,
    pass_at_k,
    summarize,
    wilson_interval,
)


def test_pass_at_k_hand_values():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - (3 * 2) / (4 * 3))  # 1 - C(3,2)/C(4,2) = 0.5
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # C(3,3)/C(5,3) = 1/10
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 3, 2) == 1.0  # fewer than k wrong: always solved
    with pytest.raises(ValueError, match="k"):
        pass_at_k(2, 1, 3)


def test_majority_vote_on_a_crafted_case():
    # answers 7, 5, 5, 7, 5 -> 5 wins 3 to 2; 5 is wrong
    assert not majority_correct(["7", "5", "5", "7", "5"], [True, False, False, True, False])
    # a tie goes to the answer seen first
    assert majority_correct(["7", "5"], [True, False])


def test_wilson_interval_hand_value():
    lo, hi = wilson_interval(8, 10)
    z = 1.959963984540054
    centre = (0.8 + z * z / 20) / (1 + z * z / 10)
    half = z * math.sqrt(0.8 * 0.2 / 10 + z * z / 400) / (1 + z * z / 10)
    assert (lo, hi) == pytest.approx((centre - half, centre + half))
    assert wilson_interval(0, 0) == (0.0, 0.0)


def _rec(i, s, ok, ans="1"):
    return {
        "id": i,
        "sample": s,
        "correct": ok,
        "correct_lenient": ok,
        "extracted": ans,
        "length": 3,
        "truncated": False,
    }


def test_summarize_with_samples_and_paired_difference():
    recs = [_rec("a", 0, True), _rec("a", 1, False, "2"), _rec("b", 0, False), _rec("b", 1, False)]
    m = summarize(recs)
    assert m["accuracy"] == 0.5 and m["mean_accuracy"] == 0.25
    assert m["pass@2"] == pytest.approx(0.5) and m["pass@1"] == pytest.approx(0.25)
    b = [_rec("a", 0, True), _rec("b", 0, True)]
    a = [_rec("a", 0, True), _rec("b", 0, False)]
    d = paired_difference(a, b)
    assert d["diff"] == 0.5 and d["n"] == 2


def test_the_printed_table_shows_pass_and_maj_at_k():
    from grpo.eval.metrics import markdown_table

    recs = [
        {"id": str(i), "sample": j, "correct": (i + j) % 3 == 0,
         "correct_lenient": (i + j) % 3 == 0, "extracted": str(j % 2), "length": 5,
         "truncated": False}
        for i in range(6) for j in range(4)
    ]  # fmt: skip
    table = markdown_table({"model": "m", "sets": {"s": summarize(recs)}})
    header, _, row = table.splitlines()[2:5]
    assert "pass@4" in header and "maj@2" in header
    cells = dict(zip(header.split("|"), row.split("|")))
    assert float(cells[" pass@4 "]) == pytest.approx(summarize(recs)["pass@4"], abs=5e-4)


def test_the_comparison_table_pairs_every_model_with_the_reference_and_grpo_with_its_control():
    from grpo.eval.metrics import comparison, markdown_rows

    def recs(correct):
        return [{"set": "s", "id": i, "sample": 0, "correct": c} for i, c in enumerate(correct)]

    samples = {"reference": recs([1, 0, 0, 0]), "grpo": recs([1, 1, 1, 0]),
               "sft_continued": recs([1, 1, 0, 0])}  # fmt: skip
    reports = {k: {"sets": {"s": {"accuracy": sum(r["correct"] for r in v) / 4,
                                  "accuracy_ci_low": 0.0, "accuracy_ci_high": 1.0}}}
               for k, v in samples.items()}  # fmt: skip
    table, metrics, paired = comparison(["s"], list(samples), reports, samples)
    # grpo - reference: differences (0, 1, 1, 0): mean 0.5, sample sd 0.57735, half 1.96 * sd / 2
    half = 1.959964 * (1 / 3) ** 0.5 / 2
    assert table[0]["grpo - ref"] == f"+0.500 [{0.5 - half:+.3f}, {0.5 + half:+.3f}]"
    assert metrics["grpo/eval/s/diff_vs_sft_continued"] == 0.25
    assert paired["grpo_vs_sft_continued"]["s"]["n"] == 4.0
    md = markdown_rows(table).splitlines()
    assert md[0].startswith("| set | reference | grpo | sft_continued | grpo - ref |")
    assert len(md) == 3 and markdown_rows([]) == ""
