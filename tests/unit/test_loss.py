"""Hand-computed policy loss: every aggregation, clipping on both sides, k3, GSPO, micro-batches."""

import math

import pytest
import torch

from grpo.algo import k3_kl, policy_loss, token_entropy, token_logprobs
from grpo.algo.loss import ObjectiveParams

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
        logps,
        torch.zeros(1, 2),
        torch.tensor([1.0]),
        mask,
        loss_type="bnpo",
        params=ObjectiveParams(eps_high=0.2),
    )
    # token 0: min(1.5, 1.2) = 1.2; token 1: 1.0 -> loss = -(1.2 + 1.0) / 2
    assert loss.item() == pytest.approx(-1.1)
    assert m["clip_ratio/high_mean"] == pytest.approx(0.5)
    assert m["clip_ratio/low_mean"] == 0.0
    assert m["ratio_mean"] == pytest.approx(1.25)
    # clip-higher: eps_high 0.6 leaves 1.5 unclipped
    loss, m = policy_loss(
        logps,
        torch.zeros(1, 2),
        torch.tensor([1.0]),
        mask,
        loss_type="bnpo",
        params=ObjectiveParams(eps_high=0.6),
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
        params=ObjectiveParams(eps_low=0.5, eps_high=0.5),
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


def _gspo_grads(loss_type: str) -> list[list[float]]:
    """Gradients of the loss w.r.t. each token log-prob for two sequences of lengths 1 and 3,
    advantages +1 and -1, pi_theta = pi_old (every sequence ratio 1, nothing clipped)."""
    logps = torch.tensor([[-1.0, 0.0, 0.0], [-0.5, -0.7, -0.2]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    loss, _ = policy_loss(
        logps, logps.detach(), torch.tensor([1.0, -1.0]), mask,
        importance_level="sequence", loss_type=loss_type,
    )  # fmt: skip
    loss.backward()
    return (logps.grad * mask).tolist()


def test_gspo_weights_sequences_equally_with_grpo_aggregation():
    """GSPO paper: J = 1/G sum_i min(s_i A_i, ...), s_i = exp(mean_t log rho_it). With s_i = 1,
    dJ/dlogp_it = A_i / (G |o_i|): -(+1)/(2*1) = -0.5 for the short sequence's token and
    -(-1)/(2*3) = +1/6 for each of the long one's (the loss is -J)."""
    g = _gspo_grads("grpo")
    assert g[0][0] == pytest.approx(-0.5)
    assert g[1] == pytest.approx([1 / 6] * 3)


def test_gspo_with_a_token_weighted_aggregation_weights_sequences_by_length():
    """dapo: every token carries its sequence's loss l_i = -s_i A_i, and the 4 tokens are
    averaged: loss = (1 * l_1 + 3 * l_2) / 4. dl_i/dlogp_it = -A_i / |o_i|, so the short
    sequence's token gets (1/4) * (-1) = -0.25 and each long one (3/4) * (+1/3) = +0.25."""
    g = _gspo_grads("dapo")
    assert g[0][0] == pytest.approx(-0.25)
    assert g[1] == pytest.approx([0.25] * 3)


def test_gspo_default_aggregation_is_the_papers():
    from grpo.config import load_config

    assert load_config(None, ["grpo.importance_level=sequence"]).grpo.loss_type == "grpo"
    cfg = load_config(None, ["grpo.importance_level=sequence", "grpo.loss_type=dapo"])
    assert cfg.grpo.loss_type == "dapo"  # an explicit choice stays


def test_log_ratio_and_k3_are_clamped_and_the_share_is_reported():
    """A token 30 nats away from pi_old would make exp() overflow in float16 and huge in float32:
    the log-ratio is clamped at 20 (that token's share is reported), k3 at 10."""
    logps = torch.tensor([[0.0, -30.0, -1.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-30.0, -30.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.0, -1.0, -1.0, -40.0]])
    mask = torch.ones(1, 4)
    loss, m = policy_loss(logps, old, torch.tensor([1.0]), mask, ref_logps=ref, beta=0.1,
                          params=ObjectiveParams(eps_high=1e9))  # fmt: skip
    assert torch.isfinite(loss)
    assert m["clamp/log_ratio_frac"] == pytest.approx(1 / 4)  # token 0: +30 > 20
    # k3 of token 1: d = ref - logp = 29, clamped to 20, exp(20) - 21 > 10: clamped to 10
    # k3 of token 3: d = -39 -> -20: exp(-20) + 19 > 10: clamped too
    assert m["clamp/k3_frac"] == pytest.approx(2 / 4)
    assert float(k3_kl(torch.tensor([-30.0]), torch.tensor([-1.0]))) == pytest.approx(10.0)
    loss.backward()
    assert torch.isfinite(logps.grad).all()


def _one_token(logp: float, adv: float, **kw):
    """loss and d loss / d logp of one token with pi_old = 1 (old log-prob 0): rho = e^logp."""
    lp = torch.tensor([[logp]], requires_grad=True)
    loss, m = policy_loss(lp, torch.zeros(1, 1), torch.tensor([adv]), torch.ones(1, 1), **kw)
    loss.backward()
    return loss.item(), lp.grad.item(), m


def test_cispo_clips_a_detached_weight_and_keeps_the_gradient():
    # rho 1.5, A 1: loss = -1.5 * 1 * log 1.5; gradient -1.5 (the weight is a constant)
    loss, grad, _ = _one_token(math.log(1.5), 1.0, objective="cispo")
    assert loss == pytest.approx(-1.5 * math.log(1.5)) and grad == pytest.approx(-1.5)
    # capped at 1.2: gradient -1.2; PPO's clip (eps_high 0.28) gives 0 at this rho
    capped = ObjectiveParams(cispo_max_weight=1.2)
    assert _one_token(math.log(1.5), 1.0, objective="cispo", params=capped)[1] == pytest.approx(
        -1.2
    )
    assert _one_token(math.log(1.5), 1.0)[1] == 0.0
    # no lower bound: rho 0.5, A -1 -> weight 0.5, gradient +0.5
    assert _one_token(math.log(0.5), -1.0, objective="cispo")[1] == pytest.approx(0.5)


def test_sapo_is_a_soft_gate_with_the_policy_gradient_at_rho_one():
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    # rho 1.5, A 1, tau 1: loss -4 sigmoid(0.5); d/d logp = rho * -4 sigmoid'(0.5)
    loss, grad, _ = _one_token(math.log(1.5), 1.0, objective="sapo")
    assert loss == pytest.approx(-4 * sig(0.5))
    assert grad == pytest.approx(-1.5 * 4 * sig(0.5) * (1 - sig(0.5)))
    # A -1 uses tau_neg 1.05: loss (4 / 1.05) sigmoid(1.05 * 0.5)
    assert _one_token(math.log(1.5), -1.0, objective="sapo")[0] == pytest.approx(
        4 / 1.05 * sig(0.525)
    )
    # at rho = 1 every objective's gradient is the policy gradient, -A
    for obj in ("clip", "cispo", "sapo"):
        assert _one_token(0.0, 2.0, objective=obj)[1] == pytest.approx(-2.0), obj


def test_entropy_bonus_is_aggregated_with_the_loss():
    ent = torch.tensor([[2.0, 1.0, 7.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    zero = torch.zeros(1, 3)
    loss, _ = policy_loss(zero, zero, torch.zeros(1), mask, entropy=ent, entropy_coef=0.1,
                          loss_type="bnpo")  # fmt: skip
    assert loss.item() == pytest.approx(-0.1 * 1.5)  # minus coef x the token mean of (2, 1)
    loss.backward()
    assert ent.grad[0].tolist() == pytest.approx([-0.05, -0.05, 0.0])
    # no entropy given: no term, whatever the coefficient
    plain, _ = policy_loss(zero, zero, torch.zeros(1), mask, entropy_coef=0.1, loss_type="bnpo")
    assert plain.item() == 0.0
