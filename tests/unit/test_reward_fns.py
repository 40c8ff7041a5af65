"""Reward functions on real GSM8K and MATH-500 answers; garbage and huge inputs stay fast."""

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reward_fns import (
    RewardFunctionError,
    accuracy,
    format_reward,
    resolve,
    score,
    soft_overlong_penalty,
)

DATA = Path(__file__).resolve().parents[2] / "data"


def _rows(path: Path, n: int) -> list[dict]:
    with path.open() as f:
        return [json.loads(line) for _, line in zip(range(n), f)]


def test_gsm8k_gold_answers_score_one_and_off_by_one_scores_zero():
    rows = _rows(DATA / "gsm8k" / "test.jsonl", 40)
    golds = [r["answer"].split("####")[-1].strip().replace(",", "") for r in rows]
    right = [f"<think>{r['answer']}</think><answer>{g}</answer>" for r, g in zip(rows, golds)]
    assert accuracy(right, golds) == [1.0] * len(golds)
    wrong = [f"<answer>{float(g) + 1}</answer>" for g in golds]
    assert accuracy(wrong, golds) == [0.0] * len(golds)


def test_math500_answers_in_equivalent_forms():
    rows = _rows(DATA / "math500" / "test.jsonl", 60)
    golds = [r["answer"] for r in rows]
    boxed = [f"So the answer is $\\boxed{{{g}}}$." for g in golds]
    scores = accuracy(boxed, golds)
    assert sum(scores) >= 0.95 * len(golds)  # the boxed gold itself
    assert accuracy(["$\\boxed{0.5}$", "<answer>\\dfrac{3}{6}</answer>"], ["\\frac{1}{2}"] * 2) == [
        1.0,
        1.0,
    ]
    assert accuracy(["$\\boxed{x^2+2x+1}$"], ["(x+1)^2"]) == [1.0]
    assert accuracy(["$\\boxed{3}$"], ["\\frac{1}{2}"]) == [0.0]


@pytest.mark.parametrize(
    "garbage",
    [
        "",
        "}}}{{{\\frac{\\frac{",
        "a" * 10_000,
        "\\sqrt{" * 5000,
        "<answer>" + "9^9^" * 2500 + "</answer>",
        "<think></think><answer>\\begin{matrix}" + "&" * 9000 + "</answer>",
    ],
)
def test_garbage_and_huge_inputs_score_zero_quickly(garbage):
    t = time.perf_counter()
    assert accuracy([garbage], ["17"]) == [0.0]
    assert time.perf_counter() - t < 6.0  # parse + verify limits of 1 s each, plus the gold


def test_a_processs_first_symbolic_answer_scores_on_a_loaded_cpu():
    """math-verify's alarms are wall-clock seconds, and its first parse and verify in a process
    load grammar and sympy code. A process that shares its core with nine busy ones (a loaded
    machine, in the extreme) must still score a correct first answer 1, not 0 by a timeout."""
    import os
    import subprocess
    import sys

    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("needs Linux CPU affinity")
    core = sorted(os.sched_getaffinity(0))[0]
    # the child imports first, then joins the busy core on "go": only its first scoring is
    # slowed, and the busy processes run for those few seconds only
    code = (
        "import os, sys, math_verify, sympy\n"
        "from reward_fns import accuracy\n"
        "print('ready', flush=True); sys.stdin.readline()\n"
        f"os.sched_setaffinity(0, {{{core}}})\n"
        "print(accuracy(['$\\\\boxed{x^2+2x+1}$', '\\\\sqrt{8}'], ['(x+1)^2', '2\\\\sqrt{2}']))"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             cwd=DATA.parent)  # fmt: skip
    assert child.stdout.readline().strip() == "ready"
    spin = f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"
    busy = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(9)]
    try:
        time.sleep(0.5)  # the busy ones on their core before the child joins them
        out, _ = child.communicate("go\n", timeout=120)
    finally:
        for b in busy:
            b.kill()
            b.wait()
        child.kill()
    assert child.returncode == 0, out[-2000:]
    assert out.strip().splitlines()[-1] == "[1.0, 1.0]", out


def test_accuracy_works_off_the_main_thread():
    out = []
    t = threading.Thread(target=lambda: out.append(accuracy(["<answer>4</answer>"], ["4"])))
    t.start()
    t.join(timeout=60)
    assert out == [[1.0]]


def test_chat_message_completions():
    msgs = [[{"role": "assistant", "content": "<think>ok</think><answer>12</answer>"}]]
    assert accuracy(msgs, ["12"]) == [1.0]
    assert format_reward(msgs) == [1.0]


def test_format_reward_cannot_be_farmed_by_repeating_tags():
    good = "<think>1+1=2</think><answer>2</answer>"
    assert format_reward([good]) == [1.0]
    farmed = [
        "<think>a</think><think>b</think><answer>2</answer>",
        good + good,
        "<think>a</think><answer>2</answer><answer>3</answer>",
        "<think><think></think></think><answer>2</answer>",
        "<think>a</think><answer></answer>",
        "<answer>2</answer>",
        good + " trailing text",
    ]
    assert format_reward(farmed) == [0.0] * len(farmed)


