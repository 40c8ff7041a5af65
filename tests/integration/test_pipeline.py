"""The whole flow through a real temporary Prefect API and a real sqlite MLflow store."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import (
    SMALL,
    by_stage,
    new_experiment,
    perturbed_model,
    small_config,
    tracking_uri,
)

pytestmark = pytest.mark.slow

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A fresh sqlite MLflow store and a Prefect test API for this module."""
    from prefect.testing.utilities import prefect_test_harness

    tmp = tmp_path_factory.mktemp("pipeline")
    with tracking_uri(f"sqlite:///{tmp / 'mlflow.db'}") as uri:
        with prefect_test_harness(server_startup_timeout=120):
            yield tmp, uri


def _overrides(tmp: Path, *extra: str) -> list[str]:
    return [
        *SMALL,
        f"output_dir={tmp / 'runs'}",
        "grpo.eval_every=1",
        "grpo.steps=3",
        "grpo.log_completions_every=1",
        "grpo.checkpoint_every=1",
        "tracking.registered_model=tiny-e2e",
        *extra,
    ]


def _runs_left_by_a_killed_pipeline(uri: str) -> list[str]:
    """What a pipeline killed outright (SIGKILL) leaves in the store: its parent and a stage
    run RUNNING, owned by a process that is gone; beside them a parent whose owner (this test
    process) is alive, as a second pipeline running at the same time would be."""
    from mlflow import MlflowClient

    from tasks.tracking import owner_tags

    c = MlflowClient(uri, uri)
    exp = c.get_experiment_by_name("grpo-tiny")
    exp_id = exp.experiment_id if exp else new_experiment(c, uri, "grpo-tiny")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = {**owner_tags(), "pipeline.pid": str(dead.pid)}
    parent = c.create_run(exp_id, run_name="killed-parent", tags=gone)
    stage = c.create_run(exp_id, run_name="grpo", tags={"mlflow.parentRunId": parent.info.run_id})
    alive = c.create_run(exp_id, run_name="alive-parent", tags=owner_tags())
    return [parent.info.run_id, stage.info.run_id, alive.info.run_id]


