"""The process group and the collectives the algorithm needs.

The same code runs as one process (no launcher: we set the env a launcher would) and as N ranks
started by `deepspeed` (GPUs, or CPU processes on a machine without one).
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import tempfile
from datetime import timedelta

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# the file-rendezvous directories of this process's single-process groups
_FILE_STORES: list[str] = []


def init_distributed(timeout_s: int) -> tuple[int, int]:
    """Start (or join) the process group; returns (rank, world_size)."""
    import deepspeed
    import torch.distributed as dist

    init_method = None
    if "RANK" not in os.environ:  # a single process started without a launcher
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
        )  # fmt: skip
        # a file rendezvous: no TCP port that a neighbouring process could take first; its
        # directory goes with the group (finish_distributed), or one file per stage piles up
        # in /tmp. No peer to wait for, so finishing is safe at any exit, failed or not.
        where = tempfile.mkdtemp(prefix="grpo-dist-")
        _FILE_STORES.append(where)
        atexit.register(finish_distributed)
        init_method = f"file://{os.path.join(where, 'store')}"
    if not dist.is_initialized():
        deepspeed.init_distributed(
            timeout=timedelta(seconds=timeout_s), init_method=init_method, rank=0 if init_method
            else -1, world_size=1 if init_method else -1,
        )  # fmt: skip
    return dist.get_rank(), dist.get_world_size()


def finish_distributed() -> None:
    """Wait for every rank, then destroy the process group: call it once a rank's work has
    succeeded. A process that exits with the group alive can abort in the interpreter's
    teardown ("terminate called without an active exception", SIGABRT: gloo's worker threads
    still hold tensors), which failed a 2-rank SFT stage that had finished its work. Not on a
    failure: a peer blocked in a collective would keep this rank in the barrier until timeout."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() > 1:
            dist.barrier()  # no rank tears its end down while a peer still talks to it
        dist.destroy_process_group()
    while _FILE_STORES:
        shutil.rmtree(_FILE_STORES.pop(), ignore_errors=True)


def all_reduce_sum(values: list[float], device: torch.device, op: str = "sum") -> list[float]:
    """Element-wise sum (or "max") of a list of floats over all ranks."""
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return t.tolist()


def all_reduce_dict(
    values: dict[str, float], device: torch.device, op: str = "sum"
) -> dict[str, float]:
    """all_reduce_sum by name: every rank must pass the same keys (they are reduced in sorted
    order, so the order a rank built its dict in does not matter)."""
    keys = sorted(values)
    return dict(zip(keys, all_reduce_sum([values[k] for k in keys], device, op)))
