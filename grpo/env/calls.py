"""Tool calls in what a model wrote: found and parsed, never evaluated.

One format, the Hermes/Qwen one that chat templates with tool use define:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * 7"}}
    </tool_call>

A model whose chat template has no tool use is shown the same format in the system prompt
(`tool_instructions`), so that one parser serves both. The JSON between the tags is read with
`json.loads` and nothing else: a call is data, and a text that is not valid JSON, names no
tool, or carries arguments that are not an object is a malformed call, answered to the model
as an error and counted, never run.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)
MAX_CALL_CHARS = 20_000


@dataclass(frozen=True)
class Call:
    """A well-formed call: a tool's name and its arguments (not yet checked against it)."""

    name: str
    arguments: Any


@dataclass(frozen=True)
class Malformed:
    """A call that could not be read; `error` is what the model is told."""

    error: str


def parse_calls(text: str) -> list[Call | Malformed]:
    """Every `<tool_call>` block of one assistant turn, in order. An opening tag never closed
    is malformed too (the model stopped mid-call)."""
    found: list[Call | Malformed] = []
    for body in CALL.findall(text):
        found.append(_parse_one(body))
    tail = text.rsplit(CLOSE, 1)[-1]
    if OPEN in tail:
        found.append(Malformed(f"a {OPEN} was not closed with {CLOSE}"))
    return found


def _parse_one(body: str) -> Call | Malformed:
    body = body.strip()
    if len(body) > MAX_CALL_CHARS:
        return Malformed(f"a tool call over {MAX_CALL_CHARS} characters")
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, RecursionError) as e:
        what = e.msg if isinstance(e, json.JSONDecodeError) else "nested too deeply"
        return Malformed(f"the tool call is not valid JSON ({what})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return Malformed('a tool call is a JSON object {"name": ..., "arguments": {...}}')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return Malformed(f"{obj['name']}: arguments are a string that is not JSON")
    return Call(obj["name"], args)


def template_has_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders tools and calls itself (Hermes/Qwen style)."""
    return bool(chat_template) and "tools" in chat_template and OPEN in chat_template


def tool_instructions(schemas: list[dict[str, Any]]) -> str:
    """The system-prompt text that shows a model without tool use in its template the tools and
    the call format."""
    lines = "\n".join(json.dumps(s["function"]) for s in schemas)
    return (
        "You may call these tools:\n" + lines + "\n\nTo call one, write\n" + OPEN + "\n"
        '{"name": "<tool name>", "arguments": {<arguments as JSON>}}\n' + CLOSE + "\n"
        "and end your turn; the result comes back in <tool_response></tool_response>. "
        "Without a call, your turn is your final answer."
    )