def test_end_to_end_logs_registers_and_loads(store):
    from mlflow import MlflowClient

    from flows.pipeline import PipelineParams, grpo_pipeline

    tmp, uri = store
    orphans = _runs_left_by_a_killed_pipeline(uri)
    result = grpo_pipeline(PipelineParams(config=CONFIG, overrides=_overrides(tmp)))
    # the summary table stays whole when stdout is not a terminal (a log file, Prefect)
    import contextlib
    import io

    from flows.pipeline import _print_summary

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        _print_summary(result)
    assert "sft_continued - ref" in buf.getvalue() and "synthetic_ood" in buf.getvalue()
    assert "grpo - sft_continued" in buf.getvalue()  # GRPO against its equal-time control
    # the address to open lands in the runs view (a fresh browser opens MLflow's GenAI view)
    assert f"#/experiments/{result['experiment_id']}/runs?workflowType=machine_learning" in (
        buf.getvalue()
    )
    c = MlflowClient(uri, uri)
    parent = c.get_run(result["parent_run_id"])
    # the printed table holds the logged numbers: each set's line, each model's accuracy
    lines = {ln.split()[1]: ln for ln in buf.getvalue().splitlines() if ln.startswith("│ synth")}
    for s in ("synthetic", "synthetic_ood"):
        for label in ("reference", "grpo", "sft_continued"):
            acc = parent.data.metrics[f"{label}/eval/{s}/accuracy"]
            assert f"{acc:.3f}" in lines[s], (s, label)
    assert parent.info.status == "FINISHED"
    # the experiment opens in MLflow's runs list, not its GenAI view
    exp_tags = c.get_experiment(parent.info.experiment_id).tags
    assert exp_tags["mlflow.experimentKind"] == "custom_model_development"
    # what a SIGKILLed pipeline left RUNNING was ended by this one; a live owner's run was not
    assert [c.get_run(r).info.status for r in orphans] == ["KILLED", "KILLED", "RUNNING"]
    c.delete_run(orphans[2])  # the other tests of the store see pipelines' runs only
    c.delete_run(orphans[0])
    assert parent.data.params["grpo.num_generations"] == "4"
    assert parent.data.tags["mlflow.source.git.commit"] and parent.data.tags["data_hash"]
    assert parent.data.tags["pipeline_version"] == "0.1.0"  # from the package metadata
    # the machine behind the numbers, on the parent and on each stage run
    import torch

    assert parent.data.tags["host.cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert parent.data.tags["host.cpu_count"] == str(os.cpu_count())
    assert parent.data.tags["host.cpu"]
    children = c.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    by_name = by_stage(children)
    assert {"validate", "sft", "grpo", "sft_continued", "evaluate"} <= set(by_name)
    assert all(r.data.tags["host.cpu"] == parent.data.tags["host.cpu"] for r in children)
    grpo_run = by_name["grpo"].info.run_id
    # on the CPU the control trains beside GRPO, each on half the cores, until GRPO is done
    ctl = by_name["sft_continued"].data
    assert (ctl.tags["control_mode"], ctl.tags["control_budget"]) == ("concurrent", "wall_time")
    assert (
        ctl.tags["threads"]
        == by_name["grpo"].data.tags["threads"]
        == str(max(1, (os.cpu_count() or 2) // 2))
    )
    assert ctl.metrics["sft_continued/steps"] >= 1
    assert by_name["grpo"].data.tags["generation_engine"] == "fast"  # a Qwen2: the fast sampler
    reward = c.get_metric_history(grpo_run, "reward")
    assert [m.step for m in reward] == [1, 2, 3]
    assert len(c.get_metric_history(grpo_run, "eval/inrun_subset_accuracy")) == 4  # steps 0..3
    assert by_name["grpo"].data.tags["eval.inrun_subset_size"] == "24"  # data.num_heldout
    # the evaluated checkpoints are models of the run, each at its step with its in-run
    # accuracy linked to it (the Models tab); kept as checkpoints are (2), the last is the run's
    # own model, logged once
    import json as _json

    import mlflow

    rows = {
        r["step"]: r
        for r in map(
            _json.loads,
            (tmp / "runs")
            .glob(f"**/{parent.info.run_id}/grpo/metrics.jsonl")
            .__next__()
            .read_text()
            .splitlines(),
        )
    }
    step_of = {o.model_id: o.step for o in c.get_run(grpo_run).outputs.model_outputs}
    models = mlflow.search_logged_models(
        experiment_ids=[parent.info.experiment_id], output_format="list",
        filter_string=f"source_run_id = '{grpo_run}'")  # fmt: skip
    models.sort(key=lambda m: step_of[m.model_id])
    assert [(m.name, step_of[m.model_id]) for m in models] == [
        ("checkpoint-1", 1), ("checkpoint-2", 2), ("model", 3)]  # fmt: skip
    for m in models:
        step = step_of[m.model_id]
        (linked,) = [x for x in m.metrics if x.key == "checkpoint/inrun_subset_accuracy"]
        assert linked.value == rows[step]["eval/inrun_subset_accuracy"] and linked.step == step
        assert linked.dataset_name == "synthetic[:24]"
    snaps = sorted(p.name for p in (tmp / "runs").glob(f"**/{parent.info.run_id}/grpo/snapshots/*"))
    assert snaps == ["step-000001", "step-000002"]
    # the machine's load in every stage run, however short (system metrics, per host)
    import socket

    for stage, run in by_name.items():
        sysm = {k for k in run.data.metrics if k.startswith(f"system/{socket.gethostname()}/")}
        assert {"cpu_utilization_percentage", "system_memory_usage_megabytes"} <= {
            k.rsplit("/", 1)[-1] for k in sysm
        }, (stage, sorted(run.data.metrics))
    # stage runs compare on their own: named for their pipeline, with their config sections
    for stage, run in by_name.items():
        assert run.info.run_name == f"{parent.info.run_name}/{stage}"
    gp = by_name["grpo"].data.params
    assert gp["grpo.num_generations"] == "4" and gp["model.tiny.hidden_size"] == "32"
    assert "eval.samples" not in gp and "eval.samples" in by_name["evaluate"].data.params
    # two parents compare on one page: the reward curve mirrored, steps and seconds beside it
    assert [(m.step, m.value) for m in c.get_metric_history(parent.info.run_id, "grpo/reward")] == [
        (m.step, m.value) for m in reward
    ]
    assert parent.data.metrics["grpo/steps"] == 3 and parent.data.metrics["grpo/seconds"] > 0
    # the README's search for comparing pipelines finds parents only
    found = c.search_runs([parent.info.experiment_id], "tags.run_kind = 'pipeline'")
    assert parent.info.run_id in {r.info.run_id for r in found}
    assert not [r for r in found if "mlflow.parentRunId" in r.data.tags]
    # held-out metrics once, on the parent; the evaluate run keeps its tables and files
    assert not [k for k in by_name["evaluate"].data.metrics if "/eval/" in k]
    # the clamp share and the sampler-vs-trainer log-prob gap, every step, in MLflow
    for key in ("clamp/log_ratio_frac", "logprob_gap/mean", "logprob_gap/max"):
        assert [m.step for m in c.get_metric_history(grpo_run, key)] == [1, 2, 3], key

    def files(run_id, path=""):
        out = []
        for f in c.list_artifacts(run_id, path):
            out += files(run_id, f.path) if f.is_dir else [f.path]
        return out

    grpo_files = files(grpo_run)
    assert "plots/curves.png" in grpo_files
    assert "completions.json" in grpo_files
    # the policy is an MLflow model logged by the run (tasks/serving.py), not loose files (its
    # checkpoints are models too, above)
    assert not [f for f in grpo_files if f.startswith("policy/")]
    assert "config/deepspeed_config.json" in grpo_files
    val_files = files(by_name["validate"].info.run_id)
    assert "validation/data_docs/index.html" in val_files
    summary = c.download_artifacts(
        by_name["validate"].info.run_id, "validation/summary.md", str(tmp)
    )
    assert "| train | 64 |" in Path(summary).read_text()  # data.num_train, every check met
    assert "FAILED" not in Path(summary).read_text()
    assert by_name["validate"].inputs.dataset_inputs  # datasets with digests
    # the runs list's Dataset column: the parent holds them too, with their sources
    sources = {d.dataset.name: d.dataset.source for d in parent.inputs.dataset_inputs}
    assert {"train", "sft", "heldout_synthetic"} <= set(sources)
    assert "grpo.data.synthetic" in sources["train"]
    eval_files = files(by_name["evaluate"].info.run_id)
    assert "comparison.json" in eval_files and "grpo/eval/report.json" in eval_files
    assert "grpo/eval/synthetic/accuracy" in parent.data.metrics
    pm = parent.data.metrics  # the paired difference is the difference of the accuracies
    assert pm["grpo/eval/synthetic/diff_vs_sft_continued"] == pytest.approx(
        pm["grpo/eval/synthetic/accuracy"] - pm["sft_continued/eval/synthetic/accuracy"]
    )

    mv = c.get_model_version_by_alias("tiny-e2e", "challenger")
    assert mv.run_id == grpo_run
    # the decision where users look: the parent run (tags, description) and the flow run
    decided = "promoted" if result["registered"]["champion"] else "not promoted"
    assert parent.data.tags["promotion.version"] == str(mv.version)
    assert parent.data.tags["promotion.decision"] == decided == mv.tags["gate/decision"]
    assert mv.tags["checkpoint/step"] == "3" and "last step" in mv.tags["checkpoint/selection"]
    assert mv.source == f"models:/{models[-1].model_id}"  # the last step's, not a checkpoint
    assert mv.tags["logged_model_id"] == models[-1].model_id  # kept where the store has no field
    # and the Models tab shows it registered: the logged model names its version
    assert json.loads(models[-1].tags["mlflow.modelVersions"]) == [
        {"name": "tiny-e2e", "version": int(mv.version)}
    ]
    assert parent.data.tags["promotion.reason"] == result["registered"]["reason"]
    note = parent.data.tags["mlflow.note.content"]
    assert note.startswith(f"**tiny-e2e version {mv.version}: {decided}**")
    assert mv.description.startswith(note) and "- against its own SFT reference: " in note
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as pc:
        arts = pc.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["promotion"]))
        )
    assert note in [a.data for a in arts]
    assert (
        "eval/synthetic/accuracy" in mv.tags
        and mv.tags["promotion"] == result["registered"]["reason"]
    )
    assert "GRPO policy of run" in mv.description and "| synthetic |" in mv.description
    # a first version: @champion is set iff the paired lower bound over its reference (the
    # evidence on the version, whose difference is the parent's metric) is above 0
    evidence = {k: float(mv.tags[f"gate/vs_reference/{k}"]) for k in ("diff", "ci_low")}
    assert evidence["diff"] == pytest.approx(pm["grpo/eval/synthetic/diff_vs_reference"], abs=5e-5)
    assert all(len(mv.tags[k].split(".")[-1]) <= 4 for k in mv.tags if k.startswith("gate/vs_"))
    is_champion = c.get_registered_model("tiny-e2e").aliases.get("champion") == mv.version
    assert is_champion == (evidence["ci_low"] > 0) == result["registered"]["champion"]

    # models:/NAME@champion loads and generates
    from grpo.config import load_config
    from grpo.models.loading import load_model, load_tokenizer
    from tasks.registry import download_model

    cfg = load_config(CONFIG, _overrides(tmp))
    path = download_model("models:/tiny-e2e@challenger", cfg, str(tmp / "dl"))
    tok, model = load_tokenizer(path), load_model(path, trainable=False)
    ids = tok(["12+3="], return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > ids["input_ids"].shape[1]
    # what the registry serves is the GRPO stage's final policy, weight for weight
    from safetensors.torch import load_file

    (trained,) = (tmp / "runs").rglob("grpo/policy/model.safetensors")
    served, own = load_file(Path(path) / "model.safetensors"), load_file(trained)
    assert served.keys() == own.keys() and all(served[k].equal(own[k]) for k in own)


def _the_terminal_view_of_the_registry(c, champion: str, gated: str, refused: str) -> None:
    """`grpo models`: where the aliases point, each version's gate decision and how the
    champion got there, newest first; in 80 columns with run ids whole."""
    import io

    from rich.console import Console

    from tasks.registry_view import print_listing, registry_listing

    listing = registry_listing(c, "gate-test", "eval/synthetic/accuracy", limit=4)
    (m,) = listing["models"]
    assert m["aliases"]["champion"] == champion and m["versions"] == 6
    rows = {r["version"]: r for r in m["shown"]}
    assert [r["version"] for r in m["shown"]] == [str(v) for v in range(6, 2, -1)]
    assert rows[str(gated)]["gate"] == "promoted" and rows[str(gated)]["promoted"] == "the gate"
    assert rows[str(refused)]["gate"] == "not promoted" and rows[str(refused)]["promoted"] == "-"
    assert rows[str(gated)]["value"] == "0.5"
    whole = registry_listing(c, "gate-test", "eval/synthetic/accuracy", limit=10)["models"][0]
    mine = {r["version"]: r for r in whole["shown"]}[str(champion)]
    assert "@champion" in mine["aliases"] and "grpo promote" in mine["promoted"]
    out = io.StringIO()
    print_listing(listing, Console(file=out, width=80, color_system=None))
    lines = out.getvalue().splitlines()
    assert max(map(len, lines)) <= 80
    assert any(rows[str(gated)]["run_id"] in x for x in lines)


def test_the_gate_on_real_registry_state(store):
    """Paired evidence decides: worse or within noise of the champion is not promoted, clearly
    better is; a champion that could not be evaluated (NaN) blocks; a first version that does
    not beat its own reference does not become champion."""
    import math

    from mlflow import MlflowClient

    from grpo.config import load_config
    from tasks.registry import promote, register

    tmp, uri = store
    cfg = load_config(CONFIG, _overrides(tmp, "tracking.registered_model=gate-test"))
    c = MlflowClient(uri, uri)
    exp = new_experiment(c, uri, "gate")
    runs = [c.create_run(exp).info.run_id for _ in range(6)]

    def reg(i, vs_ref, vs_champ):
        champ = c.get_registered_model("gate-test").aliases.get("champion") if i else None
        return register(
            cfg, runs[i], f"runs:/{runs[i]}/policy", {"eval/synthetic/accuracy": 0.5},
            vs_reference=vs_ref, vs_champion=vs_champ, champion_version=champ,
            description="test",
        )  # fmt: skip

    good_ref = {"diff": 0.15, "ci_low": 0.12, "ci_high": 0.18, "n": 1000.0}
    flat_ref = {"diff": 0.01, "ci_low": -0.02, "ci_high": 0.04, "n": 1000.0}
    first_flat = reg(0, flat_ref, None)
    assert (
        not first_flat["champion"] and "not better than its own reference" in first_flat["reason"]
    )
    first = reg(1, good_ref, None)
    assert first["champion"]
    worse = reg(2, good_ref, {"diff": -0.05, "ci_low": -0.08, "ci_high": -0.02, "n": 1000.0})
    noise = reg(3, good_ref, {"diff": 0.01, "ci_low": -0.01, "ci_high": 0.03, "n": 1000.0})
    nan = reg(4, good_ref, {"diff": math.nan, "ci_low": math.nan, "ci_high": math.nan, "n": 0.0})
    for r, why in ((worse, "worse than champion"), (noise, "within noise"), (nan, "NaN")):
        assert not r["champion"] and why in r["reason"], r
        assert c.get_model_version_by_alias("gate-test", "champion").version == first["version"]
    v = c.get_model_version("gate-test", worse["version"])
    assert v.tags["gate/decision"] == "not promoted" and v.tags["gate/vs_champion/diff"]
    # the description leads with the decision and both comparisons, each with its interval
    # and its bar, even when (as here) the reference check passed and the champion's decided
    m = cfg.tracking.promotion_margin
    assert v.description.startswith(f"**gate-test version {worse['version']}: not promoted** "
                                     "(@challenger). eval/synthetic/accuracy: within noise of "
                                     f"or worse than champion v{first['version']}")  # fmt: skip
    assert (
        "- against its own SFT reference: +0.150 [+0.120, +0.180] (lower bound must be > 0: "
        "met)" in v.description
    )
    assert (
        f"- against champion v{first['version']}: -0.050 [-0.080, -0.020] (lower bound must "
        f"be > {m:g}: not met)" in v.description
    )
    assert v.description.endswith("not met)\n\ntest")  # then the rest of the description
    first_text = c.get_model_version("gate-test", first_flat["version"]).description
    assert "(lower bound must be > 0: not met)" in first_text and "there was none" in first_text
    assert c.get_model_version_by_alias("gate-test", "challenger").version == nan["version"]
    better = reg(5, good_ref, {"diff": 0.06, "ci_low": 0.03, "ci_high": 0.09, "n": 1000.0})
    assert better["champion"]
    promote(cfg, first["version"], reason="rollback drill")  # manual rollback, recorded
    assert c.get_model_version_by_alias("gate-test", "champion").version == first["version"]
    assert (
        "rollback drill"
        in c.get_model_version("gate-test", first["version"]).tags["manual/champion"]
    )
    _the_terminal_view_of_the_registry(c, first["version"], better["version"], worse["version"])
    # evidence against a champion that another pipeline replaced meanwhile promotes nothing
    runs.append(c.create_run(exp).info.run_id)
    stale = register(
        cfg, runs[6], f"runs:/{runs[6]}/policy", {"eval/synthetic/accuracy": 0.9},
        vs_reference=good_ref, vs_champion={"diff": 0.3, "ci_low": 0.2, "ci_high": 0.4, "n": 1e3},
        champion_version=better["version"],
    )  # fmt: skip
    assert (
        not stale["champion"]
        and f"moved from v{better['version']} to v{first['version']}" in (stale["reason"])
    )
    assert c.get_model_version_by_alias("gate-test", "champion").version == first["version"]
    _two_promotions_at_once_leave_one_winner(cfg, c, exp, good_ref, first["version"])


def _two_promotions_at_once_leave_one_winner(cfg, c, exp, good_ref, champ) -> None:  # noqa: ANN001
    """Two pipelines finishing together, both with evidence against the same champion: the
    check of @champion is widened to half a second, so that without compare-and-set both would
    pass it before either moved the alias. Exactly one is promoted; the other is told the
    champion moved. The lock on a server (a Prefect concurrency limit of one, on this module's
    Prefect API) excludes a second holder the same way."""
    import threading
    import time

    from tasks import registry
    from tasks.alias_lock import AliasLockError, _prefect_lock, lock_name

    real = registry._champion_unchanged

    def slow_check(*args):  # noqa: ANN002, ANN202
        out = real(*args)
        time.sleep(0.5)
        return out

    registry._champion_unchanged = slow_check
    results: list[dict] = []
    try:
        ids = [c.create_run(exp).info.run_id for _ in range(2)]
        threads = [threading.Thread(target=lambda r=r: results.append(registry.register(
            cfg, r, f"runs:/{r}/policy", {"eval/synthetic/accuracy": 0.95},
            vs_reference=good_ref, vs_champion={"diff": 0.3, "ci_low": 0.2, "ci_high": 0.4,
                                                "n": 1e3}, champion_version=champ)))
            for r in ids]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        registry._champion_unchanged = real
    assert sorted(r["champion"] for r in results) == [False, True], results
    (won,) = [r for r in results if r["champion"]]
    (lost,) = [r for r in results if not r["champion"]]
    assert f"moved from v{champ} to v{won['version']}" in lost["reason"]
    assert c.get_model_version_by_alias("gate-test", "champion").version == won["version"]

    name, held = lock_name("gate-test", "champion"), threading.Event()
    release = threading.Event()

    def holder() -> None:
        with _prefect_lock(name, "http://tracking", wait_s=30):
            held.set()
            release.wait(30)

    t = threading.Thread(target=holder)
    t.start()
    assert held.wait(60)
    with pytest.raises(AliasLockError, match="another alias move held grpo-alias-gate-test"):
        with _prefect_lock(name, "http://tracking", wait_s=2):
            pass
    release.set()
    t.join()
    with _prefect_lock(name, "http://tracking", wait_s=30):
        pass  # free again


def _paused_flow_run(thread, seconds: float = 600):  # noqa: ANN001, ANN202
    """The one PAUSED flow run of this module's Prefect API, while `thread` runs its flow."""
    import time

    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    paused = FlowRunFilter(
        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.PAUSED]))
    )
    deadline = time.time() + seconds
    with get_client(sync_client=True) as pc:
        while not (runs := pc.read_flow_runs(flow_run_filter=paused)):
            assert thread.is_alive(), "the flow ended without pausing"
            assert time.time() < deadline, f"no paused flow run within {seconds:.0f}s"
            time.sleep(0.5)
    (run,) = runs
    return run


