"""Promotion a person approves (tracking.promotion: approve).

After the gate's evidence is on the model version, the flow run pauses with Prefect's own input
mechanism: the Prefect UI shows the evidence and a form (promote or not, who, why) on the
paused flow run, and "Resume" hands the answer to the flow, which records it on the version
(tasks.registry.apply_approval). No answer within tracking.approval_timeout_s is a rejection.
The wait needs a Prefect server that outlives the flow run and that a person can open, which
the temporary one a plain `grpo pipeline` starts is not: checked before anything trains.
"""

from __future__ import annotations

import time
from typing import Any

from prefect.input import RunInput
from pydantic import Field

from grpo.config import Config
from reward_fns.errors import UserError

POLL_S = 2  # how often the paused flow asks its server whether it was resumed


class ApprovalError(UserError, RuntimeError):
    """Promotion by approval asked for where no person could answer."""


class PromotionDecision(RunInput):
    """The form on the paused flow run."""

    promote: bool = Field(description="make this version @champion")
    by: str = Field(min_length=1, description="who decides (recorded on the model version)")
    reason: str = Field(min_length=1, description="why (recorded on the model version)")


def server_url() -> str | None:
    """The Prefect API this process talks to; None when it is a temporary in-process one."""
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    return str(url) if url else None


def check_reachable(cfg: Config) -> None:
    """Refuse promotion by approval without a Prefect server (before any training)."""
    if cfg.tracking.promotion == "approve" and server_url() is None:
        raise ApprovalError(
            "tracking.promotion=approve waits for a person in the Prefect UI, but PREFECT_API_URL "
            "is not set (a temporary server would vanish with this run): start `grpo serve` and "
            "set PREFECT_API_URL, or use tracking.promotion=auto"
        )


def ask(cfg: Config, reg: dict[str, Any], evidence_md: str) -> dict[str, Any]:
    """Pause this flow run until a person decides on version reg["version"], or the timeout;
    returns {promote, by, reason, at}."""
    from prefect.context import FlowRunContext
    from prefect.exceptions import FlowPauseTimeout
    from prefect.flow_runs import pause_flow_run

    timeout = cfg.tracking.approval_timeout_s
    form = (
        f"{reg['decision']}\n\nPromoting makes version "
        f"{reg['version']} @champion; rejecting leaves @champion where it is. No answer within "
        f"{timeout} s is a rejection.\n\n{evidence_md}"
    )
    print(f"{reg['name']} version {reg['version']} awaits approval in the Prefect UI "
          f"(Resume on this flow run), for at most {timeout} s")  # fmt: skip
    ctx = FlowRunContext.get()
    assert ctx is not None and ctx.flow_run is not None, "ask() runs inside the pipeline flow"
    try:
        got = pause_flow_run(
            wait_for_input=PromotionDecision.with_initial_data(
                description=form, promote=reg["gate_passed"]
            ),
            timeout=timeout,
            poll_interval=POLL_S,
        )
    except FlowPauseTimeout:
        _resume_after_timeout(ctx.flow_run.id, timeout)
        why = f"no decision within {timeout} s (tracking.approval_timeout_s)"
        return {"promote": False, "by": "nobody", "at": _now(), "reason": why}
    return {"promote": got.promote, "by": got.by, "reason": got.reason, "at": _now()}


def _resume_after_timeout(flow_run_id: Any, timeout: int) -> None:
    """The flow run is still Paused on the server after a timeout; Prefect would then fail it
    at its end ("completed and never resumed"). A timeout is a decision (rejected), not a
    failure: the run is set Running again so that it can finish and record that decision."""
    from prefect import get_client
    from prefect.states import Running

    with get_client(sync_client=True) as c:
        c.set_flow_run_state(
            flow_run_id, Running(message=f"approval timed out after {timeout} s: rejected"),
            force=True,
        )  # fmt: skip


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
