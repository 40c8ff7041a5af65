"""The GRPO trainer with a LoRA policy (model.lora) on the tiny Qwen2: only adapters learn, the
reference is the policy with its adapters off, checkpoints hold the adapters and resume exactly,
and the run writes a merged model and its adapter."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from grpo.launch.paths import base_model_dir
from tests.helpers import fixed_rollout, per_token, small_config
from tests.unit.test_sampler import _teacher_forced

pytestmark = pytest.mark.slow
LORA = ["model.lora.enabled=true", "model.lora.r=2", "model.lora.alpha=4"]


def _logps(model, ro):
    return _teacher_forced(model, ro, 1.0)


def test_lora_update_moves_only_adapters_and_the_reference_stays_the_base(tmp_path):
    from grpo.engine.loop import Trainer
    from grpo.models.loading import load_model

    cfg = small_config(tmp_path, *LORA, "grpo.beta=0.04", "grpo.lr=0.05", "grpo.warmup_steps=0",
                       "grpo.lr_schedule=constant")  # fmt: skip
    t = Trainer(cfg, base_model_dir(cfg), tmp_path / "grpo")
    # one copy of the base weights: pi_ref is the policy module itself, adapters off
    assert t.reference.model is t.engine.module
    assert t.params["trainable"] < t.params["total"] / 10
    ro = fixed_rollout(t.tok, ["<think>4+2=6</think><answer>46</answer>", "<answer>99</answer>"])
    alone = load_model(base_model_dir(cfg), trainable=False).eval()
    base_logps = _logps(alone, ro)
    before = {n: p.detach().clone() for n, p in t.engine.module.named_parameters()}
    assert torch.equal(t.reference.logps(ro, micro=2) * ro.completion_mask, base_logps)
    for _ in range(3):  # B starts at 0: the first step moves B only, the next ones A too
        m = t.update(ro, per_token(torch.tensor([1.0, -1.0]), ro), t.reference.logps(ro, 2))
    after = dict(t.engine.module.named_parameters())
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    assert moved and all("lora_" in n for n in moved)
    assert any("lora_A" in n for n in moved) and any("lora_B" in n for n in moved)
    # the reference did not move with the policy; the policy did, towards the rewarded answer
    assert torch.equal(t.reference.logps(ro, micro=2) * ro.completion_mask, base_logps)
    policy = _logps(t.engine.module, ro)
    assert policy[0].sum() > base_logps[0].sum() and policy[1].sum() < base_logps[1].sum()
    assert m["kl"] > 0


def test_lora_run_resumes_bit_identically_and_saves_merged_model_and_adapter(tmp_path):
    from grpo.engine.loop import Trainer
    from grpo.models import lora
    from grpo.models.loading import load_model, load_tokenizer

    # the untrained model is never right: the length penalty gives its groups unequal rewards
    cfg = small_config(tmp_path, *LORA, "grpo.steps=4", "grpo.checkpoint_every=2",
                       "grpo.keep_checkpoints=2", "grpo.lr=0.02",
                       "grpo.reward_funcs=[accuracy,soft_overlong]", "grpo.reward_weights=[1,1]",
                       "grpo.overlong_cache=20")  # fmt: skip
    base = base_model_dir(cfg)
    whole = tmp_path / "whole"
    Trainer(cfg, base, whole).train(progress=False)
    # checkpoints hold the adapters and optimizer state, not the frozen base weights (DeepSpeed
    # drops frozen parameters by their named_parameters name, so the tied LM head, an alias of
    # the embeddings, is the one frozen tensor left)
    states = torch.load(whole / "checkpoints" / "step0000002" / "mp_rank_00_model_states.pt",
                        weights_only=False)  # fmt: skip
    frozen = [k for k in states["module"] if "lora_" not in k]
    assert frozen == ["base_model.model.lm_head.weight"], frozen
    assert sum("lora_" in k for k in states["module"]) == 2 * 2 * 7  # A, B x 2 layers x 7

    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(whole / "checkpoints" / "step0000002",
                    resumed / "checkpoints" / "step0000002")  # fmt: skip
    (resumed / "checkpoints" / "latest").write_text("step0000002")
    shutil.copy(whole / "metrics.jsonl", resumed / "metrics.jsonl")
    summary = Trainer(cfg, base, resumed).train(resume=True, progress=False)
    assert summary["start_step"] == 2
    for name in ("policy/model.safetensors", "adapter/adapter_model.safetensors"):
        a, b = load_file(whole / name), load_file(resumed / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    adapter = load_file(whole / "adapter" / "adapter_model.safetensors")
    assert all(adapter[k].abs().max() > 0 for k in adapter if "lora_B" in k)  # it learnt

    # the merged policy is a plain model directory; the adapter with its base is the same policy
    assert json.loads((whole / "adapter" / "adapter_config.json").read_text())["r"] == 2
    merged = load_model(whole / "policy", trainable=False).eval()
    from_adapter = lora.load_merged(whole / "adapter", None).eval()
    plain = load_model(base, trainable=False).eval()
    tok_ro = fixed_rollout(load_tokenizer(base), ["46", "4"])
    torch.testing.assert_close(_logps(from_adapter, tok_ro), _logps(merged, tok_ro))
    assert not torch.allclose(_logps(plain, tok_ro), _logps(merged, tok_ro))
