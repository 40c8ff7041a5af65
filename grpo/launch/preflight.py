"""Cheap checks that run in the parent process before anything expensive starts.

Each failure raises PreflightError with one line naming the thing and what was expected: the
CLI prints it and exits 2 (the traceback only with --debug). The tracking store is checked by
tasks.tracking.check_reachable, which knows MLflow.
"""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path

from grpo.config import Config, prompts_split_error
from reward_fns.errors import UserError


class PreflightError(UserError, ValueError):
    """Something a stage needs is missing or broken; the message names it."""


def check_model_dir(path: str | Path, base: str | Path | None = None) -> None:
    """A Hugging Face model directory: its config and tokenizer load, its weight files have a
    readable safetensors header (a truncated file is named by its path). A LoRA adapter
    directory: its weights, then its base (`base`, or the one its adapter config names)."""
    from grpo.models import lora
    from grpo.models.loading import ModelDirError, load_tokenizer

    p = Path(path)
    if not p.is_dir():
        raise PreflightError(f"{p}: model directory not found")
    if lora.is_adapter_dir(p):
        try:
            base = base or lora.adapter_base(p)
        except lora.AdapterDirError as e:
            raise PreflightError(str(e)) from e
        if not base:
            raise PreflightError(f"{p}: the adapter names no base model; pass its base (--base)")
        for w in sorted(p.glob("*.safetensors")):
            check_safetensors(w)
        check_model_dir(base)
        return
    if not (p / "config.json").is_file():
        raise PreflightError(f"{p}: no config.json: not a Hugging Face model directory")
    try:
        json.loads((p / "config.json").read_text())
    except (ValueError, OSError) as e:
        raise PreflightError(f"{p / 'config.json'}: not readable JSON ({e})") from e
    try:
        load_tokenizer(p)
    except ModelDirError as e:
        raise PreflightError(str(e)) from e
    except (OSError, ValueError) as e:
        raise PreflightError(f"{p}: the tokenizer does not load: {e}") from e
    weights = sorted(p.glob("*.safetensors"))
    if not weights:
        raise PreflightError(f"{p}: no *.safetensors weights (only safetensors are loaded)")
    for w in weights:
        check_safetensors(w)


def check_safetensors(path: Path) -> None:
    """The header of a safetensors file: its length, JSON, and data that fits in the file."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise PreflightError(f"{path}: truncated safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise PreflightError(f"{path}: corrupt or truncated safetensors file (header length)")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise PreflightError(f"{path}: corrupt safetensors header ({e})") from e
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
    if ends and max(ends) > size - 8 - n:
        raise PreflightError(f"{path}: truncated safetensors file: tensor data ends early")


def check_rewards(cfg: Config) -> None:
    """Every configured reward function resolves (built-in names, importable paths)."""
    from reward_fns import resolve

    g = cfg.grpo
    for name in g.reward_funcs:
        try:
            resolve(
                name, max_completion_length=g.max_completion_length, overlong_cache=g.overlong_cache
            )
        except ValueError as e:
            raise PreflightError(str(e)) from e


def check_writable(path: str | Path) -> None:
    """A directory that exists or can be created, and accepts a file."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=p, prefix=".preflight-"):
            pass
    except OSError as e:
        raise PreflightError(f"{p}: output directory not writable ({e.strerror or e})") from e


def check_data(cfg: Config, eval_sets: list[str] | None = None) -> None:
    """The training sets and the held-out sets parse (DataError names file, row and field),
    and a held-out file's gold answers are math (the pipeline's data validation checks the
    training sets' too)."""
    from grpo.data.sets import check_gold_answers, eval_set, eval_set_file, training_sets

    training_sets(cfg)
    for name in cfg.eval.sets if eval_sets is None else eval_sets:
        rows = eval_set(name, cfg)
        if name not in ("gsm8k", "math500") and eval_set_file(name) is not None:
            check_gold_answers(rows, name)


def hostfile_world_size(path: str | Path) -> int:
    """Ranks a DeepSpeed hostfile starts: the sum of its `slots=N` (comments, blank lines
    skipped)."""
    p = Path(path)
    if not p.is_file():
        raise PreflightError(f"{p}: hostfile not found")
    total = 0
    for i, line in enumerate(p.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = dict(x.split("=", 1) for x in line.split()[1:] if "=" in x)
        if not parts.get("slots", "").isdigit():
            raise PreflightError(f"{p}: line {i}: expected 'hostname slots=N', got {line!r}")
        total += int(parts["slots"])
    if total == 0:
        raise PreflightError(f"{p}: no host with slots")
    return total


def check_world_size(cfg: Config) -> None:
    """prompts_per_step must split evenly over the ranks the launch will really start (the
    config checks deepspeed.nproc; a hostfile decides for itself)."""
    if not cfg.deepspeed.hostfile:
        return
    world = hostfile_world_size(cfg.deepspeed.hostfile)
    ranks = f"the ranks of {cfg.deepspeed.hostfile}"
    if error := prompts_split_error(cfg.grpo.prompts_per_step, world, ranks):
        raise PreflightError(error)


def check_memory(cfg: Config) -> None:
    """A GRPO step's lower-bound memory fits the machine (grpo.launch.memory)."""
    from grpo.launch.memory import memory_error

    world = hostfile_world_size(cfg.deepspeed.hostfile) if cfg.deepspeed.hostfile else None
    error = memory_error(cfg, world or cfg.deepspeed.nproc)
    if error:
        raise PreflightError(error)


def check_gguf(spec: str) -> None:
    """model.gguf names a file that exists, and the packages that read it are installed."""
    from grpo.models.gguf import check_readers, resolve_gguf

    check_readers(resolve_gguf(spec))


def check_rollout_engine(cfg: Config) -> None:
    """grpo.rollout_engine's package is installed (llama_cpp: llama-cpp-python)."""
    if cfg.grpo.rollout_engine == "llama_cpp":
        from grpo.models.llamacpp_engine import missing_reason

        if (reason := missing_reason()) is not None:
            raise PreflightError(reason)


def preflight(
    cfg: Config, *, model_dirs: list[str | Path] = (), train: bool = True,
    base: str | Path | None = None,
) -> None:  # fmt: skip
    """The checks of a command: model directories, reward functions, output, data, ranks."""
    check_writable(cfg.output_dir)
    if train:
        check_world_size(cfg)
    if cfg.model.path:
        from grpo.launch.paths import ModelPathError, model_path_dir

        try:
            check_model_dir(model_path_dir(cfg.model.path))
        except ModelPathError as e:
            raise PreflightError(str(e)) from e
    if cfg.model.gguf:
        check_gguf(cfg.model.gguf)
    for d in model_dirs:
        check_model_dir(d, base)  # base: of an adapter directory among them
    if train:
        check_rewards(cfg)
        check_rollout_engine(cfg)
        check_memory(cfg)
    check_data(cfg)
