"""The lean sampler (grpo.models.sampler) against the transformers model it reads the weights of."""

import pytest
import torch

from grpo.algo.logprobs import token_logprobs
from grpo.models import sampler
from grpo.models.forward import completion_logits
from grpo.models.generate import generate, resolve_engine

EOS, PAD = 1, 0


def _model(kind: str, vocab: int = 16):
    import transformers

    torch.manual_seed(0)
    common = dict(
        vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=48, max_position_embeddings=128,
        pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None,
    )  # fmt: skip
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        return transformers.Qwen2ForCausalLM(cfg).eval()
    cfg = transformers.LlamaConfig(**common, attention_bias=True, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg).eval()


def _prompts():
    """Left-padded prompts of lengths 5, 3 and 1 (token ids >= 2: never PAD or EOS)."""
    ids = torch.tensor([[2, 3, 4, 5, 6], [0, 0, 7, 8, 9], [0, 0, 0, 0, 10]])
    return ids, (ids != PAD).long()


def _teacher_forced(model, ro, temperature):
    with torch.no_grad():
        logits = completion_logits(
            model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask
        )
    return token_logprobs(logits, ro.completion_ids, temperature) * ro.completion_mask


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("engine", ["fast", "hf"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampling_logps_match_a_teacher_forced_forward(kind, engine, temperature):
    model = _model(kind)
    ids, mask = _prompts()
    torch.manual_seed(1)
    ro = generate(
        model, ids, mask, num_generations=8, max_completion_length=20, eos_token_id=EOS,
        pad_token_id=PAD, temperature=temperature, engine=engine,
    )  # fmt: skip
    lengths = ro.lengths
    # with 16 tokens, EOS comes often: rows end at different steps (compaction is exercised)
    assert lengths.min() < lengths.max()
    # truncated: exactly the rows without an EOS, and those ran the whole budget (both engines)
    assert torch.equal(ro.truncated, ~(ro.completion_ids == EOS).any(1))
    assert (lengths[ro.truncated] == 20).all()
    torch.testing.assert_close(
        ro.sampling_logps, _teacher_forced(model, ro, temperature), atol=2e-5, rtol=1e-4
    )
    after_eos = ro.completion_mask == 0
    assert (ro.completion_ids[after_eos] == PAD).all()
    assert (ro.sampling_logps[after_eos] == 0).all()


@pytest.mark.parametrize("engine", ["fast", "hf"])
def test_top_k_top_p_log_probs_are_over_what_the_sampler_kept(engine):
    """The sampler records log mu over the truncated distribution it drew from; the trainer's
    forward with the same truncation gives the same numbers, and no drawn token is outside."""
    from grpo.algo.logprobs import truncated_token_logprobs
    from grpo.models.forward import completion_logprobs

    model = _model("qwen2", vocab=64)
    ids, mask = _prompts()
    torch.manual_seed(2)
    ro = generate(model, ids, mask, num_generations=4, max_completion_length=12,
                  eos_token_id=EOS, pad_token_id=PAD, temperature=0.7, top_k=8, top_p=0.9,
                  engine=engine)  # fmt: skip
    logits = completion_logits(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids,
                               ro.completion_mask)  # fmt: skip
    want, outside = truncated_token_logprobs(logits, ro.completion_ids, 0.7, 8, 0.9)
    real = ro.completion_mask.bool()
    assert not outside[real].any()
    torch.testing.assert_close(ro.sampling_logps, want * ro.completion_mask, atol=2e-5,
                               rtol=1e-4)  # fmt: skip
    # above the whole distribution's log-prob: the kept mass is below 1
    full = token_logprobs(logits, ro.completion_ids, 0.7)
    assert (ro.sampling_logps[real] >= full[real] - 1e-5).all()
    assert (ro.sampling_logps[real] > full[real] + 1e-4).any()
    out = torch.zeros_like(real)
    got, _ = completion_logprobs(
        model,
        ro.prompt_ids,
        ro.prompt_mask,
        ro.completion_ids,
        ro.completion_mask,
        0.7,
        truncation=(8, 0.9),
        outside=out,
    )
    torch.testing.assert_close(got, ro.sampling_logps, atol=2e-5, rtol=1e-4)
    assert not out.any()


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_greedy_fast_equals_greedy_transformers(kind):
    model = _model(kind, vocab=64)
    ids, mask = _prompts()
    kw = dict(num_generations=1, max_completion_length=24, eos_token_id=EOS, pad_token_id=PAD,
              do_sample=False)  # fmt: skip
    fast = generate(model, ids, mask, engine="fast", **kw)
    hf = generate(model, ids, mask, engine="hf", **kw)
    assert torch.equal(fast.completion_ids, hf.completion_ids)
    assert torch.equal(fast.completion_mask, hf.completion_mask)


def test_same_seed_same_samples_and_top_k_is_respected():
    model = _model("qwen2", vocab=64)
    ids, mask = _prompts()
    kw = dict(max_new_tokens=16, eos_token_id=EOS, pad_token_id=PAD, top_k=3)
    torch.manual_seed(5)
    a, la = sampler.sample(model, ids, mask, **kw)
    torch.manual_seed(5)
    b, lb = sampler.sample(model, ids, mask, **kw)
    assert torch.equal(a, b) and torch.equal(la, lb)
    # every sampled token is among the 3 most likely under the model at its position
    logits = completion_logits(model, ids, mask, a, (a != PAD).long())
    top3 = logits.topk(3, -1).indices
    real = a != PAD
    assert (top3 == a.unsqueeze(-1)).any(-1)[real].all()


def test_inverse_cdf_sampling_follows_the_probabilities():
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.0, 0.3, 0.2]).expand(40000, 4)
    counts = torch.bincount(sampler.sample_tokens(probs), minlength=4).float() / 40000
    assert counts[1] == 0  # a zero-probability token is never drawn
    torch.testing.assert_close(counts, torch.tensor([0.5, 0.0, 0.3, 0.2]), atol=0.01, rtol=0)


