"""Turning config entries into reward functions, and weighted scoring with errors that say which
function failed.

A reward function has TRL's signature: fn(completions, **kwargs) -> list[float | None], called
with keyword arguments only, as TRL calls it (so `def f(completion_ids, **kw)` works); they are
listed in reward_fns/__init__.py. None means "not applicable"
and is left out of that completion's weighted sum. Config entries are registry names
(reward_fns.registry) or import paths ("my_pkg.rewards:fn").
"""

from __future__ import annotations

import importlib
import math
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from reward_fns.errors import UserError
from reward_fns.registry import REWARD_FUNCS, RewardFn


class RewardFunctionError(UserError, RuntimeError):
    """A reward function raised or returned something unusable."""


def resolve(name: str, *, max_completion_length: int, overlong_cache: int) -> RewardFn:
    """Turn a config entry (a registered name or "module:function") into a reward function."""
    if name in REWARD_FUNCS:
        return REWARD_FUNCS[name](
            max_completion_length=max_completion_length, overlong_cache=overlong_cache
        )
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except ModuleNotFoundError as e:
            top = e.name == module.split(".")[0]  # the module itself, not one it imports
            where = ("; put its directory on PYTHONPATH (PYTHONPATH=. for the working "
                     "directory) or install it") if top else ""  # fmt: skip
            raise ValueError(f"reward_funcs: cannot import {name!r}: {e}{where}") from e
        except (ImportError, AttributeError) as e:
            raise ValueError(f"reward_funcs: cannot import {name!r}: {e}") from e
        if not callable(fn):
            raise ValueError(f"reward_funcs: {name!r} is not callable")
        return fn
    raise ValueError(
        f"reward_funcs: unknown reward function {name!r}; use one of {sorted(REWARD_FUNCS)} or "
        "an import path 'package.module:function'"
    )


def with_time_limit(name: str, fn: RewardFn, seconds: float) -> RewardFn:
    """Wrap a reward function so a call that hangs raises instead of stalling the run.

    The call runs in a daemon thread: a hung thread cannot be killed, but the step fails with a
    clear error and the process can exit. Built-in functions bound their own time
    (math-verify limits) and are not wrapped.
    """

    def limited(*, completions: Sequence[Any], **columns: Any) -> list:
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["out"] = fn(completions=completions, **columns)
            except Exception as e:  # noqa: BLE001 - re-raised in the caller's thread
                box["err"] = e

        t = threading.Thread(target=target, daemon=True, name=f"reward-{name}")
        t.start()
        t.join(seconds)
        if t.is_alive():
            raise RewardFunctionError(
                f"reward function {name!r} did not return within {seconds:g}s "
                f"({len(completions)} completions)"
            )
        if "err" in box:
            raise box["err"]
        return box["out"]

    return limited


def _call(
    name: str, fn: RewardFn, completions: Sequence[Any], columns: Mapping, shared: Mapping
) -> list:
    try:
        out = list(fn(completions=completions, **columns, **shared))
    except RewardFunctionError:
        raise
    except SystemExit as e:
        # sys.exit() inside a reward function would end the rank as if training had finished
        raise RewardFunctionError(
            f"reward function {name!r} called sys.exit({e.code!r}): a reward function returns "
            "scores, it must not end the process"
        ) from e
    except Exception as batch_error:
        # find the first completion that makes it fail, so the error can name it
        for i in range(len(completions)):
            try:
                fn(completions=completions[i : i + 1],
                   **{k: v[i : i + 1] for k, v in columns.items()},
                   **{k: _discard if k in _LOGGERS else v for k, v in shared.items()})  # fmt: skip
            except Exception as e:
                raise RewardFunctionError(
                    f"reward function {name!r} raised on completion {i}: {type(e).__name__}: {e}"
                ) from e
        raise RewardFunctionError(
            f"reward function {name!r} raised on the batch: {type(batch_error).__name__}: "
            f"{batch_error}"
        ) from batch_error
    if len(out) != len(completions):
        raise RewardFunctionError(
            f"reward function {name!r} returned {len(out)} values "
            f"for {len(completions)} completions"
        )
    for i, v in enumerate(out):
        if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v)):
            raise RewardFunctionError(
                f"reward function {name!r} returned {v!r} for completion {i}; "
                "expected a finite number or None"
            )
    return out


_LOGGERS = ("log_extra", "log_metric")


def _discard(*args: Any) -> None:
    """log_extra/log_metric while one completion at a time is retried to find a failing one."""


def score(
    funcs: Mapping[str, RewardFn],
    weights: Sequence[float],
    completions: Sequence[Any],
    columns: Mapping[str, Sequence[Any]],
    shared: Mapping[str, Any] | None = None,
) -> tuple[list[float], dict[str, list[float | None]]]:
    """Weighted reward per completion and each function's raw scores.

    columns: one value per completion each; shared: keyword arguments passed whole to every
    function (trainer_state, log_extra, log_metric). A None score is left out of that
    completion's sum (the other functions still count).
    """
    if len(weights) != len(funcs):
        raise ValueError(f"reward_weights: {len(weights)} weights for {len(funcs)} functions")
    shared = shared or {}
    per_fn = {name: _call(name, fn, completions, columns, shared) for name, fn in funcs.items()}
    totals = []
    for i in range(len(completions)):
        vals = [(w, per_fn[n][i]) for n, w in zip(per_fn, weights)]
        totals.append(float(sum(w * v for w, v in vals if v is not None)))
    return totals, per_fn