def test_soft_overlong_penalty_hand_values():
    fn = soft_overlong_penalty(max_completion_length=10, overlong_cache=4)
    ids = [[0] * n for n in (3, 6, 8, 10, 12)]
    # free length 6: 0, 0, (6-8)/4, (6-10)/4, -1
    assert fn(["x"] * 5, completion_ids=ids) == [0.0, 0.0, -0.5, -1.0, -1.0]
    with pytest.raises(ValueError, match="overlong_cache"):
        soft_overlong_penalty(10, 0)


def test_weighted_score_skips_none():
    funcs = {"a": lambda completions, **k: [1.0, None], "b": lambda completions, **k: [0.5, 0.5]}
    totals, per_fn = score(funcs, [2.0, 1.0], ["x", "y"], {})
    assert totals == [2.5, 0.5]
    assert per_fn["a"] == [1.0, None]


def test_failing_reward_function_is_named_with_the_completion_index():
    def picky(completions, **kw):
        return [1.0 / (len(c) - 3) for c in completions]  # divides by zero on "abc"

    with pytest.raises(RewardFunctionError, match=r"'picky' raised on completion 2"):
        score({"picky": picky}, [1.0], ["a", "ab", "abc", "abcd"], {})
    with pytest.raises(RewardFunctionError, match="returned nan"):
        score({"nan": lambda completions, **k: [float("nan")] * len(completions)}, [1.0], ["a"], {})
    from tests.fault_rewards import exits

    # sys.exit() in a reward function: named, instead of ending the rank as if it had finished
    with pytest.raises(RewardFunctionError, match=r"'exits' called sys.exit\(0\)"):
        score({"exits": exits}, [1.0], ["a"], {})


def test_registry_resolves_names_and_import_paths():
    settings = {"max_completion_length": 10, "overlong_cache": 4}
    assert resolve("accuracy", **settings) is accuracy
    assert resolve("reward_fns.format:format_reward", **settings) is format_reward
    # a builder gets the GRPO settings: the penalty ramp starts at 10 - 4 tokens
    overlong = resolve("soft_overlong", **settings)
    assert overlong(["a", "b"], completion_ids=[[0] * 6, [0] * 8]) == [0.0, -0.5]
    with pytest.raises(ValueError, match="unknown reward function 'nope'"):
        resolve("nope", **settings)
    with pytest.raises(ValueError, match="cannot import"):
        resolve("no_such_module:fn", **settings)


def test_registries_list_every_builtin_once():
    from reward_fns import PROCESS_REWARDS, REWARD_FUNCS

    assert sorted(REWARD_FUNCS) == ["accuracy", "environment", "format", "reasoning_gym",
                                   "reasoning_gym_exact", "soft_overlong"]  # fmt: skip
    assert list(PROCESS_REWARDS) == ["column_steps", "arithmetic_steps"]


@settings(max_examples=150, deadline=None)
@given(st.integers(-(10**6), 10**6), st.integers(-(10**6), 10**6), st.integers(0, 2))
def test_integer_shortcut_agrees_with_math_verify(a, b, zeros):
    from reward_fns.accuracy import _math_verify_matches, answer_matches

    pred = ("-" if a < 0 else "") + "0" * zeros + str(abs(a))  # leading zeros too
    for gold in (str(b), str(a)):
        assert answer_matches(pred, gold) == _math_verify_matches(pred, gold)


def test_column_steps_scores_the_problems_own_steps():
    from grpo.data.synthetic import worked_solution
    from reward_fns import column_steps

    # a correct worked solution: every column step and the answer score 1 (the trailing carry
    # digit "1" is not an x+y=s step)
    for a, b in [(47, 85), (999, 1), (5, 3), (120, 7)]:
        ((rewards, ends),) = column_steps([worked_solution(a, b)], [f"{a}+{b}="], [str(a + b)])
        assert rewards == [1.0] * len(rewards) and len(rewards) == len(str(max(a, b))) + 1
    # true but irrelevant sums earn nothing; the real answer still scores
    ((rewards, _),) = column_steps(
        ["<think>1+1=2 2+2=4</think><answer>132</answer>"], ["47+85="], ["132"]
    )
    assert rewards == [0.0, 0.0, 1.0]
    # the carry forgotten in column 2: caught there, column 1 still right
    ((rewards, _),) = column_steps(
        ["<think>7+5=12 4+8=12 1</think><answer>122</answer>"], ["47+85="], ["132"]
    )
    assert rewards == [1.0, 0.0, 0.0]
    # a wrong sum in column 1 and an extra step beyond the problem's columns
    ((rewards, _),) = column_steps(
        ["<think>7+5=13 4+8+1=13 1+0=1</think><answer>132</answer>"], ["47+85="], ["132"]
    )
    assert rewards == [0.0, 1.0, 0.0, 1.0]


