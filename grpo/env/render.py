"""The ids that follow a model's turn when tools answer it, in the model's own chat format.

Only the new text is rendered and tokenized: the end of the model's turn as the template
writes it (after the end-of-turn token the model drew itself), the tool messages, and the start
of the next assistant turn. It is found by rendering a stand-in conversation with and without the
tool messages and taking the difference, so the template decides the format and nothing before
the tool messages is ever re-rendered.

Formats:
- `template`: the chat template renders tool messages itself (Hermes/Qwen: role `tool`, shown
  as `<tool_response>` blocks);
- `user`: a chat template without tool use: each response goes in a user message
  `<tool_response>...</tool_response>`;
- `plain`: no chat template: the same block as plain text, and the model writes on.
"""

from __future__ import annotations

import re
from typing import Any

from grpo.env.calls import template_has_tools

MARK = "\x00grpo-assistant-turn\x00"


def response_block(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"


RESPONSE = re.compile(r"<tool_response>\n?(.*?)\n?</tool_response>", re.S)


def demo_turns(text: str) -> list[tuple[str, str]]:
    """A worked solution with tool use, written as one string, split into its turns:
    the model's text, then each `<tool_response>...</tool_response>` block as a tool message,
    then the model's next turn. `[("assistant", text)]` when it holds no response.

    >>> demo_turns('<tool_call>{"name": "calculator"}</tool_call><tool_response>4'
    ...            '</tool_response><answer>4</answer>')
    [('assistant', '<tool_call>{"name": "calculator"}</tool_call>'), ('tool', '4'), \
('assistant', '<answer>4</answer>')]
    """
    turns: list[tuple[str, str]] = []
    pos = 0
    for m in RESPONSE.finditer(text):
        if text[pos : m.start()].strip():
            turns.append(("assistant", text[pos : m.start()]))
        turns.append(("tool", m.group(1)))
        pos = m.end()
    turns.append(("assistant", text[pos:]))
    return turns


class ToolTurns:
    """Tool messages -> ids, for one tokenizer and format.

    Args:
        tokenizer: the model's tokenizer.
        chat: whether prompts use the chat template (model.chat_template).
        max_tool_tokens: one response's content is cut to this many tokens, "[cut]" at its end.
    """

    def __init__(self, tokenizer: Any, chat: bool, max_tool_tokens: int) -> None:
        self.tok, self.max_tool_tokens = tokenizer, max_tool_tokens
        template = getattr(tokenizer, "chat_template", None)
        self.format = ("template" if template_has_tools(template) else "user") if chat else "plain"
        self.cut = 0  # responses cut so far

    def _content(self, text: str) -> str:
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= self.max_tool_tokens:
            return text
        self.cut += 1
        marker = " [cut]"
        room = len(self.tok(marker, add_special_tokens=False)["input_ids"])
        keep = max(0, self.max_tool_tokens - room)
        return self.tok.decode(ids[:keep]) + marker

    def text(self, messages: list[dict[str, str]]) -> str:
        """The text that follows the model's end-of-turn token."""
        contents = [self._content(m["content"]) for m in messages]
        if self.format == "plain":
            return "\n" + "\n".join(response_block(c) for c in contents) + "\n"
        if self.format == "template":
            tool_msgs = [{"role": "tool", "content": c} for c in contents]
        else:
            joined = "\n".join(response_block(c) for c in contents)
            tool_msgs = [{"role": "user", "content": joined}]
        convo = [{"role": "user", "content": "q"}, {"role": "assistant", "content": MARK}]
        base = self.tok.apply_chat_template(convo, tokenize=False)
        full = self.tok.apply_chat_template(convo + tool_msgs, tokenize=False,
                                            add_generation_prompt=True)  # fmt: skip
        if not full.startswith(base):
            raise ValueError(
                "the chat template renders earlier turns differently once a tool message "
                "follows; tool turns cannot be appended token by token"
            )
        tail = base[base.rindex(MARK) + len(MARK) :]
        eos = self.tok.eos_token or ""
        after_eos = tail[len(eos) :] if eos and tail.startswith(eos) else tail
        return after_eos + full[len(base) :]

    def __call__(self, messages: list[dict[str, str]]) -> list[int]:
        return self.tok(self.text(messages), add_special_tokens=False)["input_ids"]
