"""Tools a model may call: plain typed Python functions with docstrings, turned into JSON
schemas the way transformers' tool use does (`transformers.utils.get_json_schema`), and called
with arguments checked against those schemas.

TRL's two forms run unchanged:
- `tools=[f, g]`: stateless functions, shared by every episode;
- `environment_factory=Cls`: one instance per episode; its public methods are its tools
  (`reset` and `get_reward` excluded, as in TRL), `reset` starts an episode from the dataset
  row's fields it names (all of them for `**kwargs`, none for a bare `reset(self)`) and may
  return text added to the prompt, and `get_reward()`, when defined, scores the finished
  episode.

What TRL allows and this project refuses, each with a one-line error: async tools (coroutine
functions), a tool without a docstring or a type for every argument (no schema can be made),
and two tools of one name.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

RESERVED = ("reset", "get_reward")  # an environment's lifecycle methods, never tools
JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool,
              "array": list, "object": dict}  # fmt: skip


class ToolSpecError(ValueError):
    """A tool or environment that cannot be offered to a model (the message names it)."""


@dataclass(frozen=True)
class Tool:
    """A function the model may call, with the JSON schema the chat template shows it."""

    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]

    @property
    def parameters(self) -> dict[str, Any]:
        return self.schema["function"]["parameters"]


def make_tool(fn: Callable[..., Any]) -> Tool:
    """A Tool from a typed, documented function (or bound method).

    Args:
        fn: the function; its docstring's first paragraph describes it and its `Args:` section
            each argument, as transformers' tool use expects.
    """
    name = getattr(fn, "__name__", repr(fn))
    if inspect.iscoroutinefunction(fn):
        raise ToolSpecError(f"tool {name}: async tools are not supported; use a plain function")
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import (
        DocstringParsingException,
        TypeHintParsingException,
    )

    try:
        schema = get_json_schema(fn)
    except (DocstringParsingException, TypeHintParsingException) as e:
        raise ToolSpecError(f"tool {name}: {str(e).splitlines()[0]}") from e
    return Tool(name, fn, schema)


def make_tools(functions: list[Callable[..., Any]]) -> dict[str, Tool]:
    """Tools by name, from TRL's `tools=[...]` list (or an environment's methods)."""
    out: dict[str, Tool] = {}
    for fn in functions:
        tool = make_tool(fn)
        if tool.name in out:
            raise ToolSpecError(f"two tools are named {tool.name}")
        out[tool.name] = tool
    return out


def reset_arguments(reset: Callable[..., Any], row: dict[str, Any]) -> dict[str, Any]:
    """What of the dataset row an environment's reset takes: all of it for **kwargs, else the
    fields its parameters name (none for a plain reset(self), as TRL's own example writes it).

    >>> def a(**kw): ...
    >>> def b(answer): ...
    >>> def c(): ...
    >>> [sorted(reset_arguments(f, {"answer": "4", "prompt": "2+2="})) for f in (a, b, c)]
    [['answer', 'prompt'], ['answer'], []]
    """
    params = inspect.signature(reset).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return dict(row)
    names = {p.name for p in params}
    return {k: v for k, v in row.items() if k in names}


def environment_tools(env: object) -> dict[str, Tool]:
    """The tools of one environment instance: its public methods but reset and get_reward."""
    names = [n for n in dir(env) if not n.startswith("_") and n not in RESERVED]
    methods = [getattr(env, n) for n in names if callable(getattr(env, n))]
    if not methods:
        raise ToolSpecError(f"environment {type(env).__name__} has no public methods (its tools)")
    return make_tools(methods)


class ToolCallError(Exception):
    """A call the model made that cannot run: its message goes back to the model."""


def check_arguments(tool: Tool, arguments: object) -> dict[str, Any]:
    """The call's arguments, checked against the tool's schema: an object, every required
    argument present, none unknown, each of its declared JSON type."""
    if not isinstance(arguments, dict):
        raise ToolCallError(f"{tool.name}: arguments must be a JSON object, got {_kind(arguments)}")
    props = tool.parameters.get("properties", {})
    unknown = sorted(set(arguments) - set(props))
    if unknown:
        raise ToolCallError(f"{tool.name}: unknown argument {', '.join(unknown)} "
                            f"(it takes {', '.join(props) or 'none'})")  # fmt: skip
    missing = [a for a in tool.parameters.get("required", []) if a not in arguments]
    if missing:
        raise ToolCallError(f"{tool.name}: missing argument {', '.join(missing)}")
    for arg, value in arguments.items():
        want = props[arg].get("type")
        types = JSON_TYPES.get(want) if isinstance(want, str) else None
        bad_bool = isinstance(value, bool) and want in ("integer", "number")
        if types is not None and (not isinstance(value, types) or bad_bool):
            raise ToolCallError(f"{tool.name}: argument {arg} must be {want}, got {_kind(value)}")
    return arguments


def _kind(value: object) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer",
            float: "number", type(None): "null"}.get(type(value), type(value).__name__)  # fmt: skip


def run_tool(tool: Tool, arguments: object) -> str:
    """Call a tool with checked arguments; its result as text (JSON for anything but a str).
    What the tool raises becomes a ToolCallError whose message the model reads."""
    args = check_arguments(tool, arguments)
    try:
        result = tool.fn(**args)
    except Exception as e:  # noqa: BLE001 - any failure of a user's tool is the model's to read
        raise ToolCallError(f"{tool.name} failed: {type(e).__name__}: {e}") from e
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result)
    except (TypeError, ValueError):
        return str(result)
