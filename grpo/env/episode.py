"""Multi-turn episodes, token in and token out.

An episode starts from a task's prompt ids. Each turn the engine extends every unfinished
episode with the model's tokens (batched across episodes); the environment then either runs the
tool calls it finds in that turn and appends the tool messages, or ends the episode. The ids the
trainer scores are exactly the sampler's ids and, between turns, the tool-response ids as they
were appended: the conversation is never re-rendered and re-tokenized, because a chat template
may rewrite earlier turns and BPE may merge tokens across a turn boundary, which would make the
trainer score tokens the model never drew. `model_mask` marks the model's own tokens; the tool
tokens (0) stay out of the loss, the KL, the entropy bonus and every length normaliser, and
carry no behaviour log-prob.

Limits (EpisodeLimits) end an episode or cut what it receives, each counted in `ended_by` or
the episode's counters: turns, total tokens after the prompt, tokens of one tool response, and
calls per turn (the calls past it are answered with an error, not run).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from grpo.env.calls import Call, Malformed, parse_calls
from grpo.env.tools import Tool, ToolCallError, run_tool


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 4  # model turns; a call in the last one is not run
    max_total_tokens: int = 512  # model and tool tokens after the prompt
    max_tool_tokens: int = 128  # one tool response, cut past it
    max_calls_per_turn: int = 4


@dataclass
class TurnOutput:
    """What the engine drew for one episode's turn."""

    ids: list[int]
    logprobs: list[float]
    finished: bool  # ended by an end-of-turn token, not by the token budget


@dataclass
class Episode:
    """One episode's tokens and record. `ids`, `model_mask`, `logprobs` and `turn` run over
    everything after the prompt, one entry a token."""

    prompt_ids: list[int]
    tools: dict[str, Tool]
    env: object | None = None
    ids: list[int] = field(default_factory=list)
    model_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn: list[int] = field(default_factory=list)
    turns: int = 0
    calls: list[dict[str, Any]] = field(default_factory=list)
    transcript: list[dict[str, str]] = field(default_factory=list)
    tool_errors: int = 0
    tool_seconds: float = 0.0
    ended_by: str | None = None  # answer, max_turns, max_total_tokens, length

    @property
    def done(self) -> bool:
        return self.ended_by is not None

    def append(self, ids: Sequence[int], logprobs: Sequence[float] | None, model: bool) -> None:
        self.ids += ids
        self.model_mask += [1 if model else 0] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        self.turn += [self.turns] * len(ids)


# the engine's turn: the full context of each unfinished episode (prompt and everything since)
# and the tokens each may still add -> what it drew
GenerateTurn = Callable[[list[list[int]], list[int]], list[TurnOutput]]
# tool messages (role tool, content) -> their ids, in the model's chat format
RenderTools = Callable[[list[dict[str, str]]], list[int]]


def run_episodes(
    episodes: list[Episode], generate: GenerateTurn, decode: Callable[[list[int]], str],
    render_tools: RenderTools, limits: EpisodeLimits,
) -> list[Episode]:  # fmt: skip
    """Run every episode to its end, a turn at a time, batched across those not done.

    Args:
        episodes: fresh episodes (prompt ids, their tools, their environment instance).
        generate: the engine: one turn for each unfinished episode.
        decode: token ids -> text (the tokenizer's decode, special tokens skipped).
        render_tools: tool messages -> the ids that follow a model turn in the chat format
            (end of the model's turn, the tool turns, the start of the next model turn).
        limits: the episode limits.
    """
    while True:
        live = [e for e in episodes if not e.done]
        if not live:
            return episodes
        budgets = [limits.max_total_tokens - len(e.ids) for e in live]
        outs = generate([e.prompt_ids + e.ids for e in live], budgets)
        for ep, out in zip(live, outs, strict=True):
            ep.turns += 1
            ep.append(out.ids, out.logprobs, model=True)
            text = decode(out.ids)
            ep.transcript.append({"role": "assistant", "content": text})
            if not out.finished:
                ep.ended_by = "max_total_tokens"
                continue
            calls = parse_calls(text)
            if not calls:
                ep.ended_by = "answer"
                continue
            if ep.turns >= limits.max_turns:
                ep.ended_by = "max_turns"
                continue
            messages = [_answer(ep, c, i, limits) for i, c in enumerate(calls)]
            ids = render_tools(messages)
            ep.transcript += messages
            if len(ep.ids) + len(ids) >= limits.max_total_tokens:
                ep.ended_by = "max_total_tokens"
                continue
            ep.append(ids, None, model=False)


def _answer(
    ep: Episode, call: Call | Malformed, index: int, limits: EpisodeLimits
) -> dict[str, str]:
    """The tool message answering one call (its result, or the error the model reads)."""
    record: dict[str, Any] = {"turn": ep.turns}
    if index >= limits.max_calls_per_turn:
        content = f"error: more than {limits.max_calls_per_turn} tool calls in one turn; not run"
        record |= {"error": content}
    elif isinstance(call, Malformed):
        content = f"error: {call.error}"
        record |= {"error": call.error}
    elif call.name not in ep.tools:
        content = f"error: no tool named {call.name!r}; tools: {', '.join(sorted(ep.tools))}"
        record |= {"name": call.name, "error": content}
    else:
        t0 = time.perf_counter()
        try:
            content = run_tool(ep.tools[call.name], call.arguments)
            record |= {"name": call.name, "arguments": call.arguments}
        except ToolCallError as e:
            content = f"error: {e}"
            record |= {"name": call.name, "arguments": call.arguments, "error": str(e)}
        seconds = time.perf_counter() - t0
        ep.tool_seconds += seconds
        record["seconds"] = seconds
    if "error" in record:
        ep.tool_errors += 1
    ep.calls.append(record | {"result": content})
    return {"role": "tool", "content": content}
