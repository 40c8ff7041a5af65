"""The training forward (grpo.models.forward.completion_logprobs): length buckets and the
chunked LM head give the log-probs, entropy and gradients of one padded forward."""

import contextlib

import pytest
import torch

from grpo.algo.logprobs import token_entropy, token_logprobs
from grpo.models import forward
from grpo.models.forward import (
    chunk_rows,
    completion_logits,
    completion_logprobs,
    length_buckets,
    relayout,
)
from tests.unit.test_sampler import _model

# rows with prompts of 5, 3, 1 and 2 tokens (left-padded) and completions of 4, 0, 2 and 6
PROMPT_LENGTHS, COMPLETION_LENGTHS = (5, 3, 1, 2), (4, 0, 2, 6)


def _batch(vocab: int = 16):
    g = torch.Generator().manual_seed(3)
    n, p, c = len(PROMPT_LENGTHS), max(PROMPT_LENGTHS), max(COMPLETION_LENGTHS)
    pmask = torch.zeros(n, p, dtype=torch.long)
    cmask = torch.zeros(n, c, dtype=torch.long)
    for i, (pl, cl) in enumerate(zip(PROMPT_LENGTHS, COMPLETION_LENGTHS, strict=True)):
        pmask[i, p - pl :] = 1
        cmask[i, :cl] = 1
    pids = torch.randint(2, vocab, (n, p), generator=g) * pmask
    cids = torch.randint(2, vocab, (n, c), generator=g) * cmask
    return pids, pmask, cids, cmask


def test_length_buckets_group_longest_first_within_the_token_budget():
    lengths = torch.tensor([3, 9, 4, 9, 1, 5])
    # longest first (ties in row order); each group: rows x its first (longest) row <= 18
    groups = [g.tolist() for g in length_buckets(lengths, 18)]
    assert groups == [[1, 3], [5, 2, 0], [4]]
    # a row longer than the budget goes alone; 0 means one group of every row
    assert [g.tolist() for g in length_buckets(torch.tensor([30, 2]), 10)] == [[0], [1]]
    assert [g.tolist() for g in length_buckets(lengths, 0)] == [[1, 3, 5, 2, 0, 4]]


def test_relayout_puts_real_tokens_first_and_finds_each_completion_token():
    pids = torch.tensor([[0, 0, 7, 8], [5, 6, 7, 8]])
    pmask = (pids != 0).long()
    cids = torch.tensor([[9, 10, 0], [11, 0, 0]])
    cmask = (cids != 0).long()
    ids, attn, rows, cols, pred = relayout(pids, pmask, cids, cmask)
    assert ids.tolist() == [[7, 8, 9, 10, 0], [5, 6, 7, 8, 11]]
    assert attn.tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    # tokens 9 and 10 of row 0 sit at 2 and 3: predicted at 1 and 2; token 11 of row 1 at 4
    assert rows.tolist() == [0, 0, 1]
    assert cols.tolist() == [0, 1, 0]
    assert pred.tolist() == [1, 2, 3]


def _budget(rows: int, vocab: int = 16) -> float:
    """The logits budget (MiB) that makes head chunks of `rows` float32 rows; 0 for none."""
    return rows * 4 * vocab / 2**20


def test_chunk_rows_fit_the_budget_and_only_chunk_when_needed():
    # SmolLM2's 49,152-token vocabulary: 192 KiB a row, 1365 rows in 256 MiB
    assert chunk_rows(5000, 49152, 256) == 1365
    assert chunk_rows(1365, 49152, 256) == 0  # they all fit: no chunks, no recompute
    assert chunk_rows(5000, 104, 256) == 0  # the tiny model's vocabulary never chunks
    assert chunk_rows(5000, 49152, 0) == 0  # no limit
    assert chunk_rows(10, 16, _budget(3)) == 3


def _padded(model, batch, temperature):
    pids, pmask, cids, cmask = batch
    logits = completion_logits(model, pids, pmask, cids, cmask)
    lp = token_logprobs(logits, cids, temperature) * cmask
    return lp, token_entropy(logits, temperature) * cmask