def _in_thread(fn):  # noqa: ANN001, ANN202
    """fn() in a thread; the returned dict gets its result or its exception."""
    import threading

    out: dict = {}

    def target() -> None:
        try:
            out["result"] = fn()
        except BaseException as e:  # noqa: BLE001 (handed to the test thread)
            out["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, out


def test_approval_rejects_and_times_out_without_moving_the_champion(store):
    """tracking.promotion=approve on real registry state: the flow pauses with the gate's
    evidence in its form, a malformed answer is refused by the server, a rejection is recorded
    on the version with who and why, and so is a timeout; @champion stays where it was."""
    from mlflow import MlflowClient
    from prefect import flow, get_client
    from prefect.flow_runs import resume_flow_run

    from flows.pipeline import _await_approval
    from grpo.config import load_config
    from tasks.approval import ApprovalError, check_reachable
    from tasks.registry import register

    tmp, uri = store
    name = "approval-test"
    cfg = load_config(CONFIG, _overrides(tmp, f"tracking.registered_model={name}",
                                         "tracking.promotion=approve"))  # fmt: skip
    c = MlflowClient(uri, uri)
    exp = new_experiment(c, uri, "approval")
    good = {"diff": 0.15, "ci_low": 0.12, "ci_high": 0.18, "n": 1000.0}

    @flow(name="approval-under-test")
    def decide(run_id: str, champion: str | None, timeout: int) -> dict:
        waits = cfg.model_copy(update={"tracking": cfg.tracking.model_copy(
            update={"approval_timeout_s": timeout})})  # fmt: skip
        reg = register(
            waits, run_id, f"runs:/{run_id}/policy", {"eval/synthetic/accuracy": 0.7},
            vs_reference=good, vs_champion=good if champion else None,
            champion_version=champion, description="hand-made evidence",
        )  # fmt: skip
        assert not reg["champion"] and reg["gate_passed"] and reg["awaiting_approval"]
        return _await_approval(waits, reg, "| set | accuracy |\n|---|---|\n| synthetic | 0.7 |")

    from tasks.registry import promote

    # version 1 becomes champion by hand; version 2 is put to a person, who rejects it
    first = c.create_run(exp).info.run_id
    t, out = _in_thread(lambda: decide(first, None, 600))
    run = _paused_flow_run(t)
    resume_flow_run(run.id, run_input={"promote": False, "by": "t", "reason": "x"})
    t.join(120)
    promote(cfg, "1", reason="set up")
    second = c.create_run(exp).info.run_id
    t, out = _in_thread(lambda: decide(second, "1", 600))
    run = _paused_flow_run(t)
    with get_client(sync_client=True) as pc:
        form = pc.read_flow_run_input(run.id, "paused-1-description")
        schema = pc.read_flow_run_input(run.id, "paused-1-schema")
    assert "version 2: awaiting approval" in form and "The gate advises for promotion" in form
    assert "| synthetic | 0.7 |" in form and "against champion v1" in form
    assert {"promote", "by", "reason"} <= set(json.loads(schema)["properties"])
    assert c.get_model_version(name, "2").tags["approval/decision"] == "awaiting"
    with pytest.raises(RuntimeError, match="by"):  # the server checks the answer's form
        resume_flow_run(run.id, run_input={"promote": True, "by": "", "reason": "x"})
    resume_flow_run(run.id, run_input={"promote": False, "by": "Ana",
                                       "reason": "the eval set changed today"})  # fmt: skip
    t.join(120)
    assert out["result"]["champion"] is False, out
    tags = c.get_model_version(name, "2").tags
    assert (tags["approval/decision"], tags["approval/by"], tags["approval/reason"]) == (
        "rejected", "Ana", "the eval set changed today")  # fmt: skip
    assert tags["gate/decision"] == "recommended" and tags["approval/at"]
    assert c.get_model_version(name, "2").description.startswith(
        f"**{name} version 2: not promoted** (@challenger). rejected by Ana: the eval set "
        "changed today"
    )
    assert str(c.get_model_version_by_alias(name, "champion").version) == "1"

    # nobody answers: a rejection, and the flow run still completes (Prefect would fail it)
    third = c.create_run(exp).info.run_id
    t, out = _in_thread(lambda: decide(third, "1", 3))
    t.join(120)
    assert out["result"]["champion"] is False, out
    tags = c.get_model_version(name, "3").tags
    assert tags["approval/decision"] == "rejected" and tags["approval/by"] == "nobody"
    assert "no decision within 3 s" in tags["approval/reason"]
    assert str(c.get_model_version_by_alias(name, "champion").version) == "1"
    with get_client(sync_client=True) as pc:
        (last,) = pc.read_flow_runs(sort="START_TIME_DESC", limit=1)
    assert last.state.is_completed(), last.state

    # without a server a person could open, approval is refused before anything runs
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        with pytest.raises(ApprovalError, match="PREFECT_API_URL"):
            check_reachable(cfg)


def test_a_second_pipeline_meets_the_first_ones_champion(store):
    """The nightly deployment's second night: a whole pipeline while a @champion exists. The
    champion is downloaded and evaluated on the same problems in the same run, its paired
    difference is logged and recorded on the version, and @champion follows the gate. The
    first night's method is RFT alone (method: rft), registered through the same gate; the
    second night trains GRPO with both controls, RFT for the same sampled completions."""
    from mlflow import MlflowClient
    from prefect.flow_runs import resume_flow_run

    from flows.pipeline import PipelineParams, grpo_pipeline
    from grpo.config import load_config

    tmp, uri = store
    name = "meets-champion"
    over = _overrides(tmp, f"tracking.registered_model={name}", "grpo.steps=1")
    # the first night's version is promoted by a person (tracking.promotion=approve): the
    # pipeline pauses after its evidence, and the answer given through the API lands on it
    first_over = [*over, "tracking.promotion=approve", "method=rft", "rft.rounds=2"]
    t, out = _in_thread(
        lambda: grpo_pipeline(PipelineParams(config=CONFIG, overrides=first_over, control=False))
    )
    paused = _paused_flow_run(t)
    resume_flow_run(
        paused.id,
        run_input={"promote": True, "by": "Ana", "reason": "first night, read the samples"},
    )
    t.join(300)
    first = out["result"]
    v1 = str(first["registered"]["version"])
    c = MlflowClient(uri, uri)
    assert first["registered"]["champion"]
    assert str(c.get_model_version_by_alias(name, "champion").version) == v1
    tags = c.get_model_version(name, v1).tags
    assert (tags["approval/decision"], tags["approval/by"]) == ("approved", "Ana")
    assert tags["gate/decision"] in ("recommended", "not recommended")
    parent = c.get_run(first["parent_run_id"]).data.tags
    assert parent["promotion.decision"] == "promoted" and "approved by Ana" in (
        parent["promotion.reason"])  # fmt: skip
    # RFT as the method: its own stage run, no GRPO, 1 step x 2 prompts x 4 completions
    # sampled (GRPO's configured budget), its version gated against the reference
    exp_id = c.get_run(first["parent_run_id"]).info.experiment_id
    first_kids = by_stage(c.search_runs(
        [exp_id], f"tags.mlflow.parentRunId = '{first['parent_run_id']}'"))  # fmt: skip
    assert "rft" in first_kids and "grpo" not in first_kids
    rft_run = first_kids["rft"].data
    assert rft_run.metrics["rft/total_sampled"] == rft_run.metrics["rft/budget"] == 8
    assert rft_run.metrics["rft/rounds"] == 2 and "8 sampled completions" in (
        rft_run.tags["compute_match"])  # fmt: skip
    mv1 = c.get_model_version(name, v1)
    assert "RFT policy of run" in mv1.description and mv1.run_id == first_kids["rft"].info.run_id
    first_pm = c.get_run(first["parent_run_id"]).data.metrics
    assert float(mv1.tags["gate/vs_reference/diff"]) == pytest.approx(
        first_pm["rft/eval/synthetic/diff_vs_reference"], abs=5e-5)  # fmt: skip
    # the second night with a control of a fixed step budget (sft.control_steps): after GRPO,
    # exactly its steps, tagged so that nobody reads it as an equal-time control
    second = grpo_pipeline(PipelineParams(
        config=CONFIG, overrides=[*over, "grpo.steps=2", "sft.control_steps=3",
                                  "rft.enabled=true"]))  # fmt: skip
    v2 = str(second["registered"]["version"])
    assert v2 != v1
    kids = by_stage(
        c.search_runs(
            [c.get_run(second["parent_run_id"]).info.experiment_id],
            f"tags.mlflow.parentRunId = '{second['parent_run_id']}'",
        )
    )
    ctl = kids["sft_continued"]
    assert (ctl.data.tags["control_budget"], ctl.data.tags["control_mode"]) == (
        "steps",
        "sequential",
    )
    assert ctl.data.metrics["sft_continued/steps"] == 3
    assert ctl.info.start_time >= kids["grpo"].info.end_time
    # RFT beside GRPO: as many completions sampled as GRPO's 2 steps did (2 prompts x 4)
    assert kids["rft"].data.metrics["rft/total_sampled"] == 16
    pm = c.get_run(second["parent_run_id"]).data.metrics
    for s in ("synthetic", "synthetic_ood"):  # every set, on the same problems
        assert pm[f"grpo/eval/{s}/diff_vs_champion"] == pytest.approx(
            pm[f"grpo/eval/{s}/accuracy"] - pm[f"champion/eval/{s}/accuracy"]
        )
    # GRPO against RFT on the same problems, and RFT against the reference
    for s in ("synthetic", "synthetic_ood"):
        assert pm[f"grpo/eval/{s}/diff_vs_rft"] == pytest.approx(
            pm[f"grpo/eval/{s}/accuracy"] - pm[f"rft/eval/{s}/accuracy"])  # fmt: skip
        assert f"rft/eval/{s}/diff_vs_reference" in pm
    # the champion evaluated here is version 1's model: same accuracy as its own run gave it
    assert pm["champion/eval/synthetic/accuracy"] == first_pm["rft/eval/synthetic/accuracy"]
    mv = c.get_model_version(name, v2)
    assert float(mv.tags["gate/vs_champion/diff"]) == pytest.approx(
        pm["grpo/eval/synthetic/diff_vs_champion"], abs=5e-5
    )
    assert f"against champion v{v1}" in mv.description
    # @champion follows the gate: both lower bounds over their bars, or it stays at version 1
    lows = float(mv.tags["gate/vs_champion/ci_low"]), float(mv.tags["gate/vs_reference/ci_low"])
    margin = load_config(CONFIG, over).tracking.promotion_margin
    promoted = lows[0] > margin and lows[1] > 0
    assert second["registered"]["champion"] == promoted
    aliases = {k: str(v) for k, v in c.get_registered_model(name).aliases.items()}
    assert aliases == {"champion": v2 if promoted else v1, "challenger": v2}
    _compare_the_two_nights(c, tmp, name, first, second)


def _compare_the_two_nights(c, tmp: Path, name: str, first: dict, second: dict) -> None:  # noqa: ANN001
    """`grpo compare` on the two pipelines above, from the store alone: what differs, their
    numbers side by side, a paired difference checked by hand from the runs' own files."""
    import contextlib
    import io
    import signal

    from cli.main import main as cli_main
    from tasks.compare import compare_runs, to_markdown

    def main(argv: list[str]) -> None:
        # the CLI takes SIGINT and SIGTERM for its run; the test process keeps its own
        saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            cli_main(argv)
        finally:
            for s, h in saved.items():
                signal.signal(s, h)

    a_id, b_id = first["parent_run_id"], second["parent_run_id"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main(["compare", a_id, b_id, "--format", "json"])
    got = json.loads(buf.getvalue())
    assert (got["A"]["run_id"], got["B"]["run_id"]) == (a_id, b_id)
    params = {r["key"]: (r["A"], r["B"]) for r in got["params"]}
    assert params["grpo.steps"] == ("1", "2") and params["tracking.promotion"][0] == "approve"
    assert params["sft.control_steps"][1] == "3" and "grpo.lr" not in params
    assert params["method"] == ("rft", "grpo")
    # each run's logged accuracy, side by side: RFT ran on both nights, GRPO on the second
    rows = {(r["model"], r["set"], r["metric"]): r for r in got["metrics"]}
    pa, pb = c.get_run(a_id).data.metrics, c.get_run(b_id).data.metrics
    acc = rows[("rft", "synthetic", "accuracy")]
    assert (acc["A"], acc["B"]) == (pa["rft/eval/synthetic/accuracy"],
                                    pb["rft/eval/synthetic/accuracy"])  # fmt: skip
    assert rows[("grpo", "synthetic", "accuracy")]["A"] is None  # the first night had none
    assert rows[("champion", "synthetic", "accuracy")]["A"] is None

    # the paired difference by hand, from the run directories' per-problem records
    def first_samples(pid: str) -> dict:  # noqa: ANN202
        path = tmp / "runs" / "tiny" / pid / "eval" / "rft" / "samples.jsonl"
        recs = [json.loads(x) for x in path.open()]
        return {r["id"]: r["correct"] for r in recs if r["set"] == "synthetic" and not r["sample"]}

    ca, cb = first_samples(a_id), first_samples(b_id)
    assert set(ca) == set(cb) and len(ca) > 10
    by_hand = sum(cb[i] - ca[i] for i in ca) / len(ca)
    paired = {(r["model"], r["set"]): r for r in got["paired"]}
    assert paired[("rft", "synthetic")]["diff"] == pytest.approx(by_hand)
    assert paired[("rft", "synthetic")]["n"] == len(ca)
    # the interval by hand: mean -+ 1.96 x the standard error of the per-problem differences
    d = [cb[i] - ca[i] for i in ca]
    se = math.sqrt(sum((x - by_hand) ** 2 for x in d) / (len(d) - 1) / len(d))
    assert paired[("rft", "synthetic")]["ci_low"] == pytest.approx(by_hand - 1.959964 * se)
    assert paired[("rft", "synthetic")]["ci_high"] == pytest.approx(by_hand + 1.959964 * se)
    assert {"model": "champion", "set": "*", "why": "not evaluated in A"} in got["unpaired"]
    assert {"model": "grpo", "set": "*", "why": "not evaluated in A"} in got["unpaired"]
    costs = {r["what"]: r for r in got["costs"]}
    assert (costs["GRPO steps"]["A"], costs["GRPO steps"]["B"]) == (None, 2.0)
    assert (
        costs["RFT sampled completions"]["A"] == 8.0
        and costs["RFT sampled completions"]["B"] == 16.0
    )
    assert costs["control steps"]["A"] is None and costs["control steps"]["B"] == 3.0
    assert 0 < costs["peak RSS of its largest process (GB)"]["B"] < 64
    # registered versions name their pipelines; markdown parses as tables
    again = compare_runs(c, f"models:/{name}/{first['registered']['version']}",
                         f"models:/{name}@challenger")  # fmt: skip
    assert (again["A"]["run_id"], again["B"]["run_id"]) == (a_id, b_id)
    # a run against itself: nothing differs, every paired difference is 0
    same = compare_runs(c, b_id, b_id)
    assert same["params"] == [] and len(same["paired"]) >= 4
    assert all(r["diff"] == 0.0 == r["ci_low"] for r in same["paired"])
    md = to_markdown(again)
    table = [ln for ln in md.splitlines() if ln.startswith("| rft | synthetic | accuracy |")]
    assert len(table) == 1 and len(table[0].strip("|").split(" | ")) == 6
    # a run that is not there, or not a pipeline's, is refused in one line (exit 2)
    grpo_stage = by_stage(c.search_runs([c.get_run(b_id).info.experiment_id],
                                        f"tags.mlflow.parentRunId = '{b_id}'"))["grpo"]  # fmt: skip
    refused = {
        "0" * 32: "no such run",
        grpo_stage.info.run_id: f"not a pipeline run; its pipeline run is {b_id}",
        "no-such-name": "no pipeline run with this id or name",
    }
    for ref, says in refused.items():
        err = io.StringIO()
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
            main(["compare", a_id, ref])
        assert exit_.value.code == 2 and says in err.getvalue()
        assert err.getvalue().count("\n") == 1


def test_the_evaluate_stage_evaluates_the_same_weights_once(store, tmp_path):
    """A checkpoint selection often picks the reference (step 0) or the last step: the stage
    evaluates those weights once and reuses the evaluation, which is what evaluating again
    gives (greedy and seeded sampling on the same weights). The two evaluated models run at
    once in processes of their own (eval.workers=2), each on one thread: their completions are
    those of one evaluation in this process on all its threads."""
    import shutil

    from prefect import flow

    from grpo.eval.run import evaluate_model
    from grpo.launch.paths import base_model_dir, model_digest
    from tasks import stages, tracking

    cfg = small_config(tmp_path, "eval.limit=12", "eval.pass_k=2", "eval.pass_k_limit=5",
                       "eval.workers=2")  # fmt: skip
    model = base_model_dir(cfg)
    same = shutil.copytree(model, tmp_path / "selected")
    (same / "selection_summary.json").write_text("{}")  # beside the weights, not a model file
    # a policy saved after it padded batches: its tokenizer.json records that runtime state
    from grpo.models.loading import load_tokenizer

    tok = load_tokenizer(same)
    tok(["1+1=", "12+34="], padding=True)
    saved = json.loads((same / "tokenizer.json").read_text())
    saved["padding"] = json.loads(tok.backend_tokenizer.to_str())["padding"]
    assert saved["padding"]["direction"] == "Left"
    (same / "tokenizer.json").write_text(json.dumps(saved))
    other = perturbed_model(model, tmp_path / "other")
    assert model_digest(same) == model_digest(model) != model_digest(other)
    models = {"reference": str(model), "grpo": str(same), "sft_continued": str(other),
              "sft_continued_last": str(other)}  # fmt: skip
    c = tracking.client(cfg)
    exp, _ = tracking.experiment(c, "reuse", tracking.tracking_uri(cfg))
    pid = tracking.start_pipeline_run(c, exp, cfg, "test")
    ev = flow(lambda: stages.evaluate(cfg, pid, models, tmp_path / "run"), name="reuse")()
    reports = ev["reports"]
    # the compared models are evaluated first, the reference among them; GRPO, on its weights,
    # reuses its evaluation (pass@k included), the control's last step the control's
    assert reports["grpo"]["same_weights_as"] == "reference"
    assert reports["sft_continued_last"]["same_weights_as"] == "sft_continued"
    assert "same_weights_as" not in reports["reference"] | reports["sft_continued"]
    assert reports["grpo"]["model"] == str(same)
    assert "sampled_pass@2" in reports["grpo"]["sets"]["synthetic"]
    # greedy on all 12 problems, sampled pass@2 on the first 5 only
    sampled = tracking.read_jsonl(tmp_path / "run" / "eval" / "grpo" / "samples_sampled.jsonl")
    assert len(sampled) == 10 and len({r["id"] for r in sampled}) == 5
    assert reports["grpo"]["sets"]["synthetic"]["sampled_problems"] == 5
    assert reports["grpo"]["sets"]["synthetic"]["num_problems"] == 12
    assert ev["paired"]["grpo"]["synthetic"]["diff"] == 0.0
    # what evaluating the reference again gives: the same completions, the same numbers
    fresh = evaluate_model(cfg, str(model), cfg.eval.sets, str(tmp_path / "fresh"), limit=12,
                           progress=False, pass_k=2)  # fmt: skip
    assert fresh["sets"] == reports["grpo"]["sets"]
    # evaluated by parts (one a set, two workers), put back together as one evaluation
    assert not any((tmp_path / "run" / "eval").glob("*/parts"))
    for name in ("samples.jsonl", "samples_sampled.jsonl"):
        assert (tmp_path / "fresh" / name).read_text() == (
            tmp_path / "run" / "eval" / "grpo" / name).read_text()  # fmt: skip


def test_a_failed_evaluation_among_workers_stops_the_others_with_its_error(tmp_path):
    """eval.workers=2: one model's evaluation fails at once (no such directory); the error is
    its own, one line naming the directory, and the model beside it is not waited for."""
    import time

    from grpo.eval.run import evaluate_models
    from grpo.launch.paths import base_model_dir
    from grpo.models.loading import ModelDirError

    cfg = small_config(tmp_path, "eval.workers=2")
    missing = tmp_path / "no-such-model"
    jobs = {
        "grpo": dict(model_dir=str(base_model_dir(cfg)), sets=cfg.eval.sets,
                     out_dir=str(tmp_path / "a"), progress=False, pass_k=32),  # minutes
        "reference": dict(model_dir=str(missing), sets=cfg.eval.sets,
                          out_dir=str(tmp_path / "b"), progress=False),
    }  # fmt: skip
    t = time.monotonic()
    with pytest.raises(ModelDirError, match=f"^{missing}: model directory not found$"):
        evaluate_models(cfg, jobs, cfg.eval.workers)
    assert not (tmp_path / "a" / "report.json").exists()  # stopped, not finished
    assert time.monotonic() - t < 60


def test_failing_validation_stops_before_training(store, tmp_path):
    from mlflow import MlflowClient

    from flows.pipeline import PipelineParams, grpo_pipeline
    from tasks.validation import DataValidationError

    tmp, uri = store
    leaked = tmp_path / "leaked.jsonl"
    # a held-out set that contains a training prompt, and an answer math-verify cannot parse
    from grpo.config import load_config
    from grpo.data.sets import training_sets

    cfg = load_config(CONFIG, _overrides(tmp))
    train_prompt = training_sets(cfg)["train"][0]["prompt"]
    leaked.write_text(
        f'{{"id": "x1", "prompt": "{train_prompt}", "answer": "5"}}\n'
        '{"id": "x2", "prompt": "what?", "answer": "}}{{"}\n'
    )
    with pytest.raises(DataValidationError) as err:
        grpo_pipeline(
            PipelineParams(
                config=CONFIG,
                overrides=_overrides(
                    tmp,
                    f"eval.sets=[{leaked}]",
                    f"tracking.promotion_metric=eval/{leaked.stem}/accuracy",
                ),
            )  # fmt: skip
        )
    msg = str(err.value)
    assert "in_training_data" in msg and "x1" in msg
    assert "answer_parses" in msg and "x2" in msg
    c = MlflowClient(uri, uri)
    exps = [e.experiment_id for e in c.search_experiments()]
    # this pipeline's parent run (other tests share the store): the one evaluating `leaked`
    (parent,) = [r for r in c.search_runs(exps) if "mlflow.parentRunId" not in r.data.tags
                 and str(leaked) in r.data.params.get("eval.sets", "")]  # fmt: skip
    assert parent.info.status == "FAILED"
    kids = c.search_runs(exps, f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert set(by_stage(kids)) == {"validate"}  # nothing trained
    assert kids[0].info.status == "FAILED"


def test_sft_reference_cache_hit(tmp_path):
    import json

    from grpo.launch.runner import run_sft
    from tests.helpers import small_config

    cfg = small_config(tmp_path)
    messages = []
    out = run_sft(cfg, log=messages.append)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    again = run_sft(cfg, log=messages.append)
    assert again == out and (out / "model.safetensors").stat().st_mtime_ns == stamp
    assert any("cache hit" in m for m in messages)
    # a cut-short or changed weights file is found and rebuilt, not trusted: one line says so
    weights = out / "model.safetensors"
    good = weights.read_bytes()
    for damage, said in [(good[: len(good) // 2], "bytes"), (good[:-1] + b"\x01", "sha256")]:
        weights.write_bytes(damage)
        messages.clear()
        assert run_sft(cfg, log=messages.append) == out
        assert [m for m in messages if "damaged" in m and said in m], messages
        assert weights.read_bytes() == good  # SFT is deterministic: the same weights again
    changed = run_sft(small_config(tmp_path, "sft.lr=0.001"), log=messages.append)
    assert changed != out  # a different SFT config is a different reference
    # but how the control runs is not part of it: it starts from the same reference
    from grpo.launch.paths import reference_dir

    for how in ("sft.control=sequential", "sft.control_steps=7", "sft.control_lr=0.5"):
        assert reference_dir(small_config(tmp_path, how)) == out
    # edited training data (same config) is a different reference too
    data = tmp_path / "sft.jsonl"
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1),
             "worked_solution": f"<answer>{i + 1}</answer>"} for i in range(20)]  # fmt: skip
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    files = small_config(tmp_path, "data.task=files", f"data.train_path={data}",
                         f"data.sft_path={data}")  # fmt: skip
    before = reference_dir(files)
    data.write_text(data.read_text().replace('"1+1="', '"1 + 1 ="'))
    assert reference_dir(files) != before


def test_a_pipeline_that_looked_before_another_created_the_experiment_takes_it(store):
    """Two pipelines started at once on a new experiment both find none; the one whose create
    comes second is refused as a duplicate, and must go on in the first one's experiment."""
    from mlflow import MlflowClient

    from tasks.tracking import EXPERIMENT_KIND, experiment

    _, uri = store

    class LookedTooEarly(MlflowClient):
        """It searched for the experiment in the instant before the other pipeline made it."""

        looked = False

        def get_experiment_by_name(self, name):  # noqa: ANN001, ANN201
            if not self.looked:
                self.looked = True
                return None
            return super().get_experiment_by_name(name)

    first = MlflowClient(uri, uri)
    made, tags = experiment(first, "created-at-once", uri)
    assert tags == {}
    first.set_experiment_tag(made, *EXPERIMENT_KIND)
    late = LookedTooEarly(uri, uri)
    assert experiment(late, "created-at-once", uri) == (made, dict([EXPERIMENT_KIND]))
    assert [e.name for e in first.search_experiments()].count("created-at-once") == 1


def test_metrics_survive_an_unreachable_tracking_server(tmp_path, store):
    """Uploads fail while the server is away; nothing is lost once it is back."""
    import json

    from mlflow import MlflowClient

    from grpo.config import load_config
    from tasks.tracking import MetricsStreamer

    _, uri = store
    cfg = load_config(CONFIG, _overrides(tmp_path))
    c = MlflowClient(uri, uri)
    run_id = c.create_run(new_experiment(c, uri, "outage")).info.run_id
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "reward": s / 10}) + "\n" for s in (1, 2)))
    os.environ["MLFLOW_TRACKING_URI"] = "http://127.0.0.1:9"  # nothing listens there
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    try:
        s = MetricsStreamer(cfg, run_id, path)
        assert s.flush(raise_errors=False) == 0 and s.failures == 1
        with path.open("a") as f:  # training goes on meanwhile
            f.write(json.dumps({"step": 3, "reward": 0.3}) + "\n")
    finally:
        os.environ["MLFLOW_TRACKING_URI"] = uri
        os.environ.pop("MLFLOW_HTTP_REQUEST_MAX_RETRIES")
    assert s.drain(attempts=2, delay_s=0.1) == 3
    assert [m.step for m in c.get_metric_history(run_id, "reward")] == [1, 2, 3]


