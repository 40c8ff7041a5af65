"""Process supervision for the servers: start children in sessions of their own with their logs,
wait for an HTTP endpoint, run a setup command, stop every child and its descendants."""

from __future__ import annotations

import contextlib
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

from grpo.launch.runner import stop_processes
from reward_fns.errors import UserError


class SupervisionError(UserError, RuntimeError):
    """A child died or a setup command failed; the message names it and its log."""


def bin_path(name: str) -> str:
    """A console script of this interpreter's environment."""
    return str(Path(sys.executable).with_name(name))


def wait_http(
    url: str, seconds: float, what: str, *, proc: subprocess.Popen | None = None,
    interval: float = 1.0,
) -> None:  # fmt: skip
    """Poll `url` until it answers. An https server whose certificate this process does not
    trust fails at once: waiting would not change it; so does a server process `proc` that
    has exited."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.URLError as e:
            if isinstance(e.reason, ssl.SSLCertVerificationError):
                raise SupervisionError(
                    f"{what} at {url}: its certificate is not trusted here "
                    f"({e.reason.verify_message}); set SSL_CERT_FILE and REQUESTS_CA_BUNDLE to "
                    "a CA bundle that holds the CA that signed it"
                ) from None
            time.sleep(interval)
        except OSError:
            time.sleep(interval)
    raise RuntimeError(f"{what} did not answer at {url} within {seconds:.0f}s")


def run_setup(cmd: list[str], env: dict[str, str], what: str, cwd: Path) -> None:
    """Run a setup command to its end; its failure in one line with the output's last lines."""
    out = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    if out.returncode != 0:
        tail = (out.stdout + out.stderr).strip().splitlines()[-3:]
        raise SupervisionError(f"{what} failed ({out.returncode}): {' | '.join(tail)}")


def _descendants(pid: int) -> list[psutil.Process]:
    with contextlib.suppress(psutil.NoSuchProcess):
        return psutil.Process(pid).children(recursive=True)
    return []


def stop_all(procs: dict[str, subprocess.Popen]) -> None:
    """SIGTERM every child's process group, then SIGKILL what is left after 20 s.

    Descendants are listed first: a flow run started by the worker lives in a session of its
    own, out of reach of the worker's process group.
    """
    below = [d for p in procs.values() for d in _descendants(p.pid)]
    for d in below:
        with contextlib.suppress(psutil.NoSuchProcess):
            d.terminate()
    deadline = time.time() + 20
    stop_processes(list(procs.values()), grace_s=20, groups=True)
    _gone, alive = psutil.wait_procs(below, timeout=max(0.1, deadline - time.time()))
    for d in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            d.kill()


class Children:
    """The servers and workers serve started, by name: each in a session of its own (stopping
    it stops its children: server workers, flow runs), its output in logs/<name>.log."""

    def __init__(self, logs: Path, env: dict[str, str], cwd: Path) -> None:
        self.logs, self.env, self.cwd = logs, env, cwd
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, cmd: list[str], name: str, extra_env: dict[str, str] | None = None) -> None:
        f = (self.logs / f"{name}.log").open("w")
        self.procs[name] = subprocess.Popen(
            cmd, env={**self.env, **(extra_env or {})}, stdout=f, stderr=subprocess.STDOUT,
            start_new_session=True, cwd=self.cwd,
        )  # fmt: skip

    def check_alive(self) -> None:
        """SupervisionError naming the first child that exited, and its log."""
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise SupervisionError(
                    f"the {name} process exited with {p.returncode}; see {self.logs / name}.log"
                )

    def stop(self) -> None:
        stop_all(self.procs)