def test_arithmetic_steps_is_gamed_by_easy_sums_where_column_steps_is_not():
    from reward_fns import arithmetic_steps, column_steps

    gamed = ["<think>1+1=2 2+2=4 3+3=6</think><answer>0</answer>"]
    assert arithmetic_steps(gamed, ["132"])[0][0] == [1.0, 1.0, 1.0, 0.0]
    assert column_steps(gamed, ["47+85="], ["132"])[0][0] == [0.0, 0.0, 0.0, 0.0]


def test_an_integer_answer_must_be_written_out_not_copied_as_the_problem():
    """SmolLM2-135M learned in 10 GRPO steps to answer "20+24=" with "The final answer is:
    20+24." (math-verify keeps the expression unevaluated and finds it equal to 44). An integer
    gold now needs an integer; worked equations and other gold forms still count."""
    from reward_fns import accuracy

    hacks = ["The final answer is: 20+24.", "x = 20+24", "<answer>20+24</answer>",
             "<answer>4*11</answer>", "The answer is $20 + 24$."]  # fmt: skip
    assert accuracy(hacks, ["44"] * len(hacks)) == [0.0] * len(hacks)
    honest = [
        "20 + 24 = 44", "The answer is \\boxed{44}.", "So the answer is 44.",
        "<think>4+0=4 2+2=4</think><answer>44</answer>", "It is 1,044.", "<answer>-44</answer>",
    ]  # fmt: skip
    golds = ["44", "44", "44", "44", "1044", "-44"]
    assert accuracy(honest, golds) == [1.0] * len(honest)
    # a non-integer gold keeps math-verify's equivalence: a fraction for 1.5
    assert accuracy(["<answer>\\frac{3}{2}</answer>", "<answer>3/2</answer>"], ["1.5"] * 2) == [
        1.0, 1.0,
    ]  # fmt: skip


@pytest.mark.parametrize("gold", ["0", "12", "-7", "3.25", "-0.5", "007", "1000000"])
def test_the_plain_number_shortcut_agrees_with_math_verify(gold):
    """gold_parses skips math-verify for plain numbers (validation of a million rows): it must
    say what math-verify says."""
    from reward_fns.accuracy import _gold_parses, gold_parses

    assert gold_parses(gold) is True and _gold_parses(gold) is True


_STALLED_GOLD_CHECK = r"""
import os, signal, sys
from reward_fns.accuracy import _warm_math_verify, gold_parses

_warm_math_verify()
# stop this process after 20 ms of its own CPU time, in the middle of the parse (0.28 CPU-s),
# as a busy machine does to it; the test continues it 1.5 s later
signal.signal(signal.SIGVTALRM, lambda *_: os.kill(os.getpid(), signal.SIGSTOP))
signal.setitimer(signal.ITIMER_VIRTUAL, 0.02)
print(gold_parses(sys.argv[1]))
"""


def test_a_gold_answer_still_parses_when_its_process_is_stalled_mid_parse():
    """Validation's check that a gold answer parses must not depend on how busy the machine is:
    math-verify's timeout is a wall-clock alarm, and a stall of 1.5 s in the first parse of
    MATH-500's precalculus/499 answer made the whole pipeline fail validation (seen in a full
    test run on 2 cores). The stall here is a real SIGSTOP of the process mid-parse."""
    import subprocess
    import sys

    gold = r"\left[ \frac{\pi^2}{8}, \frac{5 \pi^2}{4} \right]"
    proc = subprocess.Popen(
        [sys.executable, "-c", _STALLED_GOLD_CHECK, gold], stdout=subprocess.PIPE, text=True
    )
    _, status = os.waitpid(proc.pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status), "the check finished before its stall: nothing was tested"
    time.sleep(1.5)
    os.kill(proc.pid, signal.SIGCONT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and out.strip() == "True"


def test_a_second_reward_under_a_taken_name_is_refused_and_the_first_kept():
    from reward_fns.registry import REWARD_FUNCS, DuplicateRewardName, reward_function

    first = REWARD_FUNCS["accuracy"]
    with pytest.raises(DuplicateRewardName, match="'accuracy' is already registered"):
        reward_function("accuracy")(lambda completions, **kw: [0.0] * len(completions))
    assert REWARD_FUNCS["accuracy"] is first


def test_the_environment_reward_is_each_episodes_own_score():
    from reward_fns import RewardFunctionError, environment_reward

    class Env:
        def __init__(self, v):
            self.v = v

        def get_reward(self):
            return self.v

    assert environment_reward(["a", "b"], environments=[Env(1), Env(0.25)]) == [1.0, 0.25]
    with pytest.raises(RewardFunctionError, match="no get_reward"):
        environment_reward(["a"], environments=[object()])
    with pytest.raises(RewardFunctionError, match="gave nan"):
        environment_reward(["a"], environments=[Env(float("nan"))])
    with pytest.raises(RewardFunctionError, match="no environments"):
        environment_reward(["a"])
