"""Completion text access shared by reward functions (strings or chat messages, as TRL)."""

from __future__ import annotations

from typing import Any


def completion_text(completion: Any) -> str:
    """The text of a completion given as a string or as [{"role": ..., "content": ...}]."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    raise TypeError(
        f"completion: expected a string or a list of chat messages, got {type(completion).__name__}"
    )
