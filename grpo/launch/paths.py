"""Where a config's models live: the base model, the cached SFT reference, a written config."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

import yaml

from grpo.config import Config
from reward_fns.errors import UserError

ERROR_DIR = "GRPO_ERROR_DIR"  # environment: where a failing rank writes its error (worker.py)


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock held for the `with` block, across processes (two pipelines building
    the same cached model, or creating the same sqlite store, wait for each other)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def base_model_dir(cfg: Config) -> Path:
    """The model SFT starts from: model.path, the converted model.gguf, or the tiny model built
    into the run directory."""
    if cfg.model.path:
        return model_path_dir(cfg.model.path)
    if cfg.model.gguf:
        return gguf_model_dir(cfg.model.gguf, Path(cfg.output_dir) / "base")
    from grpo.models.tiny import build_tiny_model

    out = Path(cfg.output_dir) / "base" / f"tiny-{cfg.digest('model')}-s{cfg.seed}"
    with file_lock(out.with_name(out.name + ".lock")):
        if not (out / "config.json").exists():
            build_tiny_model(out, cfg.model.tiny, cfg.seed)
    return out


# a Hugging Face Hub repository id: one owner/name, no leading dot or slash
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelPathError(UserError, ValueError):
    """model.path names neither a directory nor a model in the Hugging Face cache."""


def _hub_offline() -> bool:
    # read at call time: huggingface_hub reads it once, at its import, and the pipeline sets
    # it after
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def model_path_dir(path: str) -> Path:
    """The directory `model.path` names: a local directory as it is, or a Hub id
    (`owner/name`) resolved to its snapshot in the Hugging Face cache (`HF_HOME`,
    `HF_HUB_CACHE`), downloaded first unless `HF_HUB_OFFLINE=1`, which the pipeline sets when
    the environment leaves it unset."""
    p = Path(path).expanduser()
    if p.is_dir() or not HUB_ID.match(path):
        return p
    return _hub_snapshot(path, _hub_offline(), _hub_cache())


def _hub_cache() -> str | None:
    # huggingface_hub's own order (HF_HUB_CACHE, then HF_HOME/hub), read at call time
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    return str(Path(os.environ["HF_HOME"]) / "hub") if os.environ.get("HF_HOME") else None


@functools.lru_cache(maxsize=8)  # one lookup (or download) a process, however many callers
def _hub_snapshot(path: str, offline: bool, cache: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(path, cache_dir=cache, local_files_only=offline))
    except LocalEntryNotFoundError as e:
        how = ("HF_HUB_OFFLINE=1: run once with HF_HUB_OFFLINE=0 to download it, or "
               "`hf download " + path + "`") if offline else str(e).splitlines()[0]  # fmt: skip
        raise ModelPathError(
            f"model.path {path}: no such directory, and not in the Hugging Face cache ({how})"
        ) from e
    except HfHubHTTPError as e:
        raise ModelPathError(
            f"model.path {path}: no such directory, and the Hub refused it: "
            f"{str(e).splitlines()[0]}"
        ) from e


def gguf_model_dir(spec: str, cache: Path) -> Path:
    """The Hugging Face directory of the GGUF file `spec` names (grpo.models.gguf), cached
    under `cache` by the file's content digest and converted once, one process at a time."""
    from grpo.models.gguf import convert_gguf, resolve_gguf

    gguf = resolve_gguf(spec)
    out = cache / f"{gguf.stem}-{file_digest(gguf)[:16]}"
    with file_lock(out.with_name(out.name + ".lock")):
        if not (out / "config.json").exists():
            convert_gguf(gguf, out)
    return out


# the code an SFT reference depends on: a change to any of them builds a new reference
SFT_CODE = ("engine/sft.py", "data/synthetic.py", "data/files.py", "data/sets.py",
            "models/tiny.py", "models/prompts.py", "engine/deepspeed.json")  # fmt: skip
SFT_TOOLS_CODE = ("models/episodes.py", "env/render.py", "env/calls.py", "env/tools.py")


def reference_dir(cfg: Config) -> Path:
    """Where the SFT reference of this config lives (model.path itself when SFT is off).

    Cached by a key over the config sections it depends on, the contents of its data files and
    the code that builds it, so that an edited training file or SFT code never reuses a stale
    reference.
    """
    if not cfg.sft.enabled:
        return base_model_dir(cfg)
    # how the control runs (sft.control, control_steps, control_lr) does not change the
    # reference it starts from
    control = {"control": "auto", "control_steps": None, "control_lr": None}
    # nor do the synthetic sets drawn after sft and sft_val (the RL prompts, the selection split)
    after = {"num_train": 0, "num_select": 0} if cfg.data.task == "synthetic" else {}
    keyed = cfg.model_copy(update={"sft": cfg.sft.model_copy(update=control),
                                   "data": cfg.data.model_copy(update=after)})  # fmt: skip
    # with tools, SFT's prompts list them and its demonstrations are laid out as episodes
    sections = ("model", "data", "sft", "seed") + (("tools",) if cfg.tools.active else ())
    h = hashlib.sha256(keyed.digest(*sections).encode())
    for f in (cfg.data.train_path, cfg.data.sft_path):
        if f and Path(f).is_file():
            h.update(file_digest(Path(f)).encode())
    root = Path(__file__).resolve().parents[1]
    for name in SFT_CODE + (SFT_TOOLS_CODE if cfg.tools.active else ()):
        h.update((root / name).read_bytes())
    return Path(cfg.output_dir) / "sft" / h.hexdigest()[:16]


def file_digest(path: Path) -> str:
    """sha256 of a file's contents, read in chunks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# what loading a model reads (weights, configs, tokenizer): two directories equal in these
# generate the same completions, whatever else (manifests, summaries) sits beside them
_MODEL_FILE = re.compile(
    r"(.*\.safetensors|.*\.bin|(generation_|adapter_)?config\.json|tokenizer.*|"
    r"special_tokens_map\.json|vocab.*|merges\.txt|chat_template.*|added_tokens\.json)"
)


def model_digest(model_dir: str | Path) -> str:
    """sha256 over the files a model is loaded from (names and contents), for spotting two
    directories that hold the same model. A tokenizer.json is read without its padding and
    truncation state: a tokenizer saved after it padded a batch records them, and loading sets
    them again (grpo.models.loading), so they say nothing about the model."""
    d = Path(model_dir)
    files = sorted(p for p in d.iterdir() if p.is_file() and _MODEL_FILE.fullmatch(p.name))
    if not files:
        raise FileNotFoundError(f"{d}: no model files (weights, config.json, tokenizer)")
    listing = "".join(f"{p.name}:{_content_digest(p)}\n" for p in files)
    return hashlib.sha256(listing.encode()).hexdigest()


def _content_digest(path: Path) -> str:
    if path.name != "tokenizer.json":
        return file_digest(path)
    import json

    tok = json.loads(path.read_text())
    tok.pop("padding", None)
    tok.pop("truncation", None)
    return hashlib.sha256(json.dumps(tok, sort_keys=True).encode()).hexdigest()


def write_config(cfg: Config, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return path
