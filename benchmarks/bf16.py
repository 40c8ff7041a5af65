"""bfloat16 against float32 on this CPU, at SmolLM2-135M's shapes: the matmuls of the update and
of sampling, the update's forward+backward under autocast, and sampling's decode steps with
bf16 weights.

    .venv/bin/python benchmarks/bf16.py [--repeats 5] [--out benchmarks/BF16.md]

Everything runs in one process, float32 and bfloat16 alternated, after one warm-up of each;
medians with min-max, and each bf16/fp32 time ratio (> 1: bf16 is slower). The CPU's bf16
instructions (avx512_bf16, amx_bf16) decide the outcome: without them torch converts to float32
around every matmul. Needs `make install-real` (the model's weights).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
import bench_env  # noqa: E402

bench_env.prepare()  # the CLI's kernels and threads, before torch loads


def _cpuinfo(field: str) -> str:
    """The first value of `field` in /proc/cpuinfo ("" where there is none)."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    line = next((x for x in text.splitlines() if x.startswith(field)), "")
    return line.split(":", 1)[-1].strip()


def _alternate(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each callable, one warm-up each, then `repeats` rounds in turn."""
    for f in runs.values():
        f()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(repeats):
        for k, f in runs.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return times


def _matmuls(repeats: int) -> list[tuple[str, dict[str, list[float]]]]:
    import torch

    rows = []
    # (what, rows of activations, in, out): SmolLM2's hidden 576, MLP 1536, vocabulary 49152
    for what, m, k, n in [("update MLP (2048 tokens)", 2048, 576, 1536),
                          ("update LM head (2048 tokens)", 2048, 576, 49152),
                          ("decode MLP (64 rows)", 64, 576, 1536),
                          ("decode LM head (64 rows)", 64, 576, 49152)]:  # fmt: skip
        a, b = torch.randn(m, k), torch.randn(k, n)
        a16, b16 = a.bfloat16(), b.bfloat16()
        t = _alternate({"fp32": lambda a=a, b=b: a @ b, "bf16": lambda a=a16, b=b16: a @ b},
                       repeats)  # fmt: skip
        rows.append((f"matmul: {what}", t))
    return rows


def _model_runs(repeats: int) -> tuple[list[tuple[str, dict[str, list[float]]]], dict]:
    import copy

    import torch

    from grpo.config import load_config
    from grpo.launch.paths import gguf_model_dir
    from grpo.models.loading import load_model

    cfg = load_config(ROOT / "configs" / "smollm2-135m.yaml", [])
    path = gguf_model_dir(cfg.model.gguf, ROOT / "runs" / "base")
    model = load_model(path, "float32")
    model.config.use_cache = True
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (8, 128), generator=g)  # the update: 8 sequences of 128

    def update(autocast: bool) -> None:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(ids).logits
        logits.float().log_softmax(-1).mean().backward()

    rows = [("update: forward+backward, 8 x 128 tokens (autocast)",
             _alternate({"fp32": lambda: update(False), "bf16": lambda: update(True)},
                        repeats))]  # fmt: skip
    model_bf16 = copy.deepcopy(model).to(torch.bfloat16)
    prompt = torch.randint(0, vocab, (64, 32), generator=g)

    @torch.no_grad()
    def decode(m: torch.nn.Module) -> torch.Tensor:
        """Prefill 64 prompts of 32 tokens, then 16 greedy decode steps with the KV cache."""
        out = m(prompt, use_cache=True)
        cache, nxt, last = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True), []
        for _ in range(16):
            out = m(nxt, past_key_values=cache, use_cache=True)
            cache, last = out.past_key_values, out.logits[:, -1].float()
            nxt = last.argmax(-1, keepdim=True)
        return last

    rows.append(("sampling: prefill 64 x 32 + 16 decode steps (bf16 weights)",
                 _alternate({"fp32": lambda: decode(model), "bf16": lambda: decode(model_bf16)},
                            repeats)))  # fmt: skip
    with torch.no_grad():
        lp32 = model(ids).logits.log_softmax(-1)
        lp16 = model_bf16(ids).logits.float().log_softmax(-1)
        tok = ids[:, 1:].unsqueeze(-1)
        d = (lp32[:, :-1].gather(-1, tok) - lp16[:, :-1].gather(-1, tok)).abs()
    numerics = {"max": float(d.max()), "mean": float(d.mean())}
    return rows, numerics


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "BF16.md"))
    a = p.parse_args()

    import torch

    flags = set(_cpuinfo("flags").split())
    have = [f for f in ("avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16") if f in flags]
    rows = _matmuls(a.repeats)
    model_rows, numerics = _model_runs(a.repeats)
    rows += model_rows
    lines = [
        "# bfloat16 against float32 on the CPU (SmolLM2-135M's shapes)",
        "",
        f"Command: `python benchmarks/bf16.py --repeats {a.repeats}`. CPU: "
        f"{_cpuinfo('model name') or platform.machine()}, its bf16-related flags: "
        f"{', '.join(have) or 'none'}; torch {torch.__version__}, kernels "
        f"{torch.backends.cpu.get_cpu_capability()} (as `grpo` pins them), "
        f"{torch.get_num_threads()} threads. "
        "One process, float32 and bfloat16 alternated after a warm-up of each; medians of "
        f"{a.repeats} (min-max).",
        "",
        "| what | fp32 s | bf16 s | bf16 / fp32 time |",
        "|---|---|---|---|",
    ]
    for what, t in rows:
        f32, b16 = statistics.median(t["fp32"]), statistics.median(t["bf16"])
        lines.append(
            f"| {what} | {f32:.4f} ({min(t['fp32']):.4f}-{max(t['fp32']):.4f}) | "
            f"{b16:.4f} ({min(t['bf16']):.4f}-{max(t['bf16']):.4f}) | {b16 / f32:.2f}x |"
        )
    lines += [
        "",
        "Numerics: the log-probability of each next token of the 8 x 128 batch, bf16 weights "
        f"against fp32: max |difference| {numerics['max']:.3f}, mean {numerics['mean']:.4f} "
        "(nats).",
    ]
    Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
