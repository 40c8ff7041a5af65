"""Which training prompts each rank sees at each step: a fresh permutation per epoch.

Deterministic in (seed, step), so a run resumed at step s sees exactly the prompts it would have.
"""

from __future__ import annotations

import functools
import hashlib
import random


def derived_seed(*parts: int) -> int:
    """A 56-bit seed derived from integers (seed, step, rank, ...), stable across processes."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:7], "little")


def prompt_indices(step: int, rank: int, local: int, world: int, n: int, seed: int) -> list[int]:
    """The training rows of one rank at one step: `local` of the n rows, the ranks' shares
    concatenated in rank order giving the global batch."""
    out = []
    for j in range(rank * local, (rank + 1) * local):
        epoch, k = divmod(step * local * world + j, n)
        out.append(_epoch_order(seed, epoch, n)[k])
    return out


@functools.lru_cache(maxsize=2)
def _epoch_order(seed: int, epoch: int, n: int) -> tuple[int, ...]:
    """The shuffled row order of one epoch; cached, since every step reads the same one."""
    perm = list(range(n))
    random.Random(derived_seed(seed, epoch)).shuffle(perm)
    return tuple(perm)
