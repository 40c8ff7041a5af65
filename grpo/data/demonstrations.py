"""Tool-use demonstrations for SFT: one string per demonstration, the tool's turn in a
<tool_response> block (grpo.env.render.demo_turns splits it into the episode's turns)."""

from __future__ import annotations

import json

from grpo.env.calculator import calculator


def calculator_demo(expression: str, answer: str) -> str:
    """A call to the calculator with `expression`, the tool's response, and the answer. The
    response is the calculator's own output, and must be the gold answer: a demonstration that
    teaches a wrong expression is an error, not a row.

    Args:
        expression: what the demonstration passes to the calculator, e.g. "5*14+2*0".
        answer: the problem's gold answer.

    >>> calculator_demo("47+85", "132")  # doctest: +NORMALIZE_WHITESPACE
    '<tool_call>{"name": "calculator", "arguments": {"expression": "47+85"}}</tool_call>\
<tool_response>132</tool_response><think>132</think><answer>132</answer>'
    >>> calculator_demo("2*3", "7")
    Traceback (most recent call last):
    ...
    ValueError: the calculator gives 6 for '2*3', the answer is 7
    """
    result = calculator(expression)
    if result != answer:
        raise ValueError(
            f"the calculator gives {result} for {expression!r}, the answer is {answer}"
        )
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return (f"<tool_call>{call}</tool_call><tool_response>{result}</tool_response>"
            f"<think>{result}</think><answer>{result}</answer>")  # fmt: skip
