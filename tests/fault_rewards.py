"""Reward functions that misbehave on purpose, loaded by import path like a user's own."""

import os
import signal
import time

_calls = {"n": 0}


def hang(completions, **kw):
    time.sleep(3600)


def overflow(completions, **kw):
    # float32 overflows once a few of these are summed over tokens: a non-finite loss
    return [3e38 if i % 2 else -3e38 for i in range(len(completions))]


def overflow_from_step2(completions, **kw):
    # a finite first step (a checkpoint is written), then the overflow above
    _calls["overflow"] = _calls.get("overflow", 0) + 1
    if _calls["overflow"] == 1:
        return [float(i % 2) for i in range(len(completions))]
    return overflow(completions)


def zero_from_step2(completions, **kw):
    # overflow_from_step2's first step, then nothing to learn (every advantage zero)
    _calls["zero"] = _calls.get("zero", 0) + 1
    return [float(i % 2) if _calls["zero"] == 1 else 0.0 for i in range(len(completions))]


def kill_rank1_at_step3(completions, **kw):
    _calls["n"] += 1
    if os.environ.get("RANK") == "1" and _calls["n"] == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return [0.0] * len(completions)


def raise_value_error(completions, **kw):
    raise ValueError("bad completion")


def exits(completions, **kw):
    import sys

    sys.exit(0)


def os_exits(completions, **kw):
    os._exit(0)


def huge(completions, **kw):
    # finite as a Python float, inf in float32
    return [1e308 if i % 2 else 0.0 for i in range(len(completions))]


def overflow_on_rank1_from_step2(completions, **kw):
    # finite everywhere at step 1; from step 2 on, rank 1's rows overflow and rank 0's do not
    _calls["rank1"] = _calls.get("rank1", 0) + 1
    if os.environ.get("RANK") == "1" and _calls["rank1"] > 1:
        return overflow(completions)
    return [float(i % 2) for i in range(len(completions))]


def alternating(completions, **kw):
    # every group has a spread of rewards, so every step moves the weights
    return [float(i % 2) for i in range(len(completions))]
