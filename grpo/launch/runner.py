"""Running a training stage (SFT reference, GRPO) in this process or as DeepSpeed ranks.

One rank runs in this process (SFT) or a child process (GRPO); deepspeed.nproc > 1 local ranks
are child processes started here, and a hostfile's ranks are started by DeepSpeed's launcher;
each rank runs `python -m grpo.launch.worker`. The CLI
and the Prefect tasks call these.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo.config import Config
from grpo.launch.environment import quiet_environment
from grpo.launch.paths import (
    ERROR_DIR,
    base_model_dir,
    file_digest,
    file_lock,
    reference_dir,
    write_config,
)
from grpo.launch.run_dir import check_free_space
from reward_fns.errors import UserError

# output lines kept for the error message of a stage that failed without an error file
TAIL_LINES = 40


class StageError(UserError, RuntimeError):
    """A stage (or one of its ranks) failed; the message names the rank's error in one line,
    `details` holds its traceback (shown with --debug)."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


def _distributed(cfg: Config) -> bool:
    return cfg.deepspeed.nproc > 1 or cfg.deepspeed.hostfile is not None


def free_port() -> int:
    """A TCP port nothing listens on now (the kernel's pick), for rank 0's rendezvous."""
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def hostfile_hosts(path: Path) -> list[str]:
    """The host names of a DeepSpeed hostfile ("host slots=N" lines; # starts a comment)."""
    lines = (ln.split("#", 1)[0].split() for ln in path.read_text().splitlines())
    return [words[0] for words in lines if words]


def _local_names() -> set[str]:
    import socket

    return {"localhost", "127.0.0.1", socket.gethostname()}


# the node's index in the hostfile, as cluster launchers set it: torchrun-style jobs
# (Kubernetes, a script per node) NODE_RANK, Slurm SLURM_NODEID; the first one set is used
NODE_RANK_VARS = ("NODE_RANK", "SLURM_NODEID")


class NodeError(UserError, ValueError):
    """A node's rank, rendezvous address or port is missing or does not fit the hostfile."""


@dataclass(frozen=True)
class Node:
    """This machine's place in a multi-node run started one node at a time."""

    rank: int  # its line in the hostfile, from 0
    hosts: tuple[str, ...]  # the hostfile's nodes, in order
    master_addr: str  # where rank 0 (on node 0) listens
    master_port: int

    def describe(self) -> str:
        return f"node {self.rank} of {len(self.hosts)} ({self.hosts[self.rank]})"


def this_node(cfg: Config, environ: Mapping[str, str] | None = None) -> Node | None:
    """With a hostfile and a node rank in the environment (NODE_RANK or SLURM_NODEID), this
    machine starts only its own ranks (DeepSpeed's launcher with --no_ssh --node_rank): the
    way Slurm and Kubernetes jobs start every node. None: no hostfile, or no node rank (then
    DeepSpeed's launcher starts every node over ssh/pdsh from this one).

    The rendezvous is MASTER_ADDR (default: the hostfile's first host) and MASTER_PORT or
    deepspeed.master_port, which every node must be given alike: a port picked here would
    differ between nodes."""
    env = os.environ if environ is None else environ
    hostfile = cfg.deepspeed.hostfile
    name = next((v for v in NODE_RANK_VARS if env.get(v, "").strip()), None)
    if hostfile is None or name is None:
        return None
    hosts = tuple(hostfile_hosts(Path(hostfile)))
    raw = env[name].strip()
    if not raw.isdigit() or int(raw) >= len(hosts):
        raise NodeError(
            f"{name}={raw}: expected a node index from 0 to {len(hosts) - 1} "
            f"({hostfile} names {len(hosts)} nodes)"
        )
    port = env.get("MASTER_PORT", "").strip()
    if cfg.deepspeed.master_port is not None:
        if port and port != str(cfg.deepspeed.master_port):
            raise NodeError(f"MASTER_PORT={port} but deepspeed.master_port is "
                            f"{cfg.deepspeed.master_port}: give every node one port")  # fmt: skip
        port = str(cfg.deepspeed.master_port)
    if not port.isdigit():
        raise NodeError(
            f"{name}={raw} starts this node's ranks only, and every node must meet rank 0 on "
            "the same port: set MASTER_PORT (or deepspeed.master_port) alike on every node"
        )
    addr = env.get("MASTER_ADDR", "").strip() or hosts[0]
    return Node(int(raw), hosts, addr, int(port))


