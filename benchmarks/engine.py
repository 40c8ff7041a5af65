"""Rollout engines side by side: the fast sampler, transformers generate and llama.cpp (float32
and float16 weights), at a config's step shape.

    .venv/bin/python benchmarks/engine.py [--config configs/smollm2-135m.yaml] [--repeats 3]
        [--steps 3] [--set key=value ...] [--out FILE]

For each engine, alternated within each of --repeats rounds, one step's sampling of the
config's prompts (prompts_per_step x num_generations, up to max_completion_length tokens) from
the same model: completion tokens per second. llama.cpp's weight sync, timed apart. Then
training steps per hour: --steps steps of the trainer for each loop (the policy sampling, and
llama.cpp synchronously and with async rollouts), alternated, the median step time. The share
of the machine's matmul speed is the utilization benchmark's measure: the fast sampler's own
matmuls (recorded, then timed as torch.matmul alone) per completion token, times each engine's
tokens, over its seconds. Medians throughout; the machine's other load is the reader's to
rule out (run it alone).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
import bench_env  # noqa: E402

bench_env.prepare()  # the CLI's kernels and threads, before torch loads

ENGINES = ("fast", "hf", "llama_cpp float32", "llama_cpp float16")
LOOPS = {  # steps-per-hour variants: config overrides
    "policy (fast), sync": [],
    "llama_cpp float32, sync": ["grpo.rollout_engine=llama_cpp"],
    "llama_cpp float32, async": ["grpo.rollout_engine=llama_cpp", "grpo.async_rollouts=true"],
}


def _model_dir(cfg, tmp: Path) -> Path:  # noqa: ANN001
    from grpo.launch.paths import base_model_dir, gguf_model_dir

    if cfg.model.gguf:
        return gguf_model_dir(cfg.model.gguf, ROOT / "runs" / "base")
    return base_model_dir(cfg.model_copy(update={"output_dir": str(tmp)}))


def _tokens_per_second(cfg, model_dir: Path, repeats: int) -> tuple[dict, dict, float]:  # noqa: ANN001
    """({engine: [tok/s per repeat]}, {dtype: [sync seconds]}, ideal matmul s per token)."""
    import torch
    from utilization import _matmul_seconds, _recorder

    from grpo.data.sets import training_sets
    from grpo.models.generate import generate
    from grpo.models.llamacpp_engine import LlamaCppEngine
    from grpo.models.loading import eos_token_ids, load_model, load_tokenizer
    from grpo.models.prompts import encode_prompts

    g = cfg.grpo
    tok = load_tokenizer(model_dir)
    model = load_model(model_dir, "float32", trainable=False)
    rows = training_sets(cfg)["train"][: g.prompts_per_step]
    ids, mask = encode_prompts(tok, [r["prompt"] for r in rows], cfg, torch.device("cpu"))
    settings = dict(
        num_generations=g.num_generations, max_completion_length=g.max_completion_length,
        eos_token_id=eos_token_ids(tok, model), pad_token_id=tok.pad_token_id,
        temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
    )  # fmt: skip
    threads = torch.get_num_threads()
    llama = {d: LlamaCppEngine(model, tok, dtype=d, threads=threads)
             for d in ("float32", "float16")}  # fmt: skip
    try:

        def run(engine: str):  # noqa: ANN202
            if engine.startswith("llama_cpp"):
                return llama[engine.split()[1]].generate(ids, mask, **settings)
            return generate(model, ids, mask, engine=engine, **settings)

        for engine in ENGINES:  # warm-up: first calls allocate
            run(engine)
        speed: dict[str, list[float]] = {e: [] for e in ENGINES}
        for r in range(repeats):
            for engine in ENGINES:
                torch.manual_seed(r)
                t = time.perf_counter()
                ro = run(engine)
                speed[engine].append(float(ro.completion_mask.sum()) / (time.perf_counter() - t))
        sync = {d: [e.sync(model) for _ in range(repeats)] for d, e in llama.items()}
    finally:
        for e in llama.values():
            e.close()
    # the fast sampler's matmuls for one call, timed as torch.matmul alone, per token
    torch.manual_seed(0)
    with _recorder() as rec:
        ro = generate(model, ids, mask, engine="fast", **settings)
    ideal = sum(_matmul_seconds(s) * c for s, c in rec.shapes.items())
    return speed, sync, ideal / float(ro.completion_mask.sum())


def _steps_per_hour(
    config: str | None, sets: list[str], tmp: Path, steps: int, repeats: int
) -> dict:
    """{loop: [median step seconds per repeat]} of fresh trainer runs, loops alternated."""
    import torch

    from grpo.config import load_config
    from grpo.engine.loop import Trainer

    out: dict[str, list[float]] = {name: [] for name in LOOPS}
    threads = torch.get_num_threads()
    for r in range(repeats):
        for name, extra in LOOPS.items():
            run = tmp / f"{name.replace(' ', '_').replace(',', '')}-{r}"
            cfg = load_config(config, [f"output_dir={tmp}", "grpo.eval_every=0",
                                       f"grpo.steps={steps}", f"grpo.checkpoint_every={steps}",
                                       "data.num_select=0", *sets, *extra])  # fmt: skip
            try:
                Trainer(cfg, _model_dir(cfg, tmp), run).train(progress=False)
            finally:
                torch.set_num_threads(threads)  # async took half for its sampler
            times = [json.loads(x)["step_time"] for x in (run / "metrics.jsonl").open()]
            out[name].append(statistics.median(times))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", help="YAML config (default: the embedded default run)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="trainer steps per loop and repeat")
    p.add_argument("--set", action="append", default=[], help="config override key=value")
    p.add_argument("--out", help="append the tables to this markdown file")
    a = p.parse_args()
    # every loop and repeat trains and checkpoints a model here: gigabytes for SmolLM2
    tmp = Path(tempfile.mkdtemp(prefix="grpo-engine-"))
    try:
        _measure(a, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _measure(a: argparse.Namespace, tmp: Path) -> None:
    """The three tables (sampling speed, weight sync, steps per hour), printed and appended to
    --out, from runs under `tmp`."""
    import torch

    from grpo.config import load_config

    cfg = load_config(a.config, [f"output_dir={tmp}", *a.set])
    model_dir = _model_dir(cfg, tmp)
    speed, sync, ideal_per_token = _tokens_per_second(cfg, model_dir, a.repeats)
    loops = _steps_per_hour(a.config, a.set, tmp, a.steps, a.repeats) if a.steps else {}
    g = cfg.grpo
    base = statistics.median(speed["fast"])
    lines = [
        f"### {cfg.run_name}: {g.prompts_per_step} prompts x {g.num_generations}, up to "
        f"{g.max_completion_length} tokens, T = {g.temperature}",
        "",
        f"`python benchmarks/engine.py{' --config ' + a.config if a.config else ''} --repeats "
        f"{a.repeats} --steps {a.steps}{''.join(' --set ' + x for x in a.set)}`; "
        f"{torch.get_num_threads()} threads, "
        f"{Path(str(model_dir)).name}; medians of {a.repeats} alternated repeats.",
        "",
        "| engine | completion tokens/s | x fast | share of matmul speed |",
        "|---|---|---|---|",
    ]
    for e in ENGINES:
        m = statistics.median(speed[e])
        lines.append(f"| {e} | {m:.0f} | {m / base:.2f}x | {m * ideal_per_token:.0%} |")
    lines += ["", "| weight sync | seconds (median) |", "|---|---|"]
    lines += [f"| {d} | {statistics.median(s):.3f} |" for d, s in sync.items()]
    if loops:
        ref = statistics.median(loops["policy (fast), sync"])
        lines += ["", "| loop | step seconds (median) | steps per hour | x policy sync |",
                  "|---|---|---|---|"]  # fmt: skip
        for name, times in loops.items():
            s = statistics.median(times)
            lines.append(f"| {name} | {s:.2f} | {3600 / s:.0f} | {ref / s:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    print("raw:", json.dumps({"speed": speed, "sync": sync, "loops": loops}))
    if a.out:
        with open(a.out, "a") as f:
            f.write("\n" + text)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
