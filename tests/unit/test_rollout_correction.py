"""The rollout correction by hand: importance weights pi_old / mu at token and sequence level,
truncated or masked, the mismatch's KL estimates, and the weights inside the policy loss."""

import math

import pytest
import torch

from grpo.algo import policy_loss
from grpo.algo.logprobs import truncated_token_logprobs
from grpo.algo.rollout_correction import correction_weights, mismatch_metrics, ratio_stats
from grpo.config import ConfigError, load_config

LN = math.log


def _weights(old, sampler, mask, **kw):
    return correction_weights(torch.tensor(old), torch.tensor(sampler), torch.tensor(mask), **kw)


def test_token_weights_are_truncated_or_masked_above_the_threshold():
    # pi_old / mu = 1, 3, 0.5 and a padding token whose log-probs are garbage
    old, sampler, mask = [[0.0, LN(3.0), LN(0.5), 7.0]], [[0.0, 0.0, 0.0, 0.0]], [[1, 1, 1, 0]]
    w, over = _weights(old, sampler, mask, threshold=2.0)
    assert w[0].tolist() == pytest.approx([1.0, 2.0, 0.5, 0.0])
    assert over.tolist() == [[False, True, False, False]]
    w, over = _weights(old, sampler, mask, mode="mask", threshold=2.0)
    assert w[0].tolist() == pytest.approx([1.0, 0.0, 0.5, 0.0])
    # a weight exactly at the threshold is kept whole
    w, over = _weights([[LN(2.0)]], [[0.0]], [[1]], mode="mask", threshold=2.0)
    assert w.item() == pytest.approx(2.0) and not over.item()
    # an enormous ratio is masked to exactly 0, never inf * 0 = nan
    w, _ = _weights([[0.0]], [[-1000.0]], [[1]], mode="mask")
    assert w.item() == 0.0


def test_geometric_weights_are_the_geometric_mean_of_the_tokens_weights():
    # sequence 0: token ratios 4 and 1 (and a padding token): geometric mean 2, at the cap;
    # sequence 1: ratios 9 and 1: mean 3, over a cap of 2.5
    old = [[LN(4.0), 0.0, 5.0], [LN(9.0), 0.0, 0.0]]
    sampler, mask = [[0.0] * 3] * 2, [[1, 1, 0], [1, 1, 1]]
    mask[1][2] = 0
    w, over = _weights(old, sampler, mask, level="geometric", threshold=2.5)
    assert w.flatten().tolist() == pytest.approx([2.0, 2.0, 0.0, 2.5, 2.5, 0.0])
    assert over.tolist() == [[False, False, False], [True, True, False]]
    w, _ = _weights(old, sampler, mask, level="geometric", mode="mask", threshold=2.5)
    assert w.flatten().tolist() == pytest.approx([2.0, 2.0, 0.0, 0.0, 0.0, 0.0])


def test_sequence_weights_are_the_product_as_trls_sequence_modes():
    # TRL's sequence_mask: ratio = exp(sum of the log-ratios). Sequence 0: token ratios 1.5 and
    # 1.5 (and padding): product 2.25 over a cap of 2, geometric mean 1.5 under it; sequence 1:
    # ratios 1.2 and 0.5: product 0.6, inside [0.5, 2]; sequence 2: 0.8 and 0.5, product 0.4
    # under a floor of 0.5
    old = [[LN(1.5), LN(1.5), 9.0], [LN(1.2), LN(0.5), 0.0], [LN(0.8), LN(0.5), 0.0]]
    sampler, mask = [[0.0] * 3] * 3, [[1, 1, 0], [1, 1, 0], [1, 1, 0]]
    w, over = _weights(old, sampler, mask, level="sequence", mode="mask", threshold=2.0,
                       min_threshold=0.5)  # fmt: skip
    assert w.flatten().tolist() == pytest.approx([0.0, 0.0, 0.0, 0.6, 0.6, 0.0, 0, 0, 0])
    assert over.tolist() == [[True, True, False], [False, False, False], [True, True, False]]
    # the geometric level keeps the first sequence (1.5 < 2): TRL's sequence_mask would not
    g, _ = _weights(old, sampler, mask, level="geometric", mode="mask", threshold=2.0)
    assert g[0, :2].tolist() == pytest.approx([1.5, 1.5])
    # truncate clamps the product into [C_min, C_max]
    w, _ = _weights(old, sampler, mask, level="sequence", threshold=2.0, min_threshold=0.5)
    assert w.flatten().tolist() == pytest.approx([2.0, 2.0, 0.0, 0.6, 0.6, 0.0, 0.5, 0.5, 0])
    # TRL's summary: one weight per sequence (3), after masking
    stats = ratio_stats(_weights(old, sampler, mask, level="sequence", mode="mask",
                                 threshold=2.0, min_threshold=0.5)[0], torch.tensor(mask),
                        "sequence")  # fmt: skip
    assert stats == pytest.approx({"n": 3.0, "sum": 0.6, "min": 0.0, "max": 0.6})


