"""LoRA policies (grpo.models.lora): sampling the adapted policy, the reference as the adapters
switched off, merged and adapter-only saves, and refused settings."""

import pytest
import torch

from grpo.config import ConfigError, LoRAConfig, load_config
from grpo.models import lora
from grpo.models.generate import generate
from tests.unit.test_sampler import EOS, PAD, _model, _prompts, _teacher_forced


def _adapted(kind: str, **kw) -> torch.nn.Module:
    """A LoRA policy whose adapters (and, with train_embeddings, embeddings) moved away from
    the base: B = 0 at the start would make every adapter test pass trivially."""
    model = lora.wrap(_model(kind), LoRAConfig(r=4, alpha=8, **kw))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("engine", ["fast", "hf"])
@pytest.mark.parametrize("train_embeddings", [False, True])
def test_sampling_the_adapted_policy_matches_its_teacher_forced_forward(
    kind, engine, train_embeddings
):
    model = _adapted(kind, train_embeddings=train_embeddings)
    ids, mask = _prompts()
    torch.manual_seed(1)
    ro = generate(model, ids, mask, num_generations=8, max_completion_length=20,
                  eos_token_id=EOS, pad_token_id=PAD, temperature=0.8, engine=engine)  # fmt: skip
    forced = _teacher_forced(model, ro, 0.8)
    torch.testing.assert_close(ro.sampling_logps, forced, atol=2e-5, rtol=1e-4)
    # the adapters matter: the base model gives these tokens other log-probs
    with lora.adapters_off(model):
        base = _teacher_forced(model, ro, 0.8)
    assert (base - forced).abs().max() > 1e-2


def test_fast_sampler_reads_merged_weights_the_same_as_peft_merge():
    model = _adapted("llama", train_embeddings=True)
    layer = lora.base_model(model).model.layers[0].self_attn.q_proj
    merged = lora.effective_weight(layer).detach().clone()
    model.merge_adapter()
    try:
        torch.testing.assert_close(layer.base_layer.weight.detach(), merged)
        # merged into the base: effective_weight must not add the adapter a second time
        torch.testing.assert_close(lora.effective_weight(layer).detach(), merged)
    finally:
        model.unmerge_adapter()
    with lora.adapters_off(model):
        assert torch.equal(lora.effective_weight(layer), layer.base_layer.weight)


def test_adapters_off_gives_the_base_model_loaded_alone():
    base = _model("qwen2")
    model = _adapted("qwen2")  # the same seed: the same base weights
    ids, mask = _prompts()
    ro = generate(base, ids, mask, num_generations=2, max_completion_length=12,
                  eos_token_id=EOS, pad_token_id=PAD, engine="hf")  # fmt: skip
    with lora.adapters_off(model):
        off = _teacher_forced(model, ro, 1.0)
    assert torch.equal(off, _teacher_forced(base, ro, 1.0))
    on = _teacher_forced(model, ro, 1.0)
    assert (on - off).abs().max() > 1e-2


def test_merged_and_adapter_saves_load_back_to_the_same_policy(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1}, "<pad>")),
        pad_token="<pad>", eos_token="<eos>",
    )  # fmt: skip
    base_dir = tmp_path / "base"
    _model("llama").save_pretrained(base_dir)
    tok.save_pretrained(base_dir)
    from grpo.models.loading import load_model

    model = lora.wrap(load_model(base_dir), LoRAConfig(r=4, alpha=8)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.3)
    lora.save_merged_and_adapter(model, tok, tmp_path / "policy", tmp_path / "adapter")
    assert lora.is_adapter_dir(tmp_path / "adapter")
    assert lora.adapter_base(tmp_path / "adapter") == str(base_dir.resolve())
    # the adapter is small: no base weight in it
    size = sum(f.stat().st_size for f in (tmp_path / "adapter").iterdir())
    assert size < sum(f.stat().st_size for f in (tmp_path / "policy").iterdir()) / 2
    ids, mask = _prompts()
    ro = generate(model, ids, mask, num_generations=2, max_completion_length=12,
                  eos_token_id=EOS, pad_token_id=PAD, engine="hf")  # fmt: skip
    want = _teacher_forced(model, ro, 1.0)
    merged = load_model(tmp_path / "policy", trainable=False).eval()
    torch.testing.assert_close(_teacher_forced(merged, ro, 1.0), want, atol=1e-5, rtol=1e-5)
    from_adapter = lora.load_merged(tmp_path / "adapter", None).eval()
    torch.testing.assert_close(_teacher_forced(from_adapter, ro, 1.0), want, atol=1e-5, rtol=1e-5)
    # saving left the training model unmerged, with its adapters on
    assert not lora.base_model(model).model.layers[0].self_attn.q_proj.merged
    torch.testing.assert_close(_teacher_forced(model, ro, 1.0), want)


def test_adapter_of_another_base_is_refused_by_name(tmp_path):
    model = lora.wrap(_model("llama"), LoRAConfig(r=4))
    model.save_pretrained(tmp_path / "adapter")
    import transformers

    other = tmp_path / "other"  # the same module names, another width
    cfg = transformers.LlamaConfig(vocab_size=16, hidden_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=48)  # fmt: skip
    transformers.LlamaForCausalLM(cfg).save_pretrained(other)
    with pytest.raises(lora.AdapterDirError, match="does not fit the base model"):
        lora.load_merged(tmp_path / "adapter", other)
    with pytest.raises(lora.AdapterDirError, match="not a directory here"):
        lora.load_merged(tmp_path / "adapter", tmp_path / "missing")


def test_unknown_target_module_is_named():
    with pytest.raises(ValueError, match=r"\['wq'\] not found in this qwen2 model"):
        lora.wrap(_model("qwen2"), LoRAConfig(target_modules=["q_proj", "wq"]))


def test_only_adapters_are_trainable():
    model = lora.wrap(_model("qwen2"), LoRAConfig(r=4))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    # 2 layers x 7 linears, A [4, in] and B [out, 4]; hidden 32, kv 16, mlp 48
    shapes = {"q": (32, 32), "k": (32, 16), "v": (32, 16), "o": (32, 32), "gate": (32, 48),
              "up": (32, 48), "down": (48, 32)}  # fmt: skip
    expected = 2 * sum(4 * (i + o) for i, o in shapes.values())
    assert lora.parameter_counts(model)["trainable"] == expected


@pytest.mark.parametrize(
    "override, message",
    [
        ("deepspeed.zero_stage=3", "zero_stage 3 is refused"),
        ("model.lora.target_modules=[lm_head]", "train_embeddings=true"),
        ("model.lora.r=0", "model.lora.r"),
        ("model.lora.dropout=1", "model.lora.dropout"),
        ("model.lora.target_modules=[q_proj,q_proj]", "distinct"),
    ],
)
def test_impossible_lora_settings_are_refused_by_name(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["model.lora.enabled=true", override])
