"""Entry point of one rank: `python -m grpo.launch.worker {sft,train,control,rft} --config X`.

Started by DeepSpeed's launcher (one process per GPU or CPU rank) or directly for one rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from grpo.launch.environment import import_deepspeed_without_mlflow, quiet_environment

quiet_environment()  # before torch is imported by anything below


def main(argv: list[str] | None = None) -> None:
    try:
        import_deepspeed_without_mlflow()
        _main(argv)
    except Exception as e:
        # the parent names the error in one line; the traceback only with --debug
        if not _write_error(e) or os.environ.get("GRPO_DEBUG"):
            raise
        sys.exit(1)
    from grpo.engine.distributed import finish_distributed

    finish_distributed()  # only after success: see its docstring


def _exit_now() -> None:
    """Leave without the interpreter's teardown: C++ destructors of torch, gloo and DeepSpeed
    objects run there, and a rank whose work was done and saved aborted in them ("terminate
    called without an active exception", SIGABRT: a 2-rank SFT stage in CI), failing a
    finished stage. Everything a rank leaves behind is written and closed by the time main()
    returns; this flushes what is buffered."""
    import logging

    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)


def _write_error(e: BaseException) -> bool:
    """The rank's error as JSON ({type, message, traceback}), so that the parent can name it in
    one line instead of the launcher's "exited with 1"."""
    import traceback

    from grpo.launch.paths import ERROR_DIR

    where = os.environ.get(ERROR_DIR)
    if not where:
        return False
    rank = os.environ.get("RANK", "0")
    record = {
        "rank": int(rank), "type": type(e).__name__, "message": str(e),
        "traceback": "".join(traceback.format_exception(e)),
    }  # fmt: skip
    Path(where).mkdir(parents=True, exist_ok=True)
    Path(where, f"rank{rank}.json").write_text(json.dumps(record))
    return True


def _main(argv: list[str] | None) -> None:
    p = argparse.ArgumentParser(prog="grpo.launch.worker")
    p.add_argument("stage", choices=["sft", "train", "control", "rft"])
    p.add_argument("--config", required=True)
    p.add_argument("--base")
    p.add_argument("--policy")
    p.add_argument("--out")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--seconds", type=float, help="control: its budget in seconds")
    p.add_argument("--follow", help="control: the pace file of the GRPO run it follows")
    p.add_argument("--steps", type=int, help="control: its budget in steps")
    p.add_argument("--threads-after", type=int,
                   help="control: CPU threads once the followed run is done")  # fmt: skip
    p.add_argument("--pace-file", help="train: write progress here after every step")
    p.add_argument("--completions", type=int, help="rft: the completions it may sample")
    p.add_argument("--local_rank", type=int, default=None)  # passed by older launchers
    a = p.parse_args(argv)

    from grpo.config import load_config

    cfg = load_config(a.config)
    rank = int(os.environ.get("RANK", "0"))
    if a.stage == "sft":
        from grpo.data.sets import training_sets
        from grpo.engine.sft import train_reference
        from grpo.launch.paths import reference_dir

        out = reference_dir(cfg)
        summary = train_reference(cfg, a.base, out, training_sets(cfg), progress=rank == 0)
        if rank == 0:
            (out / "sft_summary.json").write_text(json.dumps(summary, indent=2))
    elif a.stage == "rft":
        from grpo.data.sets import training_sets
        from grpo.engine.rft import train_rft

        summary = train_rft(cfg, a.policy, Path(a.out), training_sets(cfg), a.completions,
                            progress=rank == 0)  # fmt: skip
        summary.pop("history")
        Path(a.out).with_name(Path(a.out).name + "_summary.json").write_text(
            json.dumps(summary, indent=2)
        )
    elif a.stage == "control":
        from grpo.data.sets import training_sets
        from grpo.engine.sft import train_control

        summary = train_control(
            cfg, a.policy, Path(a.out), training_sets(cfg), max_seconds=a.seconds,
            follow=Path(a.follow) if a.follow else None, max_steps=a.steps,
            threads_after=a.threads_after,
        )  # fmt: skip
        if rank == 0:
            summary.pop("history")
            Path(a.out, "control_summary.json").write_text(json.dumps(summary, indent=2))
    else:
        from grpo.engine.loop import train_grpo
        from grpo.engine.pace import write_pace

        on_step = None
        if a.pace_file:  # a control beside this run paces itself by it

            def on_step(done: int, total: int, finished: bool) -> None:
                write_pace(Path(a.pace_file), done, total, done=finished)

        summary = train_grpo(cfg, a.policy, a.out, resume=a.resume, on_step=on_step)
        if rank == 0:
            Path(a.out, "train_summary.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
    _exit_now()  # reached only after success: a failure has exited with 1 (or raised)