def test_top_p_keeps_the_smallest_set_reaching_p():
    # probs 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps the first two (0.5 < 0.7 <= 0.8)
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = sampler.filter_logits(logits, top_p=0.7)
    assert torch.isfinite(kept).tolist() == [[True, True, False, False]]
    # top_p smaller than the top token's mass still keeps the top token
    assert torch.isfinite(sampler.filter_logits(logits, top_p=0.1)).sum() == 1


def test_unsupported_architecture_is_named_and_auto_uses_transformers():
    import transformers

    cfg = transformers.GPT2Config(vocab_size=16, n_embd=16, n_layer=1, n_head=2, n_positions=32)
    gpt2 = transformers.GPT2LMHeadModel(cfg).eval()
    assert resolve_engine(gpt2, "auto") == "hf"
    assert resolve_engine(_model("qwen2"), "auto") == "fast"
    # not compared with transformers on a GPU yet: auto keeps generate() there
    meta = _model("qwen2").to("meta")
    assert resolve_engine(meta, "auto") == "hf" and resolve_engine(meta, "fast") == "fast"
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        resolve_engine(gpt2, "fast")
    with pytest.raises(ValueError, match="expected auto, fast or hf"):
        resolve_engine(gpt2, "vllm")


@pytest.mark.parametrize("engine", ["fast", "hf"])
def test_every_eos_id_ends_a_completion(engine):
    """A model with two EOS ids (Qwen2.5-Instruct: <|im_end|> and <|endoftext|>): a completion
    that emits the second one stops there, and its mask ends there."""
    from grpo.models.loading import eos_token_ids

    model = _model("qwen2", vocab=64)
    ids, mask = _prompts()
    ids, mask = ids[:1], mask[:1]  # one row: the same seed draws the same tokens up to a stop
    kw = dict(num_generations=1, max_completion_length=16, pad_token_id=PAD)
    torch.manual_seed(3)
    free = generate(model, ids, mask, eos_token_id=EOS, engine=engine, **kw)
    row = free.completion_ids[0].tolist()
    # a token the row first emits at position k >= 2
    k = next(i for i in range(2, len(row)) if row[i] not in row[:i] and row[i] != EOS)
    second = row[k]
    model.generation_config.eos_token_id = [EOS, second]
    tok = type("Tok", (), {"eos_token_id": EOS})()
    eos = eos_token_ids(tok, model)
    assert eos == [EOS, second]
    torch.manual_seed(3)
    ro = generate(model, ids, mask, eos_token_id=eos, engine=engine, **kw)
    assert ro.completion_ids[0, : k + 1].tolist() == row[: k + 1]
    assert ro.lengths[0].item() == k + 1 and not ro.truncated[0]
    assert (ro.completion_ids[0, k + 1 :] == PAD).all()
    # with only the tokenizer's EOS the same row runs on past it
    assert free.lengths[0].item() > k + 1 or free.truncated[0]