def refuse_node_by_node(cfg: Config, environ: Mapping[str, str] | None = None) -> None:
    """A pipeline starts every node from its own (DeepSpeed's launcher over ssh/pdsh); started
    node by node it would wait for ranks that no other node knows to start, so a node rank in
    its environment is refused before anything runs."""
    node = this_node(cfg, environ)
    if node is not None:
        var = next(v for v in NODE_RANK_VARS if (environ or os.environ).get(v, "").strip())
        raise NodeError(
            f"{var} is set ({node.describe()}): a pipeline starts every node of "
            f"{cfg.deepspeed.hostfile} itself over ssh; unset {var}, or start the nodes one by "
            "one with `grpo train` (the same --out on each)"
        )


def launcher_command(
    cfg: Config, target: list[str], environ: Mapping[str, str] | None = None
) -> list[str]:
    """DeepSpeed's launcher starting the ranks of a hostfile (`target`: what follows `python`,
    e.g. ["-m", "grpo.launch.worker", "train", ...]): this node's only when the environment
    names the node (this_node), else every node's."""
    ds = cfg.deepspeed
    assert ds.hostfile is not None
    node = this_node(cfg, environ)
    port = node.master_port if node else ds.master_port or free_port()
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--master_port", str(port)]
    cmd += ["--hostfile", ds.hostfile]
    if node is not None:
        cmd += ["--no_ssh", "--node_rank", str(node.rank), "--master_addr", node.master_addr]
    elif all(h in _local_names() for h in hostfile_hosts(Path(ds.hostfile))):
        # every slot on this machine: DeepSpeed would still ssh to it (to check, and for
        # rank 0's address), which a machine without an ssh server refuses
        cmd += ["--no_ssh_check", "--master_addr", "127.0.0.1"]
    if target[0] == "-m":
        return cmd + ["--module", *target[1:]]
    return cmd + target


@dataclass(frozen=True)
class Launch:
    """One process to start: its command and the variables it gets on top of the parent's."""

    cmd: list[str]
    env: dict[str, str] = field(default_factory=dict)