def test_the_geometric_weight_does_not_grow_or_shrink_with_length():
    # the same small per-token mismatch on a short and a long sequence: the mean log-ratio gives
    # both exp(delta); the summed log-ratio would give exp(10 delta) and exp(500 delta) = e^5
    delta = 0.01
    for length in (10, 500):
        w, over = _weights([[delta] * length], [[0.0] * length], [[1] * length],
                           level="geometric", threshold=2.0)  # fmt: skip
        assert w[0, 0].item() == pytest.approx(math.exp(delta)) and not over.any()
    assert math.exp(500 * delta) > 2.0  # the product would have been cut at the cap


def test_the_mismatch_kl_estimates_by_hand():
    # pi = 0.5 where mu = 1: k1 = log mu - log pi = ln 2; k3 = (r - 1) - ln r = -0.5 + ln 2
    m = mismatch_metrics(torch.tensor([[LN(0.5), 0.0]]), torch.tensor([[0.0, 0.0]]),
                         torch.tensor([[1, 1]]))  # fmt: skip
    assert m["kl_k1"] == pytest.approx(LN(2.0)) and m["tokens"] == 2.0
    assert m["kl_k3"] == pytest.approx(-0.5 + LN(2.0))
    # the same policies: both 0
    same = mismatch_metrics(torch.zeros(1, 3), torch.zeros(1, 3), torch.ones(1, 3))
    assert same["kl_k1"] == 0.0 and same["kl_k3"] == 0.0


def test_the_weights_scale_the_policy_term_and_its_gradient():
    # mu = 1 (old = logps): per-token loss -A w, gradient d/dlogp = -A w / tokens (dapo)
    logps = torch.zeros(1, 3, requires_grad=True)
    w = torch.tensor([[1.0, 2.0, 0.5]])
    loss, _ = policy_loss(logps, logps.detach(), torch.tensor([2.0]), torch.ones(1, 3),
                          is_weights=w)  # fmt: skip
    assert loss.item() == pytest.approx(-2.0 * (1.0 + 2.0 + 0.5) / 3)
    loss.backward()
    assert logps.grad[0].tolist() == pytest.approx([-2.0 / 3, -4.0 / 3, -1.0 / 3])
    # weights of 1 change nothing
    plain = policy_loss(torch.zeros(1, 3), torch.zeros(1, 3), torch.tensor([2.0]),
                        torch.ones(1, 3))[0]  # fmt: skip
    ones = policy_loss(torch.zeros(1, 3), torch.zeros(1, 3), torch.tensor([2.0]),
                       torch.ones(1, 3), is_weights=torch.ones(1, 3))[0]  # fmt: skip
    assert ones.item() == plain.item()
    # the KL term is not weighted: with A = 0 the loss is beta * k3 whatever the weights
    ref = torch.full((1, 3), -0.1)
    with_w = policy_loss(torch.zeros(1, 3), torch.zeros(1, 3), torch.tensor([0.0]),
                         torch.ones(1, 3), ref_logps=ref, beta=0.5, is_weights=w)[0]  # fmt: skip
    without = policy_loss(torch.zeros(1, 3), torch.zeros(1, 3), torch.tensor([0.0]),
                          torch.ones(1, 3), ref_logps=ref, beta=0.5)[0]  # fmt: skip
    assert with_w.item() == pytest.approx(without.item()) and without.item() > 0


