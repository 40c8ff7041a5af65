"""The GPU check: one script, a few minutes, for a machine with a GPU (and on the CPU in CI).

    python benchmarks/gpu_check.py [--out benchmarks/GPU.md]   # a GPU: Qwen2.5-0.5B shape, bf16
    python benchmarks/gpu_check.py --smoke --out /tmp/smoke.md  # CPU, tiny shape (CI)

On a model with Qwen2.5-0.5B's dimensions (random weights: no download) it measures
1. for each sampling engine (fast = grpo.models.sampler, hf = transformers generate): the gap
   between the log-probs recorded while sampling and a teacher-forced forward of the same
   tokens (mean and max absolute difference over completion tokens), and completion tokens/s;
2. the peak accelerator memory of one GRPO update (forward + backward + optimizer step through
   the DeepSpeed engine, ZeRO-0) on those rollouts;
3. what asynchronous rollouts (grpo.async_rollouts) give with the sampler on a device of its
   own: a synchronous step takes sampling + update, a split one max(sampling, update); the
   ratio, for the engine `auto` picks on this device.
It writes a markdown table (--out) and prints JSON. `model.generation_engine: auto` keeps
transformers generate() on GPUs until this comparison has been made there.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QWEN05B = dict(
    hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
    intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768,
    rope_theta=1_000_000.0, tie_word_embeddings=True,
)  # fmt: skip
SMOKE = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=128, vocab_size=512, max_position_embeddings=1024, tie_word_embeddings=True,
)  # fmt: skip


def main() -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo.algo.logprobs import token_logprobs
    from grpo.config import load_config
    from grpo.engine.deepspeed_setup import build_engine
    from grpo.engine.distributed import init_distributed
    from grpo.engine.schedules import lr_lambda
    from grpo.engine.update import UpdatePlan, update_policy
    from grpo.models.forward import completion_logits
    from grpo.models.generate import generate

    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true", help="tiny shape on the CPU (CI)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--lora", type=int, default=0, metavar="R",
                   help="a LoRA policy of rank R (adapters moved off zero): the fast "
                   "sampler merges them, generate runs them unmerged; the update trains "
                   "them only")  # fmt: skip
    p.add_argument("--out", help="markdown file to write the table to")
    a = p.parse_args()
    cuda = torch.cuda.is_available() and not a.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if a.smoke:
        a.prompts, a.group, a.prompt_len, a.new_tokens = 2, 4, 16, 12
    shape = SMOKE if a.smoke else QWEN05B
    torch.manual_seed(0)
    config = Qwen2Config(**shape, bos_token_id=None, eos_token_id=0, pad_token_id=1)
    model = Qwen2ForCausalLM(config).to(device=device, dtype=dtype)
    if a.lora:
        from grpo.config import LoRAConfig
        from grpo.models import lora

        model = lora.wrap(model, LoRAConfig(r=a.lora, alpha=2 * a.lora))
        with torch.no_grad():  # B = 0 would sample the base model: move the adapters off it
            for name, w in model.named_parameters():
                if "lora_B" in name:
                    w.normal_(0, 0.01)
    # random prompts, never the EOS / pad ids; EOS is rare in a random model: long completions
    prompts = torch.randint(2, shape["vocab_size"], (a.prompts, a.prompt_len), device=device)
    mask = torch.ones_like(prompts)
    result: dict = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "shape": "smoke" if a.smoke else "Qwen2.5-0.5B",
        "params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "lora_r": a.lora or None,
        "rollout": f"{a.prompts} prompts x {a.group}, prompt {a.prompt_len}, new {a.new_tokens}",
        "engines": {},
    }
    rollouts = {}
    for engine in ("fast", "hf"):
        torch.manual_seed(1)
        generate(model, prompts[:1], mask[:1], num_generations=1, max_completion_length=4,
                 eos_token_id=0, pad_token_id=1, engine=engine)  # fmt: skip  # warm-up
        _sync(cuda)
        t0 = time.perf_counter()
        ro = generate(model, prompts, mask, num_generations=a.group,
                      max_completion_length=a.new_tokens, eos_token_id=0, pad_token_id=1,
                      engine=engine)  # fmt: skip
        _sync(cuda)
        seconds = time.perf_counter() - t0
        with torch.no_grad():
            gaps = []
            for s in range(0, ro.completion_ids.shape[0], 16):
                sl = slice(s, s + 16)
                logits = completion_logits(
                    model, ro.prompt_ids[sl], ro.prompt_mask[sl], ro.completion_ids[sl],
                    ro.completion_mask[sl],
                )  # fmt: skip
                tf = token_logprobs(logits, ro.completion_ids[sl])
                m = ro.completion_mask[sl].bool()
                gaps.append((ro.sampling_logps[sl] - tf).abs()[m].float())
        gap = torch.cat(gaps)
        tokens = int(ro.completion_mask.sum())
        result["engines"][engine] = {
            "tokens_per_s": round(tokens / seconds, 1),
            "seconds": round(seconds, 2),
            "logp_gap_mean": float(gap.mean()),
            "logp_gap_max": float(gap.max()),
        }
        rollouts[engine] = ro
    # one GRPO update through the DeepSpeed engine on the fast engine's rollout
    cfg = load_config(None, [
        f"device={'cuda' if cuda else 'cpu'}", f"model.dtype={'bfloat16' if cuda else 'float32'}",
        f"grpo.num_generations={a.group}", f"grpo.prompts_per_step={a.prompts}",
        f"grpo.max_completion_length={a.new_tokens}", "grpo.micro_batch_size=16",
    ])  # fmt: skip
    rank, world = init_distributed(600)
    ro = rollouts["fast"]
    n = ro.completion_ids.shape[0]
    micro = min(cfg.grpo.micro_batch_size, n)
    engine, _ = build_engine(
        model, cfg, micro_batch=micro, grad_accum=-(-n // micro), lr=1e-6, weight_decay=0.0,
        max_grad_norm=1.0, lr_fn=lr_lambda(0, 1, "constant"),
    )  # fmt: skip
    buckets, budget = cfg.forward_layout()
    plan = UpdatePlan(micro=micro, n_micro=-(-n // micro), world=world, zero_stage=0,
                      device=device, bucket_tokens=buckets, logits_budget_mib=budget)  # fmt: skip
    adv = torch.randn(n, device=device).unsqueeze(1).expand(ro.completion_ids.shape)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    m = update_policy(engine, cfg.grpo, plan, ro, adv, None)
    _sync(cuda)
    result["update"] = {
        "seconds": round(time.perf_counter() - t0, 2),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        "grad_norm": m["grad_norm"],
    }
    from grpo.models.generate import resolve_engine

    picked = resolve_engine(model, "auto")
    sample_s, update_s = result["engines"][picked]["seconds"], result["update"]["seconds"]
    result["async_split"] = {
        "engine": picked, "sync_step_s": round(sample_s + update_s, 2),
        "split_step_s": round(max(sample_s, update_s), 2),
        "ratio": round((sample_s + update_s) / max(sample_s, update_s), 2),
    }  # fmt: skip
    print(json.dumps(result, indent=2))
    if a.out:
        Path(a.out).write_text(_markdown(result))


def _sync(cuda: bool) -> None:
    import torch

    if cuda:
        torch.cuda.synchronize()


def _markdown(r: dict) -> str:
    lines = [
        "# GPU check (benchmarks/gpu_check.py)",
        "",
        f"{r['device']}, {r['dtype']}, {r['shape']} shape ({r['params_M']}M parameters, random "
        f"weights), {r['rollout']}; "
        + (
            f"LoRA r={r['lora_r']} ({r['trainable'] / 1e6:.2f}M trainable)."
            if r["lora_r"]
            else "full fine-tuning."
        ),
        "",
        "| engine | completion tokens/s | log-prob gap to a teacher-forced forward (mean / max) |",
        "|---|---|---|",
    ]
    for name, e in r["engines"].items():
        lines.append(
            f"| {name} | {e['tokens_per_s']} | {e['logp_gap_mean']:.2e} / {e['logp_gap_max']:.2e} |"
        )
    u = r["update"]
    peak = f"{u['peak_gib']} GiB" if u["peak_gib"] is not None else "not measured (CPU)"
    lines += ["", f"One GRPO update (ZeRO-0): {u['seconds']} s, peak memory {peak}.", ""]
    x = r["async_split"]
    lines += [f"Asynchronous rollouts with the sampler ({x['engine']}) on a device of its own: a "
              f"step of {x['split_step_s']} s instead of {x['sync_step_s']} s, {x['ratio']}x the "
              "steps per hour (before the weights' transfer).", ""]  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
