"""Where a config's models live: the base model, the cached SFT reference, a written config."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import re
from collections.abc import Iterator
from pathlib import Path

import yaml

from grpo.config import Config

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
        return Path(cfg.model.path)
    if cfg.model.gguf:
        return gguf_model_dir(cfg.model.gguf, Path(cfg.output_dir) / "base")
    from grpo.models.tiny import build_tiny_model

    out = Path(cfg.output_dir) / "base" / f"tiny-{cfg.digest('model')}-s{cfg.seed}"
    with file_lock(out.with_name(out.name + ".lock")):
        if not (out / "config.json").exists():
            build_tiny_model(out, cfg.model.tiny, cfg.seed)
    return out


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
    h = hashlib.sha256(keyed.digest("model", "data", "sft", "seed").encode())
    for f in (cfg.data.train_path, cfg.data.sft_path):
        if f and Path(f).is_file():
            h.update(file_digest(Path(f)).encode())
    root = Path(__file__).resolve().parents[1]
    for name in SFT_CODE:
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