def test_trls_names_load_and_a_biased_combination_is_refused():
    cfg = load_config(None, ["grpo.vllm_importance_sampling_correction=true",
                             "grpo.vllm_importance_sampling_mode=sequence_mask",
                             "grpo.vllm_importance_sampling_cap=3"])  # fmt: skip
    g = cfg.grpo
    assert (g.rollout_correction, g.rollout_correction_level, g.rollout_correction_mode,
            g.rollout_correction_threshold) == (True, "sequence", "mask", 3.0)  # fmt: skip
    # TRL's current bound names; the deprecated cap and clip_max are one setting
    g = load_config(None, ["grpo.vllm_importance_sampling_correction=true",
                           "grpo.vllm_importance_sampling_clip_max=2.5",
                           "grpo.vllm_importance_sampling_clip_min=0.4"]).grpo  # fmt: skip
    assert (g.rollout_correction_threshold, g.rollout_correction_min_threshold) == (2.5, 0.4)
    with pytest.raises(ConfigError, match="same setting"):
        load_config(None, ["grpo.vllm_importance_sampling_cap=3",
                           "grpo.vllm_importance_sampling_clip_max=3"])  # fmt: skip
    with pytest.raises(ConfigError, match="vllm_importance_sampling_mode: 'token_clip'"):
        load_config(None, ["grpo.vllm_importance_sampling_mode=token_clip"])
    # with top-p sampling both sides' log-probs are over the truncated distribution
    assert load_config(None, ["grpo.rollout_correction=true", "grpo.top_p=0.9"]).grpo.truncates
    with pytest.raises(ConfigError, match="old_logprobs sampler"):
        load_config(None, ["grpo.rollout_correction=true", "grpo.mu=2",
                           "grpo.old_logprobs=sampler"])  # fmt: skip
    # a threshold without the correction would be ignored
    with pytest.raises(ConfigError, match="grpo.rollout_correction_threshold is set but would "
                       "be ignored: it needs grpo.rollout_correction=true"):  # fmt: skip
        load_config(None, ["grpo.rollout_correction_threshold=3"])


def test_the_log_prob_over_a_truncated_distribution_by_hand():
    # probabilities 0.5, 0.3, 0.15, 0.05; top_p 0.7 keeps the first two (mass 0.8): the kept
    # ones renormalise to 0.5 / 0.8 and 0.3 / 0.8; the third is outside, flagged
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(1, 3, 4)
    lp, outside = truncated_token_logprobs(logits, torch.tensor([[0, 1, 2]]), 1.0, 0, 0.7)
    assert lp[0, :2].tolist() == pytest.approx([LN(0.5 / 0.8), LN(0.3 / 0.8)])
    assert outside.tolist() == [[False, False, True]]
    # the one outside is scored over the kept set and itself: 0.15 / 0.95, a probability
    assert lp[0, 2].item() == pytest.approx(LN(0.15 / 0.95))
    # top_k 3 at temperature 0.5: softmax of doubled logits over the three largest
    lp, outside = truncated_token_logprobs(logits, torch.tensor([[2, 2, 3]]), 0.5, 3, 1.0)
    p = torch.tensor([0.5, 0.3, 0.15]) ** 2
    assert lp[0, 0].item() == pytest.approx(LN(float(p[2] / p.sum())))
    assert outside.tolist() == [[False, False, True]]
    # the gradient flows to the kept logits only
    z = torch.tensor([[[1.0, 0.5, -3.0]]], requires_grad=True)
    truncated_token_logprobs(z, torch.tensor([[0]]), 1.0, 2, 1.0)[0].sum().backward()
    assert z.grad[0, 0, 2].item() == 0.0 and z.grad[0, 0, 0].item() > 0


def test_the_gap_quantiles_count_only_the_masked_tokens():
    from grpo.engine.update import _Gap

    gap = _Gap()
    # 101 counted gaps 0.00, 0.01, ..., 1.00 over two calls; the masked tokens' 9.0 left out
    trainer = torch.tensor([[i / 100 for i in range(60)] + [9.0] * 4])
    gap.add(trainer, torch.zeros_like(trainer), torch.tensor([[1] * 60 + [0] * 4]))
    rest = torch.tensor([[i / 100 for i in range(60, 101)]])
    gap.add(torch.zeros_like(rest), rest, torch.ones_like(rest))
    q = gap.quantiles()
    assert q == pytest.approx({"p50": 0.50, "p90": 0.90, "p99": 0.99})
    assert gap.largest == pytest.approx(1.0) and gap.tokens == 101