def _grads(model, value: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    value.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize(("bucket_tokens", "head_chunk"), [(0, 0), (9, 0), (9, 3), (0, 4)])
def test_buckets_and_chunked_head_match_one_padded_forward(kind, bucket_tokens, head_chunk):
    model = _model(kind).train()
    batch = _batch()
    cmask = batch[3]
    want, want_ent = _padded(model, batch, 0.7)
    # a loss touching every token, with weights so that rows and positions are told apart
    weights = torch.arange(1, cmask.numel() + 1, dtype=torch.float32).view(cmask.shape)
    want_grads = _grads(model, (want * weights).sum() + want_ent.sum())
    got, got_ent = completion_logprobs(
        model,
        *batch,
        0.7,
        entropy=True,
        bucket_tokens=bucket_tokens,
        logits_budget_mib=_budget(head_chunk),
    )
    assert torch.allclose(got, want, atol=2e-6)
    assert torch.allclose(got_ent, want_ent, atol=2e-6)
    assert (got[cmask == 0] == 0).all() and (got[cmask == 1] < 0).all()
    got_grads = _grads(model, (got * weights).sum() + got_ent.sum())
    assert len(got_grads) == len(want_grads)
    for a, b in zip(got_grads, want_grads, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_the_head_never_sees_more_than_a_chunk_of_positions():
    """The memory claim: with chunks of 3 rows, no call of the LM head (forward, or recomputed
    in the backward) gets more than 3 positions, and the model's own call of it none.

    Rows (prompt + completion): 9, 3, 3 and 8 tokens; buckets of 9 tokens hold row 0, row 3,
    then rows 1 and 2, with 4, 6 and 2 completion tokens. The first two are chunked (3 + 1,
    3 + 3) and recomputed in the backward; the 2 of the last fit the budget and are kept."""
    model = _model("llama").train()
    seen: list[int] = []
    hook = model.lm_head.register_forward_hook(
        lambda _m, args, _out: seen.append(args[0].reshape(-1, args[0].shape[-1]).shape[0])
    )
    got, _ = completion_logprobs(model, *_batch(), bucket_tokens=9, logits_budget_mib=_budget(3))
    forward_calls = list(seen)
    got.sum().backward()
    hook.remove()
    assert forward_calls == [0, 3, 1, 0, 3, 3, 0, 2]  # each bucket: the model's call, then chunks
    assert sorted(seen[len(forward_calls) :]) == [1, 3, 3, 3]


def test_a_model_without_a_plain_head_gets_its_own_logits(monkeypatch):
    """A head the fast path does not know (e.g. soft-capped logits) is never applied alone:
    the model's own logits are read instead, with the same result."""
    model = _model("qwen2")
    batch = _batch()
    want, _ = _padded(model, batch, 1.0)
    monkeypatch.setattr(forward, "PLAIN_HEAD_TYPES", frozenset())
    seen: list[int] = []
    hook = model.lm_head.register_forward_hook(lambda _m, args, _o: seen.append(args[0].shape[1]))
    with torch.no_grad():
        got, _ = completion_logprobs(model, *batch, bucket_tokens=9)
    hook.remove()
    assert torch.allclose(got, want, atol=2e-6)
    assert min(seen) > 0  # the head ran on whole rows, not on an empty slice


def test_lora_policy_and_its_adapters_off_reference_match_the_padded_forward():
    from grpo.config import LoRAConfig
    from grpo.models import lora

    model = lora.wrap(_model("qwen2"), LoRAConfig(enabled=True, r=4, train_embeddings=True))
    with torch.no_grad():  # adapters away from their zero start, so that they count
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    batch = _batch()
    results = {}
    for off in (False, True):
        ctx = lora.adapters_off(model) if off else contextlib.nullcontext()
        with ctx, torch.no_grad():
            want, _ = _padded(model, batch, 1.0)
            results[off], _ = completion_logprobs(
                model, *batch, bucket_tokens=9, logits_budget_mib=_budget(3)
            )
        assert torch.allclose(results[off], want, atol=2e-6)
    # the adapters changed the policy, so the two comparisons were of different models
    assert not torch.allclose(results[False], results[True], atol=1e-3)


@pytest.mark.parametrize("head_chunk", [0, 3])
def test_truncated_log_probs_are_chunked_within_the_budget(head_chunk):
    """top-k/top-p scoring takes the chunked head too: the same log-probs, outside flags and
    gradients as the truncation of one padded forward's logits, and with a budget of 3 rows'
    logits no head call sees more than one row (the truncation makes three copies)."""
    from grpo.algo.logprobs import truncated_token_logprobs

    model = _model("llama").train()
    batch = _batch()
    pids, pmask, cids, cmask = batch
    logits = completion_logits(model, pids, pmask, cids, cmask)
    want, want_out = truncated_token_logprobs(logits, cids, 0.7, 4, 0.8)
    want = want * cmask
    weights = torch.arange(1, cmask.numel() + 1, dtype=torch.float32).view(cmask.shape)
    want_grads = _grads(model, (want * weights).sum())
    seen: list[int] = []
    hook = model.lm_head.register_forward_hook(
        lambda _m, args, _out: seen.append(args[0].reshape(-1, args[0].shape[-1]).shape[0])
    )
    outside = torch.zeros(cmask.shape, dtype=torch.bool)
    got, _ = completion_logprobs(model, *batch, 0.7, logits_budget_mib=_budget(head_chunk),
                                 truncation=(4, 0.8), outside=outside)  # fmt: skip
    hook.remove()
    assert torch.allclose(got, want, atol=2e-6)
    assert (outside == (want_out & cmask.bool())).all() and outside.any()
    assert max(seen) <= (1 if head_chunk else int(cmask.sum()))
    for a, b in zip(_grads(model, (got * weights).sum()), want_grads, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
