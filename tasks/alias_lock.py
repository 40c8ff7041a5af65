"""One alias move at a time per registered model, so that a move can compare and then set.

MLflow writes an alias last-writer-wins and has no compare-and-set: two pipelines finishing at
once could each check that @champion is still the model their evidence was measured against,
and both move it. Every move here happens inside a lock on (model, alias), and the check is
made again inside it: the second promotion then sees the first one's champion and is refused.

The lock is the store's own reach: a file lock beside a SQLite (or file) store, which only
processes of that machine can open; for a tracking server, a Prefect global concurrency limit of
one slot on the team's Prefect server (grpo serve runs both; PREFECT_API_URL names it), held
with a lease so that a holder that dies frees it within a lease.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from reward_fns.errors import UserError

LEASE_S = 60  # a dead holder's slot is freed after this long (Prefect's least)


class AliasLockError(UserError, RuntimeError):
    """The lock that makes an alias move compare-and-set cannot be had; the message names why."""


def lock_name(model: str, alias: str) -> str:
    """The lock's name: Prefect limit names allow no '/', '%' or '&'."""
    return "grpo-alias-" + re.sub(r"[^A-Za-z0-9._-]", "_", f"{model}-{alias}")


@contextmanager
def alias_move(tracking_uri: str, model: str, alias: str, wait_s: float = 120) -> Iterator[None]:
    """Hold the lock on `model`'s `alias` for the `with` block (check, then set, inside it).

    Args:
        tracking_uri: the MLflow store the alias lives in (sqlite:///..., a path, or http(s)).
        model: the registered model's name.
        alias: the alias to move (champion, challenger, ...).
        wait_s: how long to wait for another process's move to finish before failing.
    """
    if tracking_uri.startswith(("http://", "https://")):
        with _prefect_lock(lock_name(model, alias), tracking_uri, wait_s):
            yield
        return
    from grpo.launch.paths import file_lock

    store = Path(tracking_uri.removeprefix("sqlite:///").removeprefix("file://"))
    with file_lock(store.with_name(f"{store.name}.{lock_name(model, alias)}.lock")):
        yield


@contextmanager
def _prefect_lock(name: str, tracking_uri: str, wait_s: float) -> Iterator[None]:
    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value() or ""  # the environment's, or the active profile's
    if not api.startswith(("http://", "https://")):
        raise AliasLockError(
            f"moving an alias on the tracking server {tracking_uri} takes a lock on the team's "
            "Prefect server: set PREFECT_API_URL (and PREFECT_API_AUTH_STRING) as for a worker"
        )
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.concurrency.sync import concurrency
    from prefect.exceptions import ObjectAlreadyExists

    with get_client(sync_client=True) as pc:
        try:
            pc.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
        except ObjectAlreadyExists:
            pass  # made by an earlier move: one slot, as here
    held = ExitStack()
    try:
        held.enter_context(concurrency(name, occupy=1, timeout_seconds=wait_s,
                                       lease_duration=LEASE_S, strict=True))  # fmt: skip
    except TimeoutError:
        raise AliasLockError(
            f"another alias move held {name} on {api} for over {wait_s:.0f} s; try again"
        ) from None
    with held:
        yield
