"""A Python interpreter tool: each call's code runs in a fresh process, within limits.

What holds on every Linux machine, as any user:
- rlimits: CPU seconds, address space, file size (also caps what stdout/stderr can write),
  open files; a wall-clock timeout that kills the whole process group;
- a fresh, empty temporary working directory, removed after; an empty environment; the
  interpreter in isolated mode (`-I`: no site-packages of the user, no working directory on
  sys.path, no PYTHON* variables).

What holds only as root (`isolation()` says which are in force; `Sandbox.require` refuses to
run without the ones a config asks for):
- no network: a new network namespace (`unshare --net`), in which nothing is reachable;
- another user: the code runs as `nobody` (setpriv), with a process-count limit that then
  applies (root is exempt from it), so a 0600 credentials file is unreadable;
- no writes outside the working directory: a new mount namespace in which the filesystem is
  read-only but for that directory (and /dev/shm is covered);
- no view of the project: in the same namespace the project directory and the other `hidden`
  paths are covered by empty tmpfs mounts, so runs, stores and code are invisible.

The interpreter is the system's (`/usr/bin/python3` by default), not the project's
environment: the code gets the standard library only, and `nobody` can run it.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

NOBODY = 65534


@dataclass(frozen=True)
class Limits:
    """What one call may use."""

    cpu_s: int = 5  # CPU seconds (RLIMIT_CPU)
    wall_s: float = 10.0  # wall clock, the whole process group killed after
    memory_mb: int = 512  # address space (RLIMIT_AS)
    processes: int = 16  # processes of the sandbox user (RLIMIT_NPROC; as nobody only)
    output_bytes: int = 8192  # stdout and stderr each, kept; more is cut (RLIMIT_FSIZE)
    files: int = 64  # open file descriptors (RLIMIT_NOFILE)


@dataclass
class Result:
    """One call's outcome: what it printed (cut to the limit), how it ended and why."""

    stdout: str
    stderr: str
    exit_code: int | None
    ended_by: str  # "exit", "timeout", "cpu", "memory", "output", "signal"
    seconds: float
    isolation: tuple[str, ...] = field(default_factory=tuple)

    def text(self) -> str:
        """What the model reads back: its output, and the reason when the limits ended it."""
        parts = [self.stdout.rstrip("\n")] if self.stdout.strip() else []
        if self.stderr.strip():
            parts.append(self.stderr.rstrip("\n"))
        if self.ended_by != "exit":
            parts.append(f"[stopped: {self.ended_by} limit]")
        elif self.exit_code:
            parts.append(f"[exit code {self.exit_code}]")
        return "\n".join(parts) or "[no output]"


def _is_root() -> bool:
    return os.geteuid() == 0


