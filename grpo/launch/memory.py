"""A lower bound on a GRPO rank's memory, checked against the machine before anything starts.

Only what a rank certainly holds at once is counted: the weights and the training state it
keeps, the sampler's key/value cache for its completions at full length (the fast sampler
allocates it up front, and a step must be ready for completions that run to
max_completion_length), and the larger of the sampler's and the update's logits. Activations,
allocator slack and the reference model come on top, so a run this refuses cannot fit; one it
lets through may still not. Without it, a count with three zeros too many (num_generations,
max_completion_length) stopped minutes later at a failed allocation of gigabytes.
"""

from __future__ import annotations

import json
import resource
from dataclasses import dataclass
from pathlib import Path

from grpo.config import Config
from grpo.launch.paths import model_path_dir

GIB = 1024**3
# the tiny model's vocabulary (grpo.models.tiny): specials, printable ASCII, template tags
TINY_VOCAB = 104


@dataclass(frozen=True)
class Dims:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int

    @property
    def params(self) -> int:
        head = self.hidden // self.heads
        attn = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head
        return self.vocab * self.hidden + self.layers * (attn + 3 * self.hidden * self.intermediate)


def model_dims(cfg: Config) -> Dims | None:
    """The shapes that decide memory, from config.json or the tiny model's section; None when
    a model directory has no readable config (check_model_dir reports that)."""
    if cfg.model.path is None and cfg.model.gguf is None:
        t = cfg.model.tiny
        return Dims(TINY_VOCAB, t.hidden_size, t.num_layers, t.num_heads, t.num_kv_heads,
                    t.intermediate_size)  # fmt: skip
    if cfg.model.path is None:
        return None  # a GGUF file: converted later, its shapes unknown here
    try:
        c = json.loads((model_path_dir(cfg.model.path) / "config.json").read_text())
        heads = c["num_attention_heads"]
        return Dims(c["vocab_size"], c["hidden_size"], c["num_hidden_layers"], heads,
                    c.get("num_key_value_heads", heads), c["intermediate_size"])  # fmt: skip
    except (OSError, ValueError, KeyError):  # ModelPathError too: preflight names it
        return None


def rank_bytes(cfg: Config, dims: Dims, world: int) -> dict[str, int]:
    """Bytes one rank holds at least, by what holds them."""
    g = cfg.grpo
    width = 2 if cfg.model.dtype in ("bfloat16", "float16") else 4
    completions = max(1, g.prompts_per_step * g.num_generations // world)
    head = dims.hidden // dims.heads
    # ZeRO-2/3 split gradients and Adam's two moments over the ranks; weights stay whole
    split = world if cfg.deepspeed.zero_stage >= 2 else 1
    micro = min(g.micro_batch_size, completions)
    lora = cfg.model.lora.enabled
    update_logits = micro * g.max_completion_length * dims.vocab * 4
    _, budget_mib = cfg.forward_layout()
    if budget_mib > 0:  # the LM head runs in chunks of at most this many bytes of logits
        update_logits = min(update_logits, int(budget_mib * 2**20))
    return {
        # LoRA trains adapters only: their gradients and moments are small, left out here
        "weights and optimizer": dims.params * (width + (0 if lora else (4 + 8) // split)),
        "sampler KV cache": 2 * dims.layers * dims.kv_heads * head * completions
        * g.max_completion_length * width,
        "logits": max(completions * dims.vocab * 4, update_logits),
    }  # fmt: skip


def machine_bytes() -> int:
    """The memory this process may use: physical memory, or less under a cgroup or ulimit."""
    import psutil

    limits = [psutil.virtual_memory().total]
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        limits.append(soft)
    cgroup = Path("/sys/fs/cgroup/memory.max")
    if cgroup.is_file() and cgroup.read_text().strip().isdigit():
        limits.append(int(cgroup.read_text()))
    return min(limits)


def memory_error(cfg: Config, world: int) -> str | None:
    """Why this config cannot fit on this machine (all its ranks on it), or None."""
    import torch

    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        return None  # the GPU's memory is another budget, met at its first allocation
    dims = model_dims(cfg)
    if dims is None:
        return None
    parts = rank_bytes(cfg, dims, world)
    local = 1 if cfg.deepspeed.hostfile else cfg.deepspeed.nproc  # ranks on this machine
    need, have = sum(parts.values()) * local, machine_bytes()
    if need <= have:
        return None
    what = ", ".join(f"{k} {v / GIB:.1f}" for k, v in parts.items())
    return (
        f"grpo: at least {need / GIB:.1f} GiB for {world} rank(s) ({what} GiB each), but this "
        f"machine allows {have / GIB:.1f} GiB: lower grpo.num_generations, "
        "grpo.prompts_per_step, grpo.max_completion_length or grpo.micro_batch_size"
    )