def test_the_reference_is_uploaded_once_and_linked_after(store, tmp_path):
    from mlflow import MlflowClient

    from tasks.stages import _log_reference_once

    _, uri = store
    c = MlflowClient(uri, uri)
    exp = new_experiment(c, uri, "reference-once")
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "model.safetensors").write_bytes(b"weights")
    first, second = (c.create_run(exp).info.run_id for _ in range(2))
    _log_reference_once(c, first, ref)
    _log_reference_once(c, second, ref)
    assert [f.path for f in c.list_artifacts(first, "reference")] == ["reference/model.safetensors"]
    assert c.list_artifacts(second, "reference") == []
    assert c.get_run(second).data.tags["reference_run_id"] == first


def test_a_failed_grpo_stage_stops_the_control_beside_it(store):
    """GRPO fails (its retry too) while the control trains beside it: the pipeline marks GRPO's
    progress done, the control stops at its next step, finishes its run, and the flow fails
    with GRPO's error, leaving no worker process behind."""
    import psutil
    from mlflow import MlflowClient

    from flows.pipeline import PipelineParams, grpo_pipeline
    from grpo.launch.runner import StageError

    tmp, uri = store
    overrides = _overrides(
        tmp,
        "grpo.reward_funcs=['tests.fault_rewards:raise_value_error']",
        "grpo.reward_weights=[1.0]",
    )
    with pytest.raises(StageError, match="raise_value_error"):
        grpo_pipeline(PipelineParams(config=CONFIG, overrides=overrides))
    c = MlflowClient(uri, uri)
    exp = c.get_experiment_by_name("grpo-tiny")
    parent = c.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"])
    parent = next(r for r in parent if "mlflow.parentRunId" not in r.data.tags)
    assert parent.info.status == "FAILED"
    kids = c.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    by_name = by_stage(kids)
    assert by_name["grpo"].info.status == "FAILED"
    assert by_name["sft_continued"].info.status == "FINISHED"
    assert by_name["sft_continued"].data.metrics["sft_continued/steps"] >= 1
    workers = [
        p
        for p in psutil.Process().children(recursive=True)
        if "grpo.launch.worker" in " ".join(p.cmdline())
    ]
    assert not workers


