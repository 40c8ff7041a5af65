"""What every config section shares: unknown keys refused, values validated on assignment."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def one_of(field: str, value: str, allowed: tuple[str, ...] | list[str]) -> str:
    """value, if it is one of `allowed` (a registry's names); else a message naming both."""
    if value not in allowed:
        raise ValueError(f"unknown {field} {value!r}; use one of {list(allowed)}")
    return value
