"""Answer correctness with math-verify, bounded in time.

The final answer is read from the last <answer>...</answer> block when there is one, else from the
text after </think>, else from the whole completion (math-verify then finds \\boxed{} or the last
expression). Only the last MAX_ANSWER_CHARS characters are parsed: the final answer sits at the
end, and sympy's cost grows with input size. math-verify's timeouts use SIGALRM, which exists
only in a process's main thread; called from another thread (a Prefect task runner, say) the
batch is scored in a short-lived child process instead, where the alarms work.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any

from reward_fns.registry import reward_function
from reward_fns.text import completion_text

MAX_ANSWER_CHARS = 2000
TIME_LIMIT_S = 1  # per parse and per verify call; math-verify takes whole seconds
# A gold answer comes from the validated dataset, not from the model, so it needs no tight
# bound: the alarm counts wall-clock time, and a process starved on busy cores may not get the
# CPU time of a long gold's first parse (a MATH-500 interval) within 1 s.
GOLD_LIMIT_S = 30
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_INTEGER = re.compile(r"-?[0-9]+")
# an integer as written in text: thousands commas, a sentence's closing period
_WRITTEN_INTEGER = re.compile(r"-?[0-9][0-9,]*\.?")


def extract_answer(text: str) -> str:
    """The part of a completion that holds its final answer.

    >>> extract_answer("<think>3+4=7</think><answer>7</answer>")
    '7'
    """
    tagged = _ANSWER_TAG.findall(text)
    if tagged:
        return tagged[-1].strip()
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    return text[-MAX_ANSWER_CHARS:].strip()


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number_matches(text: str, gold: str) -> bool:
    """The lenient reading: the last number written anywhere in the text equals the gold answer
    (commas in numbers ignored). It sees through a missing <answer> tag, so a gain under the
    strict reading (`is_correct`) that is only format shows up as such.

    >>> last_number_matches("7 + 6 = 13.", "13"), last_number_matches("1,024 then 5", "1024")
    (True, False)
    """
    found = _NUMBER.findall(text.replace(",", ""))
    if not found:
        return False
    try:
        return float(found[-1]) == float(str(gold).replace(",", ""))
    except ValueError:
        return False


# the one-off warm-up's limit: a fixed small input, so only a stalled process comes near it
WARM_LIMIT_S = 60


@functools.cache
def _warm_math_verify() -> None:
    """math-verify's first parse and verify in a process load its LaTeX grammar and the parts
    of sympy that are imported lazily, about half a second, which would be paid inside the first
    real call's 1-s alarm, which is wall-clock time: on a loaded machine that alarm can fire
    first and score a correct answer 0 (x^2+2x+1 against (x+1)^2). Paid once per process
    here, on a fixed input, under a limit no healthy process reaches."""
    from math_verify import parse, verify

    gold = parse("$(x+1)^2$", parsing_timeout=WARM_LIMIT_S)
    verify(gold, parse("$x^2+2x+1$", parsing_timeout=WARM_LIMIT_S), timeout_seconds=WARM_LIMIT_S)


def _parse(text: str, wrap: bool, limit_s: int = TIME_LIMIT_S) -> list:
    from math_verify import parse

    _warm_math_verify()
    first = f"${text}$" if wrap else text
    second = text if wrap else f"${text}$"
    parsed = parse(first, parsing_timeout=limit_s)
    return parsed if parsed else parse(second, parsing_timeout=limit_s)


def _parse_gold(gold: str) -> list:
    return _parse(gold, wrap=True, limit_s=GOLD_LIMIT_S)


def is_correct(prediction: str, gold: str) -> bool:
    """True when the prediction's final answer is mathematically equal to the gold answer."""
    return answer_matches(extract_answer(prediction)[-MAX_ANSWER_CHARS:], str(gold))


@functools.lru_cache(maxsize=65536)
def answer_matches(answer: str, gold: str) -> bool:
    """Is an extracted final answer equal to the gold answer? Memoised per (answer, gold).

    The G completions of a prompt share a gold and mostly repeat a few answers, and math-verify
    (sympy) costs about a millisecond per parse: a batch of 256 completions took 0.45 s, as long
    as sampling them. Two plain integers are compared as integers, which is what math-verify
    concludes for them too (tests check both agree).

    An integer gold needs an integer written out. math-verify keeps an expression unevaluated
    and then finds it equal: "The final answer is: 20+24." matched 44. SmolLM2-135M learned to
    copy the problem back that way within 10 GRPO steps (benchmarks/REAL_MODEL.md), so for an
    integer gold the expression math-verify extracted must itself be an integer.

    >>> answer_matches("0132", "132"), answer_matches("3/2", "1.5")
    (True, True)
    >>> answer_matches("The final answer is: 20+24.", "44"), answer_matches("7 + 6 = 13.", "13")
    (False, True)
    """
    if _INTEGER.fullmatch(answer) and _INTEGER.fullmatch(gold):
        return int(answer) == int(gold)
    return _math_verify_matches(answer, gold, written_integer=bool(_INTEGER.fullmatch(gold)))


def _math_verify_matches(answer: str, gold: str, written_integer: bool = False) -> bool:
    from math_verify import verify

    gold_parsed = _parse_gold(gold)
    pred_parsed = _parse(answer, wrap=False)
    if not gold_parsed or not pred_parsed:
        return False
    # parse() gives [expression, the text it was read from]
    if written_integer and not _WRITTEN_INTEGER.fullmatch(str(pred_parsed[-1]).strip()):
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=TIME_LIMIT_S))


def gold_parses(gold: str) -> bool:
    """True when math-verify parses a gold answer into math, not only its raw-string fallback.

    >>> gold_parses("\\frac{1}{2}"), gold_parses("}}{{")
    (True, False)
    """
    gold = str(gold).strip()
    # a plain integer or decimal, most gold answers, parses: no need for math-verify's 0.85 ms
    # (validating a million rows took longer than 590 s, nearly all of it here)
    return bool(_NUMBER.fullmatch(gold)) or _gold_parses(gold)


@functools.lru_cache(maxsize=65536)
def _gold_parses(gold: str) -> bool:
    return any(not isinstance(x, str) for x in _parse_gold(gold))


def _score_batch(texts: list[str], answers: list[str]) -> list[float]:
    return [1.0 if is_correct(t, a) else 0.0 for t, a in zip(texts, answers)]


@reward_function("accuracy")
def accuracy(completions: Sequence[Any], answer: Sequence[str], **kwargs: Any) -> list[float]:
    """1.0 when the completion's final answer equals the gold `answer`, else 0.0.

    >>> accuracy(["<think>2*3=6</think><answer>6</answer>", "<answer>5</answer>"], ["6", "6"])
    [1.0, 0.0]
    """
    if len(answer) != len(completions):
        raise ValueError(f"answer: {len(answer)} gold answers for {len(completions)} completions")
    texts = [completion_text(c) for c in completions]
    golds = [str(a) for a in answer]
    if threading.current_thread() is threading.main_thread():
        return _score_batch(texts, golds)
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("forkserver")) as pool:
        return pool.submit(_score_batch, texts, golds).result()
