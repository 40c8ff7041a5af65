"""Hand-computed policy loss: every aggregation, clipping on both sides, k3, GSPO, micro-batches."""

import math

import pytest
import torch

from grpo.algo import k3_kl, policy_loss, token_entropy, token_logprobs

MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
ZERO = torch.zeros(2, 3)


def _loss(adv, logps=ZERO, old=ZERO, mask=MASK, **kw):
    return policy_loss(logps, old, adv, mask, **kw)


def test_ratio_one_gives_minus_advantage_per_token():
    # per-token loss = -A; seq 0 has 2 tokens (A=1), seq 1 has 3 tokens (A=-2)
    adv = torch.tensor([1.0, -2.0])
    assert _loss(adv, loss_type="grpo")[0].item() == pytest.approx((-1 + 2) / 2)
    assert _loss(adv, loss_type="bnpo")[0].item() == pytest.approx((-2 + 6) / 5)
    assert _loss(adv, loss_type="dapo")[0].item() == pytest.approx(4 / 5)
    assert _loss(adv, loss_type="dapo", num_items=10)[0].item() == pytest.approx(4 / 10)
    dr = _loss(adv, loss_type="dr_grpo", max_completion_length=4)[0].item()
    assert dr == pytest.approx(4 / (2 * 4))


def test_clipping_high_side_for_positive_advantage():
    logps = torch.tensor([[math.log(1.5), 0.0]])
    mask = torch.ones(1, 2)
    loss, m = policy_loss(
        logps, torch.zeros(1, 2), torch.tensor([1.0]), mask, loss_type="bnpo", eps_high=0.2
    )
    # token 0: min(1.5, 1.2) = 1.2; token 1: 1.0 -> loss = -(1.2 + 1.0) / 2
    assert loss.item() == pytest.approx(-1.1)
    assert m["clip_ratio/high_mean"] == pytest.approx(0.5)
    assert m["clip_ratio/low_mean"] == 0.0
    assert m["ratio_mean"] == pytest.approx(1.25)
    # clip-higher: eps_high 0.6 leaves 1.5 unclipped
    loss, m = policy_loss(
        logps, torch.zeros(1, 2), torch.tensor([1.0]), mask, loss_type="bnpo", eps_high=0.6
    )
    assert loss.item() == pytest.approx(-1.25)
    assert m["clip_ratio/high_mean"] == 0.0


def test_clipping_low_side_for_negative_advantage_and_gradient_stops():
    logps = torch.tensor([[math.log(0.5)]], requires_grad=True)
    loss, m = policy_loss(logps, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1))
    # -min(0.5 * -1, 0.8 * -1) = 0.8: the clipped branch, no gradient
    assert loss.item() == pytest.approx(0.8)
    assert m["clip_ratio/low_mean"] == 1.0
    loss.backward()
    assert logps.grad.item() == 0.0


def test_unclipped_gradient_is_minus_ratio_times_advantage():
    logps = torch.tensor([[0.1]], requires_grad=True)
    loss, _ = policy_loss(logps, torch.zeros(1, 1), torch.tensor([2.0]), torch.ones(1, 1))
    loss.backward()
    assert logps.grad.item() == pytest.approx(-2.0 * math.exp(0.1))


def test_k3_kl_hand_values_and_beta_term():
    logps = torch.tensor([[0.0, math.log(2.0)]])
    ref = torch.tensor([[0.0, 0.0]])
    # d = ref - logp = (0, -log 2): k3 = (0, 0.5 + log 2 - 1)
    k3 = k3_kl(logps, ref)
    assert k3[0, 0].item() == 0.0
    assert k3[0, 1].item() == pytest.approx(0.5 + math.log(2) - 1)
    mask = torch.ones(1, 2)
    loss, m = policy_loss(
        logps, logps.detach(), torch.zeros(1), mask, ref_logps=ref, beta=0.1, loss_type="bnpo"
    )
    assert m["kl"] == pytest.approx((0.5 + math.log(2) - 1) / 2)
    assert loss.item() == pytest.approx(0.1 * m["kl"])
    assert (k3_kl(torch.randn(50), torch.randn(50)) >= 0).all()


def test_gspo_sequence_ratio_is_geometric_mean():
    logps = torch.tensor([[math.log(1.1), math.log(1.5), 5.0]])  # third token masked out
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, m = policy_loss(
        logps,
        torch.zeros(1, 3),
        torch.tensor([1.0]),
        mask,
        importance_level="sequence",
        eps_low=0.5,
        eps_high=0.5,
        loss_type="bnpo",
    )
    s = math.sqrt(1.1 * 1.5)
    assert loss.item() == pytest.approx(-s)
    assert m["ratio_mean"] == pytest.approx(s)


def test_per_token_advantages_are_accepted():
    adv = torch.tensor([[1.0, 2.0, 9.0], [0.0, 0.0, 3.0]])
    loss, _ = _loss(adv, loss_type="bnpo")
    assert loss.item() == pytest.approx(-(1 + 2 + 3) / 5)


def test_dapo_is_invariant_to_micro_batching():
    torch.manual_seed(0)
    logps = torch.randn(6, 5) * 0.1
    old = torch.randn(6, 5) * 0.1
    adv = torch.randn(6)
    mask = (torch.rand(6, 5) > 0.3).float()
    whole, _ = policy_loss(logps, old, adv, mask, loss_type="dapo")
    n = mask.sum().item()
    parts = sum(
        policy_loss(logps[s], old[s], adv[s], mask[s], loss_type="dapo", num_items=n)[0]
        for s in (slice(0, 2), slice(2, 3), slice(3, 6))
    )
    assert parts.item() == pytest.approx(whole.item(), rel=1e-6)
    # bnpo is not: the local denominators differ
    bn = sum(
        policy_loss(logps[s], old[s], adv[s], mask[s], loss_type="bnpo")[0]
        for s in (slice(0, 2), slice(2, 6))
    )
    assert bn.item() != pytest.approx(whole.item(), rel=1e-3)


def test_bad_arguments_raise_value_error_naming_them():
    adv = torch.zeros(2)
    with pytest.raises(ValueError, match="loss_type"):
        _loss(adv, loss_type="ppo")
    with pytest.raises(ValueError, match="importance_level"):
        _loss(adv, importance_level="word")
    with pytest.raises(ValueError, match="old_logps"):
        policy_loss(ZERO, torch.zeros(2, 4), adv, MASK)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(ZERO, ZERO, torch.zeros(3), MASK)
    with pytest.raises(ValueError, match="max_completion_length"):
        _loss(adv, loss_type="dr_grpo")
    with pytest.raises(ValueError, match="ref_logps"):
        _loss(adv, beta=0.1)


def test_token_logprobs_match_log_softmax_with_temperature():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 7)
    ids = torch.randint(0, 7, (2, 4))
    ref = torch.log_softmax(logits / 0.7, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(token_logprobs(logits, ids, 0.7, chunk_rows=3), ref, atol=1e-6)
    p = torch.softmax(logits, -1)
    ent = -(p * p.log()).sum(-1)
    assert torch.allclose(token_entropy(logits, chunk_rows=5), ent, atol=1e-5)
    uniform = token_entropy(torch.zeros(1, 1, 8))
    assert uniform.item() == pytest.approx(math.log(8))
