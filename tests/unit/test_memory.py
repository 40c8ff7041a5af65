"""The lower bound on a rank's memory (grpo.launch.memory), by hand."""

import pytest

from grpo.launch.memory import GIB, memory_error, model_dims, rank_bytes
from tests.helpers import small_config


def test_the_small_test_model_by_hand(tmp_path):
    cfg = small_config(tmp_path)  # hidden 32, 2 layers, 2 heads (head 16), 1 KV head, mlp 64
    dims = model_dims(cfg)
    # embeddings 104 x 32, per layer q+o 2*32*32, k+v 2*32*16, mlp 3*32*64
    assert dims.params == 104 * 32 + 2 * (2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64) == 21760
    got = rank_bytes(cfg, dims, world=1)
    # 2 prompts x 4 completions, 24 tokens, fp32; micro-batch 256 > 8: all 8 in one
    assert got == {
        "weights and optimizer": 21760 * (4 + 4 + 8),
        "sampler KV cache": 2 * 2 * 1 * 16 * 8 * 24 * 4,
        "logits": 8 * 24 * 104 * 4,
    }
    # two ranks under ZeRO-2: half the completions each, gradients and moments split
    two = small_config(tmp_path, "deepspeed.nproc=2", "deepspeed.zero_stage=2")
    got2 = rank_bytes(two, dims, world=2)
    assert got2["weights and optimizer"] == 21760 * (4 + 12 // 2)
    assert got2["sampler KV cache"] == got["sampler KV cache"] // 2
    assert memory_error(cfg, 1) is None
    # LoRA: the weights whole, the adapters' training state left out of the bound
    lora = small_config(tmp_path, "model.lora.enabled=true")
    assert rank_bytes(lora, dims, world=1)["weights and optimizer"] == 21760 * 4
    # the update's LM head in chunks of at most the logits budget (0.01 MiB = 10485 bytes
    # < 8 x 24 x 104 x 4 = 79872); the sampler's 8 x 104 x 4 are smaller still
    capped = small_config(tmp_path, "grpo.logits_budget_mib=0.01")
    assert rank_bytes(capped, dims, world=1)["logits"] == 10485
    # ZeRO-3 turns the chunks off: the whole micro-batch's logits again
    zero3 = small_config(tmp_path, "grpo.logits_budget_mib=0.01", "deepspeed.zero_stage=3")
    assert rank_bytes(zero3, dims, world=1)["logits"] == 8 * 24 * 104 * 4


def test_a_count_with_zeros_too_many_is_refused_with_the_numbers(tmp_path):
    cfg = small_config(tmp_path, "grpo.num_generations=20000", "grpo.max_completion_length=4096")
    err = memory_error(cfg, 1)
    kv = 2 * 2 * 1 * 16 * 2 * 20000 * 4096 * 4 / GIB
    assert err and f"sampler KV cache {kv:.1f}" in err and "grpo.num_generations" in err


def test_absurd_counts_are_refused_by_name(tmp_path):
    from grpo.config import ConfigError

    for key, value in [("steps", 10**12), ("max_completion_length", 10**9)]:
        with pytest.raises(ConfigError, match=key):
            small_config(tmp_path, f"grpo.{key}={value}")
    with pytest.raises(ConfigError, match="3,200,000 completions a step"):
        small_config(tmp_path, "grpo.num_generations=100000", "grpo.prompts_per_step=32")