def test_a_lora_grpo_stage_logs_a_merged_model_and_its_adapter(store):
    """The GRPO stage with model.lora (its own Prefect flow, real ranks subprocess): the logged
    model is the merged policy, which MLflow loads and predicts with; the adapter is logged
    beside it; `grpo evaluate` takes the adapter directory, and refuses a wrong base by name."""
    import json

    import mlflow
    from mlflow import MlflowClient
    from prefect import flow

    from grpo.config import load_config
    from grpo.launch.paths import base_model_dir
    from tasks.serving import policy_dir_of
    from tasks.stages import train_policy

    tmp, uri = store
    lora = ["model.lora.enabled=true", "model.lora.r=4", "model.lora.alpha=8"]
    cfg = load_config(CONFIG, _overrides(tmp, "run_name=lora", "grpo.eval_every=0", *lora))
    c = MlflowClient(uri, uri)
    exp = c.get_experiment_by_name(cfg.tracking.experiment)
    exp_id = exp.experiment_id if exp else new_experiment(c, uri, cfg.tracking.experiment)
    parent = c.create_run(exp_id, run_name="lora-parent").info.run_id
    base = base_model_dir(cfg)

    @flow
    def grpo_stage_only() -> dict:
        return train_policy(cfg, parent, str(base), tmp / "runs" / "lora")

    out = grpo_stage_only()
    run = c.get_run(out["run_id"])
    trainable, total = (int(run.data.params[f"parameters.{k}"]) for k in ("trainable", "total"))
    assert 0 < trainable < total / 5
    logged = {f.path for f in c.list_artifacts(out["run_id"], "adapter")}
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors"} <= logged
    downloaded = Path(mlflow.artifacts.download_artifacts(out["model_uri"], tracking_uri=uri))
    from safetensors.torch import load_file

    merged = load_file(policy_dir_of(downloaded) / "model.safetensors")
    assert merged and not any("lora_" in k for k in merged)
    assert mlflow.pyfunc.load_model(out["model_uri"]).predict(["12+34="])[0]

    adapter = tmp / "runs" / "lora" / "grpo" / "adapter"
    sets = [a for s in _overrides(tmp, "run_name=lora") for a in ("--set", s)]
    evaluate = [sys.executable, "-m", "cli.main", "evaluate", "--model", str(adapter),
                "--sets", "synthetic", "--limit", "8", *sets]  # fmt: skip
    p = subprocess.run([*evaluate, "--out", str(tmp / "lora-eval")], capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    report = json.loads((tmp / "lora-eval" / "report.json").read_text())
    assert report["sets"]["synthetic"]["num_problems"] == 8
    p = subprocess.run([*evaluate, "--base", str(tmp / "nowhere")], capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr[-2000:]
    assert "nowhere: model directory not found" in p.stderr


def test_a_reasoning_gym_mix_through_the_pipeline(store):
    """data.task reasoning_gym on the tiny model, with RFT beside GRPO: the generated sets
    validated at the sizes asked for, logged as dataset inputs naming the library, its version,
    the generators, configs and seeds; GRPO scored by the generators' own checkers; the mix's
    held-out sets reported per generator and overall, a generator never trained on as an
    out-of-distribution set, and the mix reworded as the out-of-format set."""
    import mlflow
    from mlflow import MlflowClient

    from flows.pipeline import PipelineParams, grpo_pipeline

    pytest.importorskip("reasoning_gym", reason="the real extra (make install-real)")
    tmp, uri = store
    gens = ("[{name: chain_sum, config: {min_terms: 2, max_terms: 2, max_digits: 1}}, "
            "{name: gcd, config: {max_value: 30}}]")  # fmt: skip
    over = _overrides(
        tmp, "data.task=reasoning_gym", f"data.generators={gens}", "data.num_train=40",
        "data.num_sft=24", "data.num_sft_val=8", "data.num_heldout=10", "data.num_select=0",
        "grpo.eval_every=0", "grpo.steps=1", "grpo.max_prompt_length=160",
        "grpo.reward_funcs=[reasoning_gym_exact, format]",
        "eval.sets=[rg:mix, rg:lcm, rg:reworded:mix]",
        "tracking.promotion_metric=eval/rg_mix/accuracy", "tracking.registered_model=rg-e2e",
        "rft.enabled=true", "rft.rounds=1", "model.tiny.max_position_embeddings=512",
    )  # fmt: skip
    result = grpo_pipeline(PipelineParams(config=CONFIG, overrides=over, control=False))
    c = MlflowClient(uri, uri)
    parent = c.get_run(result["parent_run_id"])
    kids = by_stage(c.search_runs([parent.info.experiment_id],
                                  f"tags.mlflow.parentRunId = '{parent.info.run_id}'"))  # fmt: skip
    # validation: each generated set at the size asked for (GE's row-count expectation)
    results = mlflow.artifacts.load_dict(
        f"runs:/{kids['validate'].info.run_id}/validation/results.json")  # fmt: skip
    assert {k: v["rows"] for k, v in results.items()} == {
        "train": 40,
        "sft": 24,
        "sft_val": 8,
        "heldout_rg_mix": 20,
        "heldout_rg_lcm": 10,
        "heldout_rg_reworded_mix": 20,
    }
    assert all(v["success"] for v in results.values())
    # the dataset inputs name the library, its version, the generators, configs and seeds
    inputs = {d.dataset.name: json.loads(d.dataset.source)["tags"]
              for d in parent.inputs.dataset_inputs}  # fmt: skip
    train = inputs["train"]
    assert train["generator"] == "reasoning-gym" and train["version"] == "0.1.25"
    described = json.loads(train["generators"])
    assert [g["name"] for g in described] == ["chain_sum", "gcd"]
    assert described[1]["config"] == {"max_value": 30}
    assert described[0]["seeds"]["train"] != described[0]["seeds"]["heldout"]
    # GRPO's reward came from the generators' checkers
    rows = [json.loads(x) for x in (tmp / "runs" / "tiny" / parent.info.run_id / "grpo" /
                                    "metrics.jsonl").open()]  # fmt: skip
    assert "rewards/reasoning_gym_exact/mean" in rows[-1]
    # the mix per generator and overall; the never-trained generator on its own
    report = json.loads((tmp / "runs" / "tiny" / parent.info.run_id / "eval" / "grpo" /
                         "report.json").read_text())  # fmt: skip
    mix = report["sets"]["rg:mix"]
    assert set(mix["by_generator"]) == {"chain_sum", "gcd"} and mix["num_problems"] == 20
    assert mix["accuracy"] == pytest.approx(sum(mix["by_generator"].values()) / 2)
    md = (tmp / "runs" / "tiny" / parent.info.run_id / "eval" / "grpo" / "report.md").read_text()
    assert f"| rg:mix | gcd | {mix['by_generator']['gcd']:.3f} |" in md
    assert report["sets"]["rg:lcm"]["num_problems"] == 10
    # the out-of-format check: the mix's problems in other words, reported the same way
    worded = report["sets"]["rg:reworded:mix"]
    assert set(worded["by_generator"]) == {"chain_sum", "gcd"} and worded["num_problems"] == 20
    pm = parent.data.metrics
    assert "grpo/eval/rg_mix/diff_vs_rft" in pm and "rft/eval/rg_lcm/accuracy" in pm


def test_two_turn_episodes_with_a_tool_through_the_pipeline(store):
    """The tiny model learns the calculator's call from 64 demonstrations (the listing left out
    of its prompts: it would fill the character model's context), then GRPO, evaluation and
    the registry run on episodes of two turns: call, tool response, answer."""
    import mlflow
    from mlflow import MlflowClient

    from flows.pipeline import PipelineParams, grpo_pipeline

    tmp, uri = store
    over = _overrides(
        tmp, "model.tiny.hidden_size=64", "model.tiny.intermediate_size=128",
        "data.worked_solutions=calculator", "tools.functions=[calculator]",
        "tools.list_in_prompt=false", "sft.max_epochs=60", "sft.lr=1e-2", "sft.eval_every=20",
        "grpo.max_completion_length=160", "grpo.steps=2", "grpo.eval_every=0",
        "data.num_heldout=8", "data.num_heldout_ood=4", "tracking.registered_model=tools-e2e",
        "eval.untooled=true",
    )  # fmt: skip
    result = grpo_pipeline(PipelineParams(config=CONFIG, overrides=over, control=False))
    c = MlflowClient(uri, uri)
    parent = c.get_run(result["parent_run_id"])
    assert parent.info.status == "FINISHED"
    kids = by_stage(c.search_runs([parent.info.experiment_id],
                                  f"tags.mlflow.parentRunId = '{parent.info.run_id}'"))  # fmt: skip
    grpo_run = kids["grpo"].info.run_id
    # at every step, sampled episodes called the tool and went on after its response (some
    # sampled calls run past the token limit and end there)
    calls = [m.value for m in c.get_metric_history(grpo_run, "tools/calls_mean")]
    turns = [m.value for m in c.get_metric_history(grpo_run, "tools/turns_mean")]
    assert len(calls) == 2 and min(calls) > 0.5 and min(turns) > 1.0
    logged = tmp / "runs" / "tiny" / parent.info.run_id / "grpo" / "completions.jsonl"
    texts = [json.dumps(json.loads(x)) for x in logged.open()]
    # readable transcripts: the call, the tool's response, the model's answer after it
    assert any(re.search(r"<tool_call>.*\[tool\] .*\[assistant\] ", t) for t in texts)
    # evaluation answered in episodes with the tool, per set
    m = parent.data.metrics
    assert m["grpo/eval/synthetic/tool_use_rate"] > 0.5
    # and, eval.untooled, the reference and GRPO alone on the same problems: plain completions
    # (no episodes to count), paired against their tooled selves
    for label in ("reference_untooled", "grpo_untooled"):
        assert f"{label}/eval/synthetic/accuracy" in m
        assert f"{label}/eval/synthetic/tool_use_rate" not in m
    ev = tmp / "runs" / "tiny" / parent.info.run_id / "eval"
    alone = [json.loads(x) for x in (ev / "grpo_untooled" / "samples.jsonl").open()]
    tooled = [json.loads(x) for x in (ev / "grpo" / "samples.jsonl").open()]
    assert len(alone) == len(tooled) and "transcript" not in alone[0] and "transcript" in tooled[0]
    assert "grpo/eval/synthetic/diff_vs_grpo_untooled" in m
    # the registered model records its tools and how its prompts were laid out
    mv = c.get_model_version_by_alias("tools-e2e", "challenger")
    assert mv.run_id == grpo_run
    with tracking_uri(uri):
        served = mlflow.models.get_model_info(f"models:/tools-e2e/{mv.version}").flavors[
            "python_function"]["config"]  # fmt: skip
    assert served["tools"]["functions"] == ["calculator"]
    assert served["run_config"]["tools"]["list_in_prompt"] is False
