"""How far a GRPO step is from this machine's matmul limit, for sampling and for the update.

    .venv/bin/python benchmarks/utilization.py [--model DIR] [--repeats 3] [--out FILE]

Records every matrix multiply (aten mm/addmm/bmm/baddbmm) of one sampling call and one update
of the default settings, with its shape and FLOPs; times torch.matmul alone at each of those
shapes; and reports, per phase, the step's achieved matmul FLOP/s against the FLOP/s torch.matmul
reaches at the same shapes. "ideal" is the time the step's matmuls would take at torch.matmul's
speed: what is left to gain by making everything else (attention glue, sampling logic,
Python) free. Medians of --repeats runs.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
import bench_env  # noqa: E402

bench_env.prepare()  # the CLI's kernels and threads, before torch loads


def _recorder():  # noqa: ANN202
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten

    class MatmulShapes(TorchDispatchMode):
        """Counts (batch, m, k, n) of every matrix multiply run inside it (fused attention
        kernels are not matrix multiplies here and are left out)."""

        def __init__(self) -> None:
            super().__init__()
            self.shapes: Counter = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            kwargs = kwargs or {}
            if func in (aten.mm.default, aten.addmm.default):
                a, b = (args[0], args[1]) if func is aten.mm.default else (args[1], args[2])
                self.shapes[(1, a.shape[0], a.shape[1], b.shape[1])] += 1
            elif func in (aten.bmm.default, aten.baddbmm.default):
                a, b = (args[0], args[1]) if func is aten.bmm.default else (args[1], args[2])
                self.shapes[(a.shape[0], a.shape[1], a.shape[2], b.shape[2])] += 1
            # under inference_mode (the sampler) linear and matmul arrive undecomposed
            elif func is aten.linear.default:
                x, w = args[0], args[1]
                self.shapes[(1, x.numel() // x.shape[-1], x.shape[-1], w.shape[0])] += 1
            elif func is aten.matmul.default and args[0].dim() >= 2 and args[1].dim() >= 2:
                a, b = args[0], args[1]
                batch = max(a.numel() // (a.shape[-2] * a.shape[-1]),
                            b.numel() // (b.shape[-2] * b.shape[-1]))  # fmt: skip
                self.shapes[(batch, a.shape[-2], a.shape[-1], b.shape[-1])] += 1
            return func(*args, **kwargs)

    return MatmulShapes()


def _matmul_seconds(shape: tuple[int, int, int, int], repeats: int = 20) -> float:
    """Median seconds of one torch.matmul at (batch, m, k, n), fp32."""
    import torch

    b, m, k, n = shape
    x, y = torch.randn(b, m, k), torch.randn(b, k, n)
    if b == 1:
        x, y = x[0], y[0]
    for _ in range(3):
        torch.matmul(x, y)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        torch.matmul(x, y)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _phase(name: str, shapes: Counter, seconds: list[float]) -> dict:
    flops = sum(2 * b * m * k * n * c for (b, m, k, n), c in shapes.items())
    ideal = sum(_matmul_seconds(s) * c for s, c in shapes.items())
    step = statistics.median(seconds)
    return {"phase": name, "seconds": step, "gflop": flops / 1e9, "ideal": ideal,
            "achieved": flops / step / 1e9, "matmul": flops / ideal / 1e9,
            "calls": sum(shapes.values()), "shapes": len(shapes)}  # fmt: skip


def main() -> None:
    import torch

    from grpo.config import load_config
    from grpo.engine.loop import Trainer
    from grpo.engine.sampling import keep_groups, sample_step
    from grpo.engine.scoring import token_advantages
    from grpo.launch.paths import base_model_dir, gguf_model_dir

    p = argparse.ArgumentParser()
    p.add_argument(
        "--model",
        help="model directory (default: the untrained tiny model, or the config's GGUF model)",
    )
    p.add_argument("--config", help="YAML config (default: the embedded default run)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "UTILIZATION.md"))
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="grpo-util-"))
    cfg = load_config(a.config, [f"output_dir={tmp}", "grpo.eval_every=0"])
    model = a.model or (
        gguf_model_dir(cfg.model.gguf, ROOT / "runs" / "base") if cfg.model.gguf
        else base_model_dir(cfg)
    )  # fmt: skip
    t = Trainer(cfg, model, tmp / "grpo")
    # train on every completion, so that the update's cost does not depend on how many
    # groups happened to be informative
    t.cfg = cfg.model_copy(
        update={"grpo": cfg.grpo.model_copy(update={"skip_zero_advantage": False})}
    )

    def sample(step: int):  # noqa: ANN202
        sampled = sample_step(t.engine.module, t.tok, cfg, t.train_rows, t.scorer, step=step,
                              rank=0, world=1, device=t.device, eos_ids=t.eos_ids)  # fmt: skip
        ro, scores, texts, rows = keep_groups(sampled, t.local_prompts, cfg.grpo)
        return ro, token_advantages(cfg.grpo, ro, scores.rewards, rows, texts, t.tok)

    t.update(*sample(0), None)  # warm-up
    timings: dict[str, list[float]] = {"sampling": [], "update": []}
    shapes: dict[str, Counter] = {}
    tokens = []
    for step in range(1, a.repeats + 1):
        t0 = time.perf_counter()
        ro, adv = sample(step)
        t1 = time.perf_counter()
        t.update(ro, adv, None)
        t2 = time.perf_counter()
        timings["sampling"].append(t1 - t0)
        timings["update"].append(t2 - t1)
        tokens.append(int(ro.completion_mask.sum()))
    # shapes of one more step, recorded apart from the timed ones (recording costs time)
    with _recorder() as rec:
        ro, adv = sample(a.repeats + 1)
    shapes["sampling"] = rec.shapes
    with _recorder() as rec:
        t.update(ro, adv, None)
    shapes["update"] = rec.shapes
    rows = [_phase(n, shapes[n], timings[n]) for n in ("sampling", "update")]
    threads = torch.get_num_threads()
    g = cfg.grpo
    lines = [
        "# Distance from the CPU's matmul limit (benchmarks/utilization.py)",
        "",
        f"Command: `python benchmarks/utilization.py --repeats {a.repeats}"
        + (f" --config {a.config}" if a.config else "")
        + "`. "
        f"{cfg.run_name} settings ({g.prompts_per_step} prompts x {g.num_generations}, max "
        f"{g.max_completion_length} tokens, {Path(str(model)).name}), fp32, {threads} "
        f"threads, median of {a.repeats} steps; about {statistics.median(tokens)} completion "
        "tokens per step. Every completion trained on (no zero-advantage skipping), so the "
        "update's work is fixed. `matmul GFLOP/s` is torch.matmul alone at the same shapes and "
        "counts; `ideal s` the time the phase's matmuls would take at that speed.",
        "",
        "| phase | seconds | matmul GFLOP | matmul calls (shapes) | achieved GFLOP/s | "
        "torch.matmul GFLOP/s, same shapes | ideal s | achieved / matmul |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['phase']} | {r['seconds']:.3f} | {r['gflop']:.2f} | {r['calls']} "
            f"({r['shapes']}) | {r['achieved']:.1f} | {r['matmul']:.1f} | {r['ideal']:.3f} | "
            f"{r['achieved'] / r['matmul']:.1%} |"
        )
    top = sorted(shapes["sampling"].items(), key=lambda kv: -2 * kv[1] * kv[0][1])[:3]
    lines += ["", "Most frequent sampling shapes (batch, m, k, n) x calls: "
              + ", ".join(f"{s} x {c}" for s, c in top)]  # fmt: skip
    Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