def isolation(hidden: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The protections a call gets on this machine, beyond rlimits, the empty directory and
    the empty environment (which always hold)."""
    if not (_is_root() and shutil.which("unshare") and shutil.which("setpriv")):
        return ()
    return ("no-network", "user-nobody", "process-limit", "read-only-filesystem") + (
        ("hidden-paths",) if hidden else ()
    )


class Sandbox:
    """Runs Python code as the `python` tool does.

    Args:
        limits: what one call may use.
        python: the interpreter (the system's by default: standard library only).
        hidden: directories the code must not see (the project, its runs and stores); covered
            by empty mounts where the machine allows it (root).
        require: protections to insist on (e.g. ("no-network",)): a machine that cannot give
            them is refused at construction, in one line.
    """

    def __init__(
        self, limits: Limits | None = None, *, python: str = "/usr/bin/python3",
        hidden: tuple[str, ...] = (), require: tuple[str, ...] = (),
    ) -> None:  # fmt: skip
        self.limits = limits or Limits()
        if not Path(python).is_file():
            raise ValueError(f"sandbox: no interpreter at {python}")
        self.python = python
        self.hidden = tuple(str(Path(h).resolve()) for h in hidden if Path(h).exists())
        self.isolation = isolation(self.hidden)
        missing = [r for r in require if r not in self.isolation]
        if missing:
            raise ValueError(
                f"sandbox: this machine cannot give {', '.join(missing)} (needs root, unshare "
                f"and setpriv); it gives {', '.join(self.isolation) or 'rlimits only'}"
            )

    def _command(self, script: Path) -> list[str]:
        py = [self.python, "-I", "-S", "-B", str(script)]
        if not self.isolation:
            return py
        work = script.parent
        user = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                "--no-new-privs", "--"]  # fmt: skip
        # the work directory its own writable mount, then every other file read-only (the
        # root remounted so in this namespace only; /dev/shm covered), the hidden paths empty
        mounts = [f"mount --bind '{work}' '{work}'", "mount -o remount,bind,ro /",
                  "mount -t tmpfs -o size=1k,mode=555 none /dev/shm"]  # fmt: skip
        mounts += [f"mount -t tmpfs -o size=1k,mode=000 none '{h}'" for h in self.hidden
                   if not work.is_relative_to(h)]  # fmt: skip
        mounts.append(f"cd '{work}'")  # into the writable mount, not the directory under it
        mounts = " && ".join(mounts)
        inner = " ".join(f"'{w}'" for w in [*user, *py])
        # not exec'd: the shell turns a signal's death into 128 + N, which unshare passes on
        # (unshare re-raising the signal itself fails under these rlimits)
        shell = f"{mounts} && {inner}; exit $?"
        return ["unshare", "--net", "--mount", "--pid", "--fork", "--kill-child",
                "--mount-proc", "sh", "-c", shell]  # fmt: skip

    def _rlimits(self) -> None:  # in the child, before exec: inherited by everything after
        lim = self.limits
        os.setsid()
        resource.setrlimit(resource.RLIMIT_CPU, (lim.cpu_s, lim.cpu_s + 1))
        mem = lim.memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_FSIZE, (lim.output_bytes, lim.output_bytes))
        resource.setrlimit(resource.RLIMIT_NOFILE, (lim.files, lim.files))
        resource.setrlimit(resource.RLIMIT_NPROC, (lim.processes, lim.processes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    def run(self, code: str) -> Result:
        """Run `code` in a fresh process; never raises for what the code does."""
        work = Path(tempfile.mkdtemp(prefix="grpo-sandbox-"))
        out_dir = Path(tempfile.mkdtemp(prefix="grpo-sandbox-out-"))
        try:
            script = work / "main.py"
            script.write_text(code)
            if self.isolation:
                os.chown(work, NOBODY, NOBODY)
                os.chown(script, NOBODY, NOBODY)
            work.chmod(0o700)
            out, err = (out_dir / "stdout").open("wb"), (out_dir / "stderr").open("wb")
            start = time.monotonic()
            proc = subprocess.Popen(
                self._command(script), cwd=work, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                stdin=subprocess.DEVNULL, stdout=out, stderr=err, preexec_fn=self._rlimits,
            )  # fmt: skip
            timed_out = False
            try:
                proc.wait(timeout=self.limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            seconds = time.monotonic() - start
            out.close()
            err.close()
            stdout = (out_dir / "stdout").read_bytes()[: self.limits.output_bytes]
            stderr = (out_dir / "stderr").read_bytes()[: self.limits.output_bytes]
        finally:
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(out_dir, ignore_errors=True)
        code_ = proc.returncode
        ended = _ended_by(code_, timed_out, stderr, len(stdout) >= self.limits.output_bytes)
        return Result(stdout.decode("utf-8", "replace"), stderr.decode("utf-8", "replace"),
                      None if timed_out else code_, ended, seconds, self.isolation)  # fmt: skip


def _ended_by(code: int, timed_out: bool, stderr: bytes, full: bool) -> str:
    """Which limit ended a call: a signal shows as -N, or as 128 + N through unshare."""
    if timed_out:
        return "timeout"
    sig = -code if code < 0 else code - 128 if code > 128 else 0
    if sig in (signal.SIGXCPU, signal.SIGKILL):  # the soft CPU limit, then the hard one
        return "cpu"
    if sig == signal.SIGXFSZ or full:
        return "output"
    if b"MemoryError" in stderr:
        return "memory"
    return "signal" if sig else "exit"
