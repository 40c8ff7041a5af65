"""Automations on the scheduled deployment, declared here and created by `grpo serve`.

A flow run whose heartbeats stop (its worker or machine died) is set Crashed. With
GRPO_ALERT_WEBHOOK_URL set, two more call one Prefect webhook block (the URL comes from the
environment, as it may hold a token; Prefect keeps it encrypted in the block):

- a flow run of the deployment ends Failed or Crashed;
- no flow run of the deployment ended Completed for `stale_hours` (a nightly that stopped
  running, or keeps failing, or hangs).

Run as `python -m infra.alerts DEPLOYMENT STALE_HOURS CRASHED_AFTER_S` in a process pointed at
the server (serve does); creating them again replaces the earlier ones of the same deployment.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from urllib.parse import urlsplit

URL_VAR = "GRPO_ALERT_WEBHOOK_URL"
BLOCK = "grpo-alerts"
STALE_HOURS = 26.0  # a nightly run plus two hours of slack
CRASHED_AFTER_S = 600  # three missed heartbeats at Prefect's default 180 s, and a minute


def names(deployment: str, stale_hours: float) -> tuple[str, str]:
    return (f"{deployment}: a run failed or crashed",
            f"{deployment}: no completed run for {stale_hours:g} h")  # fmt: skip


def payloads(deployment: str, stale_hours: float) -> tuple[str, str]:
    """The JSON bodies the receiver gets: Jinja that Prefect fills from the triggering event,
    each value through `tojson` (a state message holds quotes and newlines)."""

    def body(fixed: dict[str, str], templated: dict[str, str]) -> str:
        parts = [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in fixed.items()]
        parts += [f"{json.dumps(k)}: {{{{ {v} | tojson }}}}" for k, v in templated.items()]
        return "{" + ", ".join(parts) + "}"

    failed = body(
        {"alert": "flow run failed", "deployment": deployment},
        {"flow_run": "flow_run.name", "flow_run_id": "flow_run.id | string",
         "state": "flow_run.state.name", "message": "flow_run.state.message",
         "url": "flow_run | ui_url"},
    )  # fmt: skip
    stale = body({"alert": f"no completed run for {stale_hours:g} h", "deployment": deployment},
                 {})  # fmt: skip
    return failed, stale


def install(
    deployment: str, url: str | None, stale_hours: float = STALE_HOURS,
    crashed_after_s: int = CRASHED_AFTER_S,
) -> list[str]:  # fmt: skip
    """Crash detection, and with a URL the webhook block and both alerts, on the current
    Prefect server; returns the automations' names."""
    from prefect import get_client
    from prefect.automations import Automation, ChangeFlowRunState, EventTrigger, Posture
    from prefect.client.schemas.objects import StateType

    with get_client(sync_client=True) as c:
        dep = c.read_deployment_by_name(deployment)
        for old in c.read_automations():  # this deployment's, from an earlier serve
            if old.name.startswith(f"{deployment}: "):
                c.delete_automation(old.id)
    related = {"prefect.resource.id": f"prefect.deployment.{dep.id}"}
    # a flow run's process sends a heartbeat every PREFECT_FLOWS_HEARTBEAT_FREQUENCY seconds
    # (180); a run whose worker or machine died sends none and no final state either: without
    # this it would stay Running forever (Prefect's documented zombie-run automation)
    ended = {f"prefect.flow-run.{s}" for s in ("Completed", "Failed", "Cancelled", "Crashed")}
    crashed = f"{deployment}: a run whose heartbeats stopped is Crashed"
    Automation(
        name=crashed,
        description="declared in infra/alerts.py; created by grpo serve",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"}, expect={"prefect.flow-run.heartbeat", *ended},
            match={"prefect.resource.id": "prefect.flow-run.*"}, match_related=related,
            for_each={"prefect.resource.id"}, posture=Posture.Proactive, threshold=1,
            within=timedelta(seconds=crashed_after_s),
        ),
        actions=[ChangeFlowRunState(
            state=StateType.CRASHED,
            message=f"no heartbeat for {crashed_after_s} s: the process running this flow run "
            "is gone (its worker or its machine died); grpo serve ends its MLflow runs KILLED",
        )],
    ).create()  # fmt: skip
    if url is None:
        return [crashed]
    return [crashed, *_alerts(deployment, url, stale_hours, related)]


def _alerts(deployment: str, url: str, stale_hours: float, related: dict[str, str]) -> list[str]:
    from prefect.automations import Automation, CallWebhook, EventTrigger, Posture
    from prefect.blocks.webhook import Webhook

    # a team's receiver often lives on its own network: the operator chose the URL
    block_id = Webhook(method="POST", url=url, allow_private_urls=True).save(BLOCK, overwrite=True)
    on_failure, on_stale = names(deployment, stale_hours)
    failed_body, stale_body = payloads(deployment, stale_hours)
    Automation(
        name=on_failure,
        description="declared in infra/alerts.py; created by grpo serve",
        trigger=EventTrigger(
            match_related=related, expect={"prefect.flow-run.Failed", "prefect.flow-run.Crashed"},
            posture=Posture.Reactive, threshold=1,
        ),
        actions=[CallWebhook(block_document_id=block_id, payload=failed_body)],
    ).create()  # fmt: skip
    Automation(
        name=on_stale,
        description="declared in infra/alerts.py; created by grpo serve",
        trigger=EventTrigger(
            match_related=related, expect={"prefect.flow-run.Completed"},
            posture=Posture.Proactive, threshold=1, within=timedelta(hours=stale_hours),
        ),
        actions=[CallWebhook(block_document_id=block_id, payload=stale_body)],
    ).create()  # fmt: skip
    return [on_failure, on_stale]


def where(url: str) -> str:
    """The receiver as it may be printed: scheme and host, not a path that may hold a token."""
    u = urlsplit(url)
    return f"{u.scheme}://{u.hostname}{f':{u.port}' if u.port else ''}/..."


if __name__ == "__main__":
    made = install(sys.argv[1], os.environ.get(URL_VAR), float(sys.argv[2]), int(sys.argv[3]))
    print("; ".join(made))