def launches(
    cfg: Config, target: list[str], environ: Mapping[str, str] | None = None
) -> list[Launch]:
    """The processes that run a stage (`target`: what follows `python`): one; deepspeed.nproc
    local ranks, started here; or DeepSpeed's launcher for a hostfile.

    Local ranks get the variables DeepSpeed's launcher would give them. It is not used for them
    because it costs 9-10 s a launch on a 2-core machine (two more interpreters that import
    DeepSpeed before the ranks start, and a 1 s poll after they end) for nothing a single
    machine needs; a hostfile (other machines, ssh) still goes through it.
    """
    ds = cfg.deepspeed
    if ds.hostfile is not None:
        return [Launch(launcher_command(cfg, target, environ))]
    cmd = [sys.executable, "-u", *target]
    if ds.nproc == 1:
        return [Launch(cmd)]
    n, port = str(ds.nproc), str(ds.master_port or free_port())
    common = {"WORLD_SIZE": n, "LOCAL_WORLD_SIZE": n, "LOCAL_SIZE": n, "CROSS_RANK": "0",
              "CROSS_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}  # fmt: skip
    return [Launch(cmd, {**common, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(ds.nproc)]


# a rank's own process group settings must not leak into the ranks it starts
DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK",
             "CROSS_SIZE", "MASTER_ADDR", "MASTER_PORT")  # fmt: skip
# after a rank fails (or the parent is stopped), how long the others get to exit on SIGTERM
# before SIGKILL: a rank blocked in a collective never returns by itself
GRACE_S = 5.0


# every process run_launches started and has not seen end, from any thread: an interrupted
# command stops them (stop_started) before it unwinds
_STARTED: set[subprocess.Popen] = set()
_STARTED_LOCK = threading.Lock()


def stop_started(grace_s: float = GRACE_S) -> int:
    """Stop every process this process started through run_launches that still runs; returns
    how many there were."""
    with _STARTED_LOCK:
        procs = [p for p in _STARTED if p.poll() is None]
    stop_processes(procs, grace_s)
    return len(procs)


def stop_processes(
    procs: list[subprocess.Popen], grace_s: float = GRACE_S, *, groups: bool = False
) -> None:
    """SIGTERM to each process still running, SIGKILL to those alive `grace_s` later.

    groups: each process leads a process group of its own, and the signals go to the whole
    group; SIGKILL then goes to every group, since a group may outlive its leader."""

    def signal_(p: subprocess.Popen, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            if groups:
                os.killpg(p.pid, sig)
            else:
                p.send_signal(sig)

    for p in procs:
        if p.poll() is None:
            signal_(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            signal_(p, signal.SIGKILL)
            p.wait()
        else:
            if groups:
                signal_(p, signal.SIGKILL)


def _watch(procs: list[subprocess.Popen], codes: list[int]) -> None:
    """Wait for every process; the first to fail takes the others down (appends its code)."""
    while True:
        polled = [p.poll() for p in procs]
        failed = [c for c in polled if c not in (None, 0)]
        if failed or all(c is not None for c in polled):
            codes.append(failed[0] if failed else 0)
            if failed:
                stop_processes(procs)
            return
        time.sleep(0.1)


SHM_DIR = Path("/dev/shm")


def remove_shm_buffers(plan: list[Launch]) -> list[Path]:
    """Remove the shared-memory all-reduce buffers the ranks of `plan` left behind.

    DeepSpeed's CPU collective (deepspeed_shm_comm) creates one 69 MB buffer per rank in
    /dev/shm, named after rank 0's address and port, and never unlinks it: left alone, every
    multi-rank run on a CPU leaves 138 MB of RAM behind, and a day of runs fills memory until
    the kernel's OOM killer stops a process. Called once every rank has exited."""
    ports = {launch.env["MASTER_PORT"] for launch in plan if "MASTER_PORT" in launch.env}
    for launch in plan:
        if "--master_port" in launch.cmd:
            ports.add(launch.cmd[launch.cmd.index("--master_port") + 1])
    removed = []
    for port in ports:
        for f in SHM_DIR.glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
            f.unlink(missing_ok=True)
            removed.append(f)
    return removed


def run_subprocess(
    cmd: list[str], log: Callable[[str], None] = print, env: dict[str, str] | None = None
) -> None:
    """Run one command (see run_launches)."""
    run_launches([Launch(cmd)], log, env)


def run_launches(
    plan: list[Launch], log: Callable[[str], None] = print, env: dict[str, str] | None = None
) -> None:
    """Start the processes, stream their output line by line; on failure raise StageError
    naming the first rank's error (from the error file the worker writes), else the output's
    tail. If one fails, or this process is interrupted, the others are stopped."""
    inherited = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    errors_dir = Path(tempfile.mkdtemp(prefix="grpo-errors-"))
    base_env = {**inherited, ERROR_DIR: str(errors_dir), **(env or {})}
    quiet_environment(base_env)
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    # one pipe for every process: lines under the pipe's atomic size never interleave
    read_fd, write_fd = os.pipe()
    procs: list[subprocess.Popen] = []
    codes: list[int] = []
    try:
        try:
            for launch in plan:
                proc = subprocess.Popen(launch.cmd, stdout=write_fd, stderr=subprocess.STDOUT,
                                        env={**base_env, **launch.env})  # fmt: skip
                procs.append(proc)
                with _STARTED_LOCK:
                    _STARTED.add(proc)
        finally:
            os.close(write_fd)
        watcher = threading.Thread(target=_watch, args=(procs, codes), daemon=True)
        watcher.start()
        with open(read_fd, encoding="utf-8", errors="replace") as out:
            for line in out:
                line = line.rstrip("\n")
                tail.append(line)
                log(line)
        watcher.join()
    finally:
        stop_processes(procs)  # nothing left running when this returns, however it returns
        with _STARTED_LOCK:
            _STARTED.difference_update(procs)
        remove_shm_buffers(plan)
        records = [json.loads(f.read_text()) for f in sorted(errors_dir.glob("rank*.json"))]
        shutil.rmtree(errors_dir, ignore_errors=True)
    code = codes[0]
    if code == 0:
        return
    cmd = plan[0].cmd
    stage = cmd[cmd.index("grpo.launch.worker") + 1] if "grpo.launch.worker" in cmd else cmd[-1]
    if records:
        r = min(records, key=lambda x: x["rank"])
        first = (r["message"].strip().splitlines() or [""])[0]
        raise StageError(
            f"{stage} stage exited with {code}: rank {r['rank']}: {r['type']}: {first}",
            r["traceback"],
        )
    errors = [ln for ln in tail if "Error" in ln or "error" in ln] or list(tail)[-10:]
    raise StageError(f"{stage} stage exited with {code}: " + " | ".join(errors[-3:]),
                     "\n".join(tail))  # fmt: skip


def _worker(stage: str, config_path: Path, *args: str) -> list[str]:
    return ["-m", "grpo.launch.worker", stage, "--config", str(config_path), *args]


def run_sft(cfg: Config, *, force: bool = False, log: Callable[[str], None] = print) -> Path:
    """Build the SFT reference (reused when one of the same config and data exists)."""
    out = reference_dir(cfg)
    if not cfg.sft.enabled:
        return out
    # a second pipeline of the same config waits here, then finds the cache
    with file_lock(out.with_name(out.name + ".lock")):
        if (out / "config.json").exists() and (out / "sft_summary.json").exists() and not force:
            damage = cache_damage(out)
            if damage is None:
                log(f"SFT reference cache hit: {out}")
                return out
            log(f"SFT reference cache at {out} is damaged ({damage}): building it again")
            shutil.rmtree(out)
        _build_reference(cfg, out, log)
        write_manifest(out)
    return out


MANIFEST = "cache_manifest.json"


def write_manifest(out: Path) -> None:
    """Size and sha256 of every file of a built reference, checked on each cache hit."""
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != MANIFEST)
    manifest = {str(p.relative_to(out)): {"size": p.stat().st_size, "sha256": file_digest(p)}
                for p in files}  # fmt: skip
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))


def cache_damage(out: Path) -> str | None:
    """What is wrong with a cached reference (a file missing, cut short or changed since it
    was built), or None. Sizes first, then contents: hashing a 135M model takes about a
    second, and a changed file would otherwise be logged and trained from as the reference."""
    path = out / MANIFEST
    if not path.exists():
        return f"no {MANIFEST}: built by an older version or cut short"
    manifest = json.loads(path.read_text())
    for name, want in manifest.items():
        f = out / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != want["size"]:
            return f"{name} is {f.stat().st_size} bytes, {want['size']} when built"
    for name, want in manifest.items():
        if file_digest(out / name) != want["sha256"]:
            return f"{name} changed since it was built (sha256)"
    return None


def _build_reference(cfg: Config, out: Path, log: Callable[[str], None]) -> None:
    if _distributed(cfg):
        cfg_path = write_config(cfg, out.with_name(out.name + "_config.yaml"))
        base = str(base_model_dir(cfg))
        run_launches(launches(cfg, _worker("sft", cfg_path, "--base", base)), log)
        return
    from grpo.data.sets import training_sets
    from grpo.engine.sft import train_reference
    from grpo.launch.environment import import_deepspeed_without_mlflow

    # `grpo sft`/`grpo train` (a pipeline has loaded mlflow already), before the base model is
    # built: saving it imports DeepSpeed too (through accelerate)
    import_deepspeed_without_mlflow()
    summary = train_reference(cfg, base_model_dir(cfg), out, training_sets(cfg))
    (out / "sft_summary.json").write_text(json.dumps(summary, indent=2))


def run_grpo(
    cfg: Config,
    policy_dir: Path,
    out_dir: Path,
    *,
    resume: bool = False,
    log: Callable[[str], None] = print,
    env: dict[str, str] | None = None,
    pace_file: Path | None = None,
) -> dict[str, Any]:
    """GRPO from policy_dir into out_dir (policy/, checkpoints/, metrics.jsonl), in this
    process or as DeepSpeed ranks (deepspeed.nproc, deepspeed.hostfile).

    Args:
        cfg: the run's config.
        policy_dir: the starting policy (the SFT reference, or any model directory).
        out_dir: the run directory; with a selection split policy/ is the selected step's.
        resume: continue from out_dir's last checkpoint.
        log: where the ranks' lines go.
        env: extra environment for the ranks (OMP_NUM_THREADS beside a control).
        pace_file: rank 0 writes its progress there after every step, for a control to follow.

    Returns:
        train_summary.json's contents: final metrics, seconds, the engine that sampled, and
        the selection's summary when there is a selection split. On a node other than node 0
        of a run started node by node (this_node), {"node": ..., "final": {}}: node 0 writes
        the run.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    node = this_node(cfg)
    if node is None or node.rank == 0:  # node 0 writes the run's checkpoints and policy
        check_free_space(out_dir, policy_dir, cfg)
    args = ["--policy", str(policy_dir), "--out", str(out_dir)] + (["--resume"] if resume else [])
    if node is not None and node.rank > 0:
        # rank 0, on node 0, writes the run: this node's config goes beside it, not over it
        with tempfile.TemporaryDirectory(prefix="grpo-node-") as d:
            cfg_path = write_config(cfg, Path(d) / "config.yaml")
            _run_node(node, launches(cfg, _worker("train", cfg_path, *args)), log, env)
        return {"node": node.describe(), "final": {}}
    cfg_path = write_config(cfg, out_dir / "config.yaml")
    if pace_file is not None:
        args += ["--pace-file", str(pace_file)]
    _run_node(node, launches(cfg, _worker("train", cfg_path, *args)), log, env)
    return _summary(out_dir / "train_summary.json", "train")


# how gloo reports a peer that ended (its sockets closed) or went silent (the collective's
# timeout, deepspeed.timeout_s)
LOST_PEER = re.compile(
    r"Connection closed by peer \[(?P<addr>[^\]]+)\]|Connection reset by peer|Timed out"
)


def _run_node(
    node: Node | None, plan: list[Launch], log: Callable[[str], None], env: dict[str, str] | None
) -> None:
    """run_launches, and when this node's ranks failed because they lost another node's, the
    error says which node (by the peer's address where the hostfile's names resolve, else
    every other node) instead of gloo's socket message alone."""
    try:
        run_launches(plan, log, env)
    except StageError as e:
        m = LOST_PEER.search(str(e))
        if node is None or m is None:
            raise
        others = [h for i, h in enumerate(node.hosts) if i != node.rank]
        named = [h for h in others if m["addr"] and _address_of(h) == m["addr"]] or others
        raise StageError(
            f"train stage on {node.describe()} stopped: it lost the ranks of "
            f"{' or '.join(named)} (ended or unreachable; gloo: {m[0]}): that node's log says why",
            e.details,
        ) from None


def _address_of(host: str) -> str | None:
    import socket

    try:
        return socket.gethostbyname(host)
    except OSError:  # a name only the cluster's resolver knows
        return None


def run_control(
    cfg: Config,
    reference: Path,
    out_dir: Path,
    *,
    seconds: float | None = None,
    follow: Path | None = None,
    steps: int | None = None,
    log: Callable[[str], None] = print,
    env: dict[str, str] | None = None,
    threads_after: int | None = None,
) -> dict[str, Any]:
    """The SFT control: the reference trained on for `seconds`, until the GRPO run whose pace
    file is `follow` is done, or for `steps` steps (exactly one of them). Its weights go to
    out_dir. threads_after: with follow, its CPU threads once that run is done."""
    from grpo.engine.pace import control_budget

    given = control_budget(seconds, follow, steps)  # a bad budget fails before any process
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = write_config(cfg, out_dir.with_name(out_dir.name + "_config.yaml"))
    args = ["--policy", str(reference), "--out", str(out_dir)]
    args += [a for k, v in given.items() for a in (f"--{k}", str(v))]
    if threads_after is not None:
        args += ["--threads-after", str(threads_after)]
    run_launches(launches(cfg, _worker("control", cfg_path, *args)), log, env)
    return _summary(out_dir / "control_summary.json", "control")


def run_rft(
    cfg: Config, reference: Path, out_dir: Path, completions: int, *,
    log: Callable[[str], None] = print, env: dict[str, str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """RFT (grpo.engine.rft) from the reference, sampling `completions` in all, in one process
    (it samples every prompt itself); its selected weights go to out_dir."""
    one = cfg.model_copy(update={"deepspeed": cfg.deepspeed.model_copy(
        update={"nproc": 1, "hostfile": None})})  # fmt: skip
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    cfg_path = write_config(one, out_dir.with_name(out_dir.name + "_config.yaml"))
    args = ["--policy", str(reference), "--out", str(out_dir), "--completions", str(completions)]
    run_launches(launches(one, _worker("rft", cfg_path, *args)), log, env)
    return _summary(out_dir.with_name(out_dir.name + "_summary.json"), "rft")


def _summary(path: Path, stage: str) -> dict[str, Any]:
    """The summary a stage writes as its last act; missing after exit code 0, something ended
    the process early (os._exit in a reward function, say)."""
    if not path.exists():
        raise StageError(
            f"{stage} stage exited with 0 but never finished ({path.name} was not written): "
            "something in it ended the process early, e.g. a reward function calling os._exit"
        )
    return json.loads(path.read_text())
